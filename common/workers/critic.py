"""The critic's worker: a value model sharded as the policy is (common/fsdp_worker.py), trained with the script's
value loss."""

from __future__ import annotations

import torch

from common.dataproto import DataProto
from common.fsdp_worker import FSDPWorker, lora_model
from common.layouts import response_outputs, rows_of
from common.memory import measured


class CriticWorker(FSDPWorker):
    """A value model: the policy's architecture with a scalar head over every token (see FSDPWorker.setup)."""

    language_model = False

    auto_model = "AutoModelForTokenClassification"
    model_kwargs = {"num_labels": 1}

    def _add_lora(self, model):
        # The value head is new: it trains in full beside the adapter.
        return lora_model(model, *self.lora_settings, "TOKEN_CLS", modules_to_save=["score"])

    def _forward(self, micro: DataProto) -> torch.Tensor:
        """The value of the state before each response token, 0 on padding."""
        response_mask = micro["attention_mask"][:, -micro["responses"].shape[1] :].bool()
        values = response_outputs(self.model, micro, self.layout, False, None, self.sequence_group, self.flex_from)[:, 0]
        return rows_of(values.float(), response_mask)

    @measured
    @torch.no_grad()
    def compute_values(self, data: DataProto) -> DataProto:
        self.model.eval()
        [values] = self._in_micro_batches(data, lambda micro: (self._forward(micro),))
        return DataProto.from_dict({"values": values})

    @measured
    def update(self, data: DataProto, loss_fn) -> dict:
        """Regress values with the script's `loss_fn(micro_batch, values, ...)`."""
        return self._update(data, loss_fn, self._update_forward)

    def _update_forward(self, micro: DataProto) -> torch.Tensor:
        return self._forward(micro)
