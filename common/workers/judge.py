"""The LLM judge's worker (common/judge.py asks it and reads its verdicts)."""

from __future__ import annotations

import torch

from common.dataproto import DataProto
from common.layouts import response_outputs
from common.memory import measured
from common.workers.policy import PolicyWorker


class JudgeWorker(PolicyWorker):
    """An LLM judge (common/judge.py): a language model sharded like the policy, with a rollout engine of its own
    (`generate`, for verdicts it writes out), that never trains and has no reference."""

    trains = False

    def setup(self, master, model_path: str, **settings) -> None:
        super().setup(master, model_path, use_reference=False, **settings)

    @measured
    @torch.no_grad()
    def verdict_log_probs(self, data: DataProto, yes_ids: list[int], no_ids: list[int]) -> DataProto:
        """For each question of `data` (with a one-token response, whose own token is not read): the log-probs of
        the next token being a Yes and a No (each summed over its ids) as `verdict_log_probs` [rows, 2], and the most
        likely next token as `top_tokens`."""
        self.model.eval()

        def forward(micro: DataProto):
            outputs = response_outputs(self.model, micro, self.layout, True, flex_from=self.flex_from)
            log_probs = torch.log_softmax(outputs.float(), -1)
            verdicts = [log_probs[:, yes_ids].logsumexp(-1), log_probs[:, no_ids].logsumexp(-1)]
            return torch.stack(verdicts, -1), log_probs.argmax(-1)

        verdicts, top_tokens = self._in_micro_batches(data, forward)
        return DataProto.from_dict({"verdict_log_probs": verdicts, "top_tokens": top_tokens})
