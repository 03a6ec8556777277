"""Packed sequences in one row through common/attention.py's varlen attention, and which attention a worker picks.

PyTorch's FlashAttention varlen kernel runs on CUDA only: here, on the CPU, the same attention takes each sequence
through SDPA in turn (its fallback), which these tests check against padded micro-batches, with the sequences' bounds
read off the position ids as on a GPU; tests/gpu/test_one_device.py runs the kernel itself against the padded rows."""

import torch
from helpers import long_batch, varlen_against_padded

from common.attention import VARLEN, choose, sequence_bounds
from common.fsdp_worker import attention_implementation


def test_a_worker_takes_flash_attn_then_torchs_varlen_kernel_on_ampere_gpus_in_bf16_and_sdpa_elsewhere():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert choose("cuda", 9, bf16, flash_attn=True, varlen=True) == "flash_attention_2"
    assert choose("cuda", 9, bf16, flash_attn=False, varlen=True) == VARLEN
    assert choose("cuda", 8, fp16, flash_attn=False, varlen=True) == VARLEN
    assert choose("cuda", 9, bf16, flash_attn=False, varlen=False) == "sdpa"  # torch before 2.10
    assert choose("cuda", 9, fp32, flash_attn=True, varlen=True) == "sdpa"  # FlashAttention computes in 16 bits only
    assert choose("cuda", 7, fp16, flash_attn=True, varlen=True) == "sdpa"  # before Ampere
    assert choose("cpu", 0, bf16, flash_attn=True, varlen=True) == "sdpa"
    assert attention_implementation(torch.device("cpu"), bf16) == "sdpa"  # this machine's, as a worker asks


def test_sequences_bounds_come_from_the_position_ids():
    positions = torch.cat([torch.arange(3), torch.arange(5), torch.arange(1)])[None]
    bounds, bound_list, longest = sequence_bounds(positions)
    assert bounds.dtype == torch.int32 and bound_list == [0, 3, 8, 9] and longest == 5
    assert sequence_bounds(positions)[0] is bounds  # once per forward, not per layer
    assert sequence_bounds(torch.arange(2, 6)[None])[1] == [0, 4]  # a row that does not start at 0 is one sequence


def test_one_row_through_the_varlen_attention_gives_the_padded_log_probs_entropies_and_gradients(tiny_model):
    """On the CPU in fp32, the varlen attention's fallback (the tiny model's two query heads share one key head)."""
    padded, varlen = varlen_against_padded(tiny_model, "cpu", torch.float32)
    assert torch.all(padded[0][long_batch(100)["attention_mask"][:, 140:].bool()] < 0)
    torch.testing.assert_close(varlen[0], padded[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(varlen[1], padded[1], rtol=1e-5, atol=1e-5)
    for name, gradient in padded[2].items():
        torch.testing.assert_close(varlen[2][name], gradient, rtol=1e-4, atol=1e-6)
