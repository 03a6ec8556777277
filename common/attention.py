"""Attention without a square mask: packed rows through PyTorch's FlashAttention varlen kernel, or through
FlexAttention's block masks (shared prompts too); and which attention a worker loads its model with (choose).

A dense mask ([rows, 1, width, width], one entry per pair of tokens) grows with the square of a row's width: a 32k
row's takes 1 GiB, and a GPU's SDPA given any mask leaves its flash kernel for one that reads it. A block mask keeps,
per 128 x 128 block of the square, whether it is empty, full or partial, and FlexAttention skips the empty blocks
and asks a mask function about the partial ones: a few kilobytes where the dense mask took gigabytes.

The model runs with this module's attention (`register`): FlexAttention where a forward passes a BlockMask as its
`attention_mask`, transformers' SDPA for everything else (generation, padded micro-batches), with the masks SDPA gets.
On a GPU computing in bf16 without flash-attn installed, it runs with `register_varlen`'s instead: a micro-batch's
sequences in one row, no mask at all, each sequence's bounds read off its position ids, as flash-attn's kernel takes them.
"""

from __future__ import annotations

import functools
import inspect

import torch

ATTENTION = "hybridrl_flex"
VARLEN = "hybridrl_varlen"
FLASH_DTYPES = (torch.bfloat16, torch.float16)  # what FlashAttention's kernels compute in, on GPUs from Ampere (8.0)
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


def choose(device_type: str, capability: int, dtype: torch.dtype, flash_attn: bool, varlen: bool) -> str:
    """The attention a worker on a `device_type` device of compute `capability` (a GPU's major version) loads its model
    with, computing in `dtype`, where flash-attn's kernel loads (`flash_attn`) and torch has its varlen kernel
    (`varlen`): flash-attn's, else PyTorch's own (VARLEN), on GPUs that run FlashAttention in its dtypes; SDPA elsewhere
    (with block masks where FlexAttention's check passes, see flex_from)."""
    if device_type != "cuda" or capability < 8 or dtype not in FLASH_DTYPES:
        return "sdpa"
    return "flash_attention_2" if flash_attn else VARLEN if varlen else "sdpa"


def flash_attn_loads() -> bool:
    """Whether flash-attn is installed and its compiled kernel loads (a build against another torch fails here)."""
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return False
    try:
        import flash_attn_2_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_kernel():
    """torch.nn.attention.varlen.varlen_attn (torch 2.10 and later; its kernel runs on CUDA only), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def register() -> str:
    """Make this module's attention one transformers can load a model with; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


def register_varlen() -> str:
    """Make varlen_attention one transformers can load a model with; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, varlen_mask)
    return VARLEN


def varlen_mask(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **kwargs):
    """No mask for one row without a padding mask or a cache (varlen_attention reads the sequences off the position
    ids); SDPA's mask for anything else (padded micro-batches, generation)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and batch_size == 1 and q_length == kv_length:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, attention_mask=attention_mask, **kwargs)


_bounds_of: tuple = (None, None)  # the last position ids and their sequences' bounds: every layer gets the same tensor


def sequence_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
    """The sequences of one row of packed `position_ids` ([1, tokens]; a sequence starts at each 0 and at the first
    token): their cumulative bounds (int32, [sequences + 1], as the varlen kernels take them), as a list, and the
    longest one's length. Computed once per forward: reading them synchronises a GPU."""
    global _bounds_of
    if _bounds_of[0] is not position_ids:
        starts = position_ids[0] == 0
        starts[0] = True
        tokens = torch.tensor([position_ids.shape[1]], device=position_ids.device)
        bounds = torch.cat([starts.nonzero()[:, 0], tokens]).to(torch.int32)
        bound_list = bounds.tolist()
        _bounds_of = (position_ids, (bounds, bound_list, max(b - a for a, b in zip(bound_list, bound_list[1:]))))
    return _bounds_of[1]


@functools.cache
def varlen_options() -> tuple[dict, bool]:
    """How this torch's varlen_attn is told to attend causally (window_size=(-1, 0) from early 2026, is_causal=True
    before), and whether it takes fewer key and value heads than query heads itself (enable_gqa, torch 2.12)."""
    parameters = inspect.signature(varlen_kernel()).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    return causal, "enable_gqa" in parameters


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention call: with no mask over one row, each of its sequences (sequence_bounds) attends causally
    to itself through PyTorch's FlashAttention varlen kernel where it runs (CUDA, bf16 or fp16), else through SDPA a
    sequence at a time (the CPU, fp32: the same result, slower); SDPA with anything else (a mask, a cache, rows)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None or dropout:
        raise NotImplementedError("varlen attention is plain: this layer has a window, soft-capping, sinks or dropout")
    bounds, bound_list, longest = sequence_bounds(position_ids)
    query, key, value = (states[0].transpose(0, 1) for states in (query, key, value))  # [tokens, heads, head dim]
    groups = query.shape[1] // key.shape[1]
    kernel = varlen_kernel()
    if kernel is not None and query.is_cuda and query.dtype in FLASH_DTYPES:
        causal, takes_groups = varlen_options()
        if groups > 1 and not takes_groups:
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        gqa = {"enable_gqa": True} if groups > 1 and takes_groups else {}
        query, key, value = (states.contiguous() for states in (query, key, value))  # keys come from RoPE heads-first
        output = kernel(query, key, value, bounds, bounds, longest, longest, scale=scaling, **causal, **gqa)
    else:
        sequences = []
        for start, end in zip(bound_list[:-1], bound_list[1:]):
            q, k, v = (states[start:end].transpose(0, 1) for states in (query, key, value))  # [heads, tokens, head dim]
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1
            )
            sequences.append(attended.transpose(0, 1))
        output = torch.cat(sequences)
    return output[None], None


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
