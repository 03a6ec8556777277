"""Packing on a GPU: one packed row through flash-attention's variable-length kernel gives the padded outputs.

The same check on the CPU (SDPA, rows of packed sequences) is tests/test_packing.py. Run on a machine with a CUDA GPU
and flash-attention installed: `pytest tests/gpu`.
"""

import pytest
import torch

from common.fsdp_worker import attention_implementation
from common.layouts import response_log_probs, response_outputs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or attention_implementation(torch.device("cuda", 0)) != "flash_attention_2",
    reason="needs a CUDA GPU that runs flash-attention 2; on a GPU machine see the README, 'What ran where'",
)


def test_one_packed_row_in_flash_attention_gives_the_padded_log_probs(tiny_model):
    from test_packing import uneven_batch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16, attn_implementation="flash_attention_2")
    model = model.cuda()
    batch = uneven_batch(model.config.vocab_size).to("cuda")
    mask = batch["attention_mask"][:, 7:].bool()
    padded, packed = (
        response_log_probs(response_outputs(model, batch, layout, language_model=True), batch["responses"][mask], 1.0, False)[
            0
        ]
        for layout in ("padded", "one row")
    )
    # bf16: the two kernels round differently; attention across sequences would move log-probs by whole units
    assert (padded - packed).abs().mean() < 0.02
