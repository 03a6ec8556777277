"""Attention without a square mask: packed rows and shared prompts through FlexAttention's block masks.

A dense mask ([rows, 1, width, width], one entry per pair of tokens) grows with the square of a row's width: a 32k
row's takes 1 GiB, and a GPU's SDPA given any mask leaves its flash kernel for one that reads it. A block mask keeps,
per 128 x 128 block of the square, whether it is empty, full or partial, and FlexAttention skips the empty blocks
and asks a mask function about the partial ones: a few kilobytes where the dense mask took gigabytes.

The model runs with this module's attention (`register`): FlexAttention where a forward passes a BlockMask as its
`attention_mask`, transformers' SDPA for everything else (generation, padded micro-batches), with the masks SDPA gets.
"""

from __future__ import annotations

import functools

import torch

ATTENTION = "hybridrl_flex"
BLOCK = 128  # FlexAttention's block: each side of the square splits into blocks this wide

# On the CPU, FlexAttention runs through torch.compile (C++ through gcc: 7 to 11 s the first time in a process, about
# a second for another width, see docs/loading-and-sync.md), and torch computes no gradient through it. From this
# width a log-prob pass over 8 packed sequences ran 3 times faster than SDPA's with its dense mask (4 times at 32k,
# where the mask took 5 GiB), so the compile pays for itself within a few steps; below it, the mask takes a few MB.
CPU_WIDTH = 4096
# On an H200 at 4096 tokens, SDPA with the dense mask ran the log-prob pass 3.5 times and the update 2.4 times faster
# than FlexAttention, whose Triton compile took 5 to 9 s more: a GPU takes block masks where the dense mask grows
# large instead, a quarter of a GiB a row (bool; SDPA makes a bf16 copy of it per layer call) from this width.
GPU_WIDTH = 16384


def available() -> bool:
    """Whether this torch has FlexAttention (2.5 and later)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def register() -> str:
    """Make this module's attention one transformers can load a model with; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


def flex_from(device: torch.device, micro_batch_tokens: int) -> int | None:
    """The narrowest rows a worker on `device` runs through block masks, if any (None), before its start-up check:
    rows from CPU_WIDTH wide on the CPU, GPU_WIDTH on a GPU, in workers whose micro-batches may hold that many tokens;
    those that never do (the tests' among them) pay no compile. Without FlexAttention in this torch, none: SDPA takes
    the dense mask."""
    if not available():
        return None
    width = CPU_WIDTH if device.type == "cpu" else GPU_WIDTH
    return width if micro_batch_tokens >= width else None


def runs_flex(width: int, device: torch.device, flex_from: int | None) -> bool:
    """Whether rows `width` wide attend through a block mask, for a worker whose rows from `flex_from` wide do (None:
    none do): on the CPU only without gradients, which torch does not compute through FlexAttention there."""
    return flex_from is not None and width >= flex_from and (device.type != "cpu" or not torch.is_grad_enabled())


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention call: FlexAttention with a BlockMask, SDPA with anything else."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None or dropout:
        raise NotImplementedError("a block mask's attention is plain: this layer has a window, soft-capping, sinks or dropout")
    enable_gqa = query.shape[1] != key.shape[1]
    output = compiled_flex_attention()(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=enable_gqa)
    return output.transpose(1, 2).contiguous(), None


def segment_block_mask(segment: torch.Tensor, part: torch.Tensor | None = None, width: int | None = None):
    """The BlockMask of rows whose tokens see the tokens before them in their own segment (`segment`, [rows, tokens],
    one id per token), and with `part` (0: a prompt, else a response's own id), only the prompt and their own part of
    it: shared_prompt_places' attention, or with no `part`, packed sequences'. Rows `width` wide (default: the
    tokens), the places past the tokens padding. The blocks' states come from the square a block row of queries at a
    time, so that at most [rows, BLOCK, width] of it exists at once."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, tokens = segment.shape
    width = width or tokens
    blocks = -(-width // BLOCK)
    pad = blocks * BLOCK - tokens
    # a padding place is a segment of its own, as shared_prompt_places makes one
    segment = torch.nn.functional.pad(segment, (0, pad), value=int(segment.min()) - 1) if pad else segment
    if pad:
        segment[:, tokens:] -= torch.arange(pad, device=segment.device)
    part = torch.zeros_like(segment) if part is None else torch.nn.functional.pad(part, (0, pad))

    def mask_mod(row, head, q, kv):
        seen = (segment[row, q] == segment[row, kv]) & (q >= kv)
        return seen & ((part[row, kv] == 0) | (part[row, q] == part[row, kv]))

    places = torch.arange(blocks * BLOCK, device=segment.device)
    any_seen, all_seen = [], []
    for start in range(0, blocks * BLOCK, BLOCK):
        q = places[start : start + BLOCK]
        square = mask_mod(torch.arange(rows, device=segment.device)[:, None, None], 0, q[None, :, None], places[None, None])
        square = square.view(rows, BLOCK, blocks, BLOCK)
        any_seen.append(square.any(3).any(1))
        all_seen.append(square.all(3).all(1))
    full, partial = torch.stack(all_seen, 1), torch.stack(any_seen, 1)  # [rows, query blocks, key blocks]
    partial &= ~full

    def indices(seen: torch.Tensor):
        order = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return seen.sum(-1, dtype=torch.int32)[:, None], order[:, None]

    return BlockMask.from_kv_blocks(
        *indices(partial), *indices(full), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(width, width)
    )


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence in packed rows: a new one starts at each position 0 (so each padding token is one)."""
    return (position_ids == 0).cumsum(-1)
