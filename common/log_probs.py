"""The log-probs and entropies of response tokens from a language model's outputs: at a temperature, over the whole
vocabulary at once or a chunk of tokens at a time, with an entropy that costs its backward nothing when unused.

Pure torch: the policy's worker (common/workers.py) reads the model's outputs at the response tokens
(layouts.response_outputs) and turns them into log-probs here.
"""

from __future__ import annotations

import torch

from common.layouts import output_layer_at


def response_log_probs(logits: torch.Tensor, responses: torch.Tensor, temperature: float, with_entropy: bool):
    """The log-probs of `responses` at `temperature` from their `logits`, and (with `with_entropy`) the entropies."""
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature  # [tokens, vocab]: no copy at 1
    log_probs = torch.log_softmax(logits, dim=-1)
    token_log_probs = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = Entropy.apply(log_probs) if with_entropy else None
    return token_log_probs, entropy


class Entropy(torch.autograd.Function):
    """H = -sum_v p_v log p_v of each row of log-probs [tokens, vocab], as autograd would compute it, for less: it keeps
    no [tokens, vocab] tensor of its own for the backward (log_softmax keeps the log-probs already), and its backward
    does nothing when the gradient it receives is zero, as it is when the loss weighs the entropy by 0 (the scripts'
    default --entropy-coef): that gradient's three passes over the vocabulary were a tenth of an update."""

    @staticmethod
    def forward(ctx, log_probs):
        ctx.save_for_backward(log_probs)
        return -log_probs.exp().mul_(log_probs).sum(-1)  # [tokens]

    @staticmethod
    def backward(ctx, grad):
        if not grad.any():
            return None
        (log_probs,) = ctx.saved_tensors
        return -grad[:, None] * log_probs.exp() * (log_probs + 1)  # dH/d(log p_v) = -p_v (log p_v + 1)


def chunked_log_probs(
    hidden: torch.Tensor,
    output_layer,
    responses: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of `responses` (and entropies), [tokens, 2 or 1], from the hidden states before them: the logits over
    the vocabulary for `chunk_tokens` tokens at a time (all at once with 0). With gradients and more than one chunk,
    backward computes each chunk's logits again (activation checkpointing) instead of keeping them: at most one
    chunk's logits exist at any time, not [tokens, vocabulary] in fp32, a response of 16k tokens' 3 GB per copy for a
    49k vocabulary. `tokens`: which of `responses` the hidden states are before (default: all)."""
    from torch.utils.checkpoint import checkpoint

    def log_probs_of(hidden: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        log_probs, entropy = response_log_probs(output_layer(hidden), responses, temperature, with_entropy)
        return torch.stack([log_probs, entropy], -1) if with_entropy else log_probs[:, None]

    responses = responses if tokens is None else responses[tokens]
    size = chunk_tokens or max(len(hidden), 1)
    chunks = [slice(start, start + size) for start in range(0, max(len(hidden), 1), size)]  # one, empty, for no tokens
    if torch.is_grad_enabled() and len(chunks) > 1:
        return torch.cat([checkpoint(log_probs_of, hidden[c], responses[c], use_reentrant=False) for c in chunks])
    return torch.cat([log_probs_of(hidden[c], responses[c]) for c in chunks])


@torch.no_grad()
def head_outputs_pass_through(model, device: torch.device) -> bool:
    """Whether what the output layer returns is the model's output unchanged (chunked_log_probs takes its place):
    not so where the model changes its logits after the layer (Gemma 2's soft-capping, Granite's scaling)."""
    read = torch.arange(3, device=device)
    marks = torch.arange(1.0, 4.0, device=device)[:, None]
    with output_layer_at(model, read, lambda hidden, output_layer: marks):
        outputs = model(input_ids=torch.ones(1, 3, dtype=torch.long, device=device), use_cache=False).logits[0]
    return torch.equal(outputs.float(), marks)
