"""Packed rows and shared prompts through FlexAttention's block masks against padded micro-batches, on the tiny model.

On the CPU torch computes no gradient through FlexAttention: there the passes with gradients take the dense mask
(common/attention.py, runs_flex), which these tests check too; tests/gpu/test_one_device.py runs the same check on a
GPU, where the gradients go through the block masks."""

import pytest
import torch
from helpers import flex_against_padded, long_batch

from common.attention import CPU_WIDTH, GPU_WIDTH, flex_from, packed_segments, runs_flex, segment_block_mask
from common.layouts import (
    same_prompts,
    shared_prompt_mask,
    shared_prompt_places,
)


def block_mask_agrees(block_mask, dense: torch.Tensor) -> bool:
    """Whether `block_mask` marks empty the blocks of `dense` ([rows, 1, width, width]) that nobody sees, full those
    everybody sees, and its mask function gives `dense` in the partial ones."""
    rows, _, width, _ = dense.shape
    block = block_mask.BLOCK_SIZE[0]
    blocks = -(-width // block)
    padded = torch.nn.functional.pad(dense[:, 0], (0, blocks * block - width, 0, blocks * block - width))
    squares = padded.view(rows, blocks, block, blocks, block).transpose(2, 3)  # [rows, q block, kv block, q, kv]
    states = block_mask.to_dense()[:, 0].bool()  # a block is listed as partial or full
    full = torch.zeros_like(states)
    for row in range(rows):
        for q in range(blocks):
            for kv in block_mask.full_kv_indices[row, 0, q, : block_mask.full_kv_num_blocks[row, 0, q]].tolist():
                full[row, q, kv] = True
    places = torch.arange(width)
    by_mask_mod = block_mask.mask_mod(torch.arange(rows)[:, None, None], 0, places[None, :, None], places[None, None])
    in_width = torch.zeros_like(padded)
    in_width[:, :width, :width] = True
    whole_in_width = in_width.view(rows, blocks, block, blocks, block).transpose(2, 3).all(-1).all(-1)
    return (
        torch.equal(states, squares.any(-1).any(-1))
        and torch.equal(full & whole_in_width, squares.all(-1).all(-1) & whole_in_width)
        and torch.equal(by_mask_mod, dense[:, 0])
    )


def test_block_masks_say_who_sees_whom_as_the_dense_masks_do():
    batch = long_batch(100)
    mask = batch["attention_mask"].bool()
    _, width, rows, segments = shared_prompt_places(same_prompts(batch["input_ids"], mask, 120), mask, 120)
    assert width > 2 * 128
    assert block_mask_agrees(segment_block_mask(*segments), shared_prompt_mask(*segments))
    # packed sequences, three in a row of 300, then padding: each padding token a sequence of its own
    positions = torch.cat([torch.arange(100), torch.arange(150), torch.arange(30), torch.zeros(20, dtype=torch.long)])[None]
    sequence = packed_segments(positions)
    causal = torch.ones(300, 300, dtype=torch.bool).tril()
    dense = ((sequence[:, :, None] == sequence[:, None, :]) & causal)[:, None]
    assert block_mask_agrees(segment_block_mask(sequence), dense)


@pytest.mark.parametrize("layout", ["rows", "shared prompts"])
def test_block_masks_give_the_padded_log_probs_entropies_and_gradients(tiny_model, layout):
    padded, flex = flex_against_padded(tiny_model, "cpu", layout)
    (padded_log_probs, padded_entropy, padded_grads), (log_probs, entropy, grads) = padded, flex
    assert torch.all(padded_log_probs[long_batch(100)["attention_mask"][:, 140:].bool()] < 0)
    torch.testing.assert_close(log_probs, padded_log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, padded_entropy, rtol=1e-5, atol=1e-5)
    for name, gradient in padded_grads.items():
        torch.testing.assert_close(grads[name], gradient, rtol=1e-4, atol=1e-6)


def test_block_masks_for_wide_rows_on_the_cpu_without_gradients_and_on_a_gpu_with():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert flex_from(cpu, micro_batch_tokens=0) is None and flex_from(cpu, CPU_WIDTH) == CPU_WIDTH
    assert flex_from(gpu, micro_batch_tokens=0) is None and flex_from(gpu, CPU_WIDTH) is None
    assert flex_from(gpu, GPU_WIDTH) == GPU_WIDTH
    with torch.no_grad():
        assert runs_flex(CPU_WIDTH, cpu, CPU_WIDTH) and not runs_flex(CPU_WIDTH - 1, cpu, CPU_WIDTH)
    assert not runs_flex(CPU_WIDTH, cpu, CPU_WIDTH) and not runs_flex(1, gpu, None)
    assert runs_flex(GPU_WIDTH, gpu, GPU_WIDTH) and not runs_flex(GPU_WIDTH - 1, gpu, GPU_WIDTH)
