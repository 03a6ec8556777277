"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"): the N ranks of a sequence-parallel group
each run 1/N of a micro-batch's tokens through the model, and swap them around attention.

Everything in a decoder but attention works token by token (embeddings, norms, MLPs, the rotary embedding from each
token's position id, the output layer), so a rank needs only its own tokens there. Before attention an all-to-all
turns each rank's [its tokens, every head] queries, keys and values into [every token, its heads]; the rank attends
over the whole sequence for those heads; a second all-to-all turns the output back. A rank's activations are then
those of 1/N of the tokens, and what moves between ranks is activations, never weights. Heads that do not divide by
N are dealt as evenly as they go (9 heads over 2 ranks: 5 and 4), each rank's key and value heads repeated to match
its query heads.

The model runs with this module's attention (`register`), which is transformers' SDPA unless a forward passes
`sequence_parallel=SequenceParallel(...)`: generation and every other call see the model they always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.attention import compiled_flex_attention

ATTENTION = "hybridrl_ulysses"


@dataclass
class SequenceParallel:
    """What a sequence-parallel forward passes to every attention layer (as a keyword, which transformers hands down
    to it, and which gradient checkpointing keeps for the recomputation in backward)."""

    group: dist.ProcessGroup
    # the whole rows' [rows, 1, width, width], True where a token sees another, or their BlockMask for FlexAttention
    # (common/attention.py); None: causal
    mask: object


def register() -> str:
    """Make this module's attention one transformers can load a model with; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks SDPA gets, for calls without sequence_parallel
    return ATTENTION


def check_heads(model_path: str, sequence_parallel: int) -> None:
    """A clear error, before any worker starts, for a model whose heads cannot be dealt to `sequence_parallel` ranks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise ValueError(
            f"--sequence-parallel {sequence_parallel}: {model_path}'s config has no num_attention_heads to deal to the "
            "ranks; use --sequence-parallel 1 with this model"
        )
    if sequence_parallel > heads:
        raise ValueError(
            f"--sequence-parallel {sequence_parallel}: {model_path} has {heads} attention heads, and each rank "
            f"attends for at least one; use at most {heads}"
        )
    sliding_window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if sliding_window or getattr(config, "attn_logit_softcapping", None):
        raise ValueError(
            f"--sequence-parallel {sequence_parallel}: {model_path}'s attention has a sliding window or soft-capping, "
            "which this attention does not compute; use --sequence-parallel 1 with this model"
        )


def head_shares(heads: int, ranks: int) -> list[int]:
    """How many of `heads` each rank attends for: as even as they go, the first ranks one more."""
    return [heads // ranks + (rank < heads % ranks) for rank in range(ranks)]


class _AllToAll(torch.autograd.Function):
    """Rows of `tensor` out to every rank (`send[r]` of them to rank r, in order), `receive[r]` rows in from each.
    Its gradient goes back the way it came."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        received = tensor.new_empty((sum(receive), *tensor.shape[1:]))
        dist.all_to_all_single(received, tensor.contiguous(), receive, send, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def to_heads(states: torch.Tensor, shares: list[int], group) -> torch.Tensor:
    """[rows, heads, its tokens, dim] on each rank -> [rows, its heads, every token, dim]."""
    rows, heads, tokens, dim = states.shape
    ranks, mine = len(shares), shares[dist.get_rank(group)]
    received = _AllToAll.apply(states.transpose(0, 1), shares, [mine] * ranks, group)  # [ranks x mine, rows, tokens, dim]
    return received.view(ranks, mine, rows, tokens, dim).permute(2, 1, 0, 3, 4).reshape(rows, mine, ranks * tokens, dim)


def to_tokens(states: torch.Tensor, shares: list[int], group) -> torch.Tensor:
    """[rows, its heads, every token, dim] -> [rows, its tokens, heads, dim], the layout attention returns in."""
    rows, mine, tokens, dim = states.shape
    ranks = len(shares)
    send = states.view(rows, mine, ranks, tokens // ranks, dim).permute(2, 1, 0, 3, 4).reshape(-1, rows, tokens // ranks, dim)
    return _AllToAll.apply(send, [mine] * ranks, shares, group).permute(1, 2, 0, 3)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sequence_parallel=None, **kwargs):
    """transformers' attention call: SDPA over the rank's tokens, or with `sequence_parallel`, Ulysses over the whole
    rows (the mask the model built from a rank's share of them is not theirs: `sequence_parallel.mask` is), through
    SDPA, or FlexAttention where that mask is a BlockMask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sequence_parallel is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise NotImplementedError("sequence parallelism computes full attention: this layer has a window or soft-capping")
    group, mask = sequence_parallel.group, sequence_parallel.mask
    ranks, heads = dist.get_world_size(group), query.shape[1]
    if heads % ranks or key.shape[1] % ranks:  # then a rank's query heads need key and value heads of their own
        key, value = (states.repeat_interleave(heads // key.shape[1], 1) for states in (key, value))
    query, key, value = (to_heads(states, head_shares(states.shape[1], ranks), group) for states in (query, key, value))
    key, value = (states.repeat_interleave(query.shape[1] // key.shape[1], 1) for states in (key, value))
    if mask is None or isinstance(mask, torch.Tensor):
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=scaling
        )
    else:
        output = compiled_flex_attention()(query, key, value, block_mask=mask, scale=scaling)
    return to_tokens(output, head_shares(heads, ranks), group), None


def full_attention(inputs: dict) -> torch.Tensor:
    """Who sees whom in the rows of `inputs` (response_outputs' model inputs), [rows, 1, width, width]: the rectangle's
    real tokens before a token, or, packed, its own sequence's tokens before it (a sequence starts at each position 0;
    a padding token is one of its own), or the mask the layout gave. Every token sees itself: no row of SDPA's is
    empty, which would make its output NaN."""
    mask, positions = inputs.get("attention_mask"), inputs["position_ids"]
    if mask is not None and mask.dim() == 4:
        return mask
    width = positions.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=positions.device).tril()
    if mask is not None:
        seen = mask.bool()[:, None, :] & causal
    else:
        sequence = (positions == 0).cumsum(-1)
        seen = (sequence[:, :, None] == sequence[:, None, :]) & causal
    return (seen | torch.eye(width, dtype=torch.bool, device=positions.device))[:, None]


class _GatherTokens(torch.autograd.Function):
    """Every rank's `counts[r]` rows, one after another, on every rank of `group`. All of them compute the same loss
    from these, so a rank's own rows take their slice of its gradient, not a sum over ranks."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], group) -> torch.Tensor:
        ctx.start, ctx.count = sum(counts[: dist.get_rank(group)]), len(local)
        padded = local.new_zeros((max(counts), *local.shape[1:]))
        padded[: len(local)] = local
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:count] for piece, count in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start : ctx.start + ctx.count], None, None


def gather_tokens(local: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    return _GatherTokens.apply(local, counts, group)
