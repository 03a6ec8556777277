"""The reward model's worker: a sequence classifier that scores responses (common/reward_model.py says what it
reads)."""

from __future__ import annotations

import torch

from common.dataproto import DataProto
from common.fsdp_worker import FSDPWorker
from common.memory import measured


class RewardModelWorker(FSDPWorker):
    """A reward model: a sequence-classification model with one label, sharded like the policy, that scores and never
    trains (see FSDPWorker.setup). Its score of a sequence is its head's output at the sequence's last token."""

    language_model = False
    packs = False  # it reads each sequence's last token from the padded rectangle

    auto_model = "AutoModelForSequenceClassification"

    def _checked(self, model, model_path: str):
        if model.config.num_labels != 1 or not isinstance(getattr(model, "score", None), torch.nn.Linear):
            raise ValueError(
                f"--reward-model {model_path}: a reward model is a ...ForSequenceClassification with one label and a "
                f"`score` head (as Llama, Qwen, Mistral and Gemma ones are); this one has {model.config.num_labels} "
                f"labels and {type(getattr(model, 'score', None)).__name__} as `score`"
            )
        return model

    @measured
    @torch.no_grad()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`rm_scores`: one per right-padded sequence of `data` (`input_ids`, `attention_mask`, `position_ids`)."""
        self.model.eval()
        head_outputs = []
        # transformers pools at the last token that is not the pad token, which is the wrong one when the pad token is
        # also the end-of-turn token: read the head at every position and take the last real one here.
        handle = self.model.score.register_forward_hook(lambda module, args, output: head_outputs.append(output))

        def forward(micro: DataProto):
            head_outputs.clear()
            self.model(**{key: micro[key] for key in ("input_ids", "attention_mask", "position_ids")}, use_cache=False)
            last = micro["attention_mask"].sum(-1, keepdim=True) - 1
            return (head_outputs[0][..., 0].float().gather(1, last)[:, 0],)

        try:
            [scores] = self._in_micro_batches(data, forward)
        finally:
            handle.remove()
        return DataProto.from_dict({"rm_scores": scores})
