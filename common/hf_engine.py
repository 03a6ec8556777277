"""The hf engine: transformers' generate on the training policy itself (every FSDP unit gathered once for the call), or
apart on a whole model loaded from the checkpoint (registered in common/engines.py)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


class HFRollout:
    """transformers' generate on the training policy itself, every FSDP unit gathered once for the call."""

    def __init__(self, policy, tokenizer, eos_token_ids: list[int], pad_token_id: int):
        self.policy, self.tokenizer, self.eos_token_ids, self.pad_token_id = policy, tokenizer, eos_token_ids, pad_token_id

    def generate(self, prompts, prompt_mask, max_response_length, do_sample, temperature, top_p, top_k, stop_strings=None):
        """[batch, steps] response tokens and their log-probs under the distribution they were sampled from."""
        from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
        from transformers import TopPLogitsWarper

        self.policy.eval()
        config = GenerationConfig(
            max_new_tokens=max_response_length,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            stop_strings=stop_strings or None,
            do_sample=False,  # generate's greedy pick takes the one token InverseCDFSample leaves possible
        )
        recorder = SampledLogProbs(temperature if do_sample else 1.0)
        processors = [recorder]
        if do_sample:  # generate's own warpers, in its order and on its conditions, then one uniform draw per row
            processors += [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k != 0 else [])
            processors += ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []) + [InverseCDFSample()]
        with unsharded(self.policy):
            output = self.policy.generate(
                input_ids=prompts,
                attention_mask=prompt_mask,
                past_key_values=shared_prompt_cache(self.policy, prompts, prompt_mask),
                generation_config=config,
                logits_processor=LogitsProcessorList(processors),
                tokenizer=self.tokenizer,  # what stop strings are matched with
            )
        responses = output[:, prompts.shape[1] :]
        return responses, recorder.log_probs(responses)

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.dtype

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs, named as the model's parameters, into the model (an engine apart's own)."""
        params = dict(self.policy.named_parameters(remove_duplicate=False))
        received = set()
        for name, tensor in weights:  # to the end of the stream, whatever arrives: the sender waits for it
            if name in params:
                params[name].copy_(tensor)
                received.add(name)
        missing = sorted(set(params) - received)
        if missing:
            raise RuntimeError(f"the rollout engine received no weights for {missing}: it would generate with stale ones")

    @torch.no_grad()
    def prompt_log_probs(self, tokens: list[int]) -> torch.Tensor:
        """log p(token | the tokens before it) for every token of `tokens` but the first, at temperature 1."""
        logits = self.policy(torch.tensor([tokens], device=self.policy.device)).logits[0, :-1].float()
        following = torch.tensor(tokens[1:], device=logits.device)
        return torch.log_softmax(logits, dim=-1).gather(-1, following[:, None]).squeeze(-1).cpu()


def shared_prompt_cache(model, prompts, prompt_mask):
    """The keys and values of every prompt token but the last, computed once per distinct prompt and copied to each row
    that holds it (a group's n samples), or None when no two rows share a prompt. `generate` then runs only the last
    prompt token and the response: the prompt's forward, a large part of a short response's cost, runs once, not n times.
    Positions as `generate` numbers them (the mask's cumulative sum), so each row's logits are those of a full pass."""
    from transformers import DynamicCache

    if prompts.shape[1] < 2:
        return None
    # rows equal in tokens and mask alike: a pad id can also be a real token
    distinct, row_of = torch.unique(torch.cat([prompts, prompt_mask.to(prompts.dtype)], -1), dim=0, return_inverse=True)
    if len(distinct) == len(prompts):
        return None
    tokens, mask = distinct.split(prompts.shape[1], dim=-1)  # [distinct, prompt_len] each
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left-padded: the pads before a prompt at 0, as generate has them
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(
            input_ids=tokens[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            past_key_values=cache,
            logits_to_keep=1,
        )
    cache.batch_select_indices(row_of)
    return cache


@contextmanager
def unsharded(model):
    """Gather every shard once for the duration, so forwards need no collective.

    `generate` runs a different number of forwards on each rank (each stops at
    its own EOS): with sharded layers those forwards would all-gather and hang.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:  # a rollout worker's own model: whole already
        yield
        return
    model.set_reshard_after_forward(False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
        for module in modules[1:]:
            module.set_reshard_after_forward(True, recurse=False)


class InverseCDFSample:
    """A logits processor that draws each row's next token from the softmax of its scores and leaves only that token
    possible: one uniform draw per row against the cumulative probabilities (in float64, so that no token's share
    rounds away), where `generate`'s torch.multinomial draws one exponential per vocabulary entry, a tenth of the hf
    engine's generation on a CPU with a 49k vocabulary."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = torch.softmax(scores.float(), dim=-1).double().cumsum(-1)  # [batch, vocab]
        drawn = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # [batch, 1], below the total
        tokens = torch.searchsorted(cdf, drawn, right=True).clamp_(max=cdf.shape[-1] - 1)  # the first cdf above it
        return torch.full_like(scores, -torch.inf).scatter_(-1, tokens, 0.0)


class SampledLogProbs:
    """A logits processor that records log p(token) of each sampled token, one step at a time.

    Placed before generate's own temperature warper, it sees the model's logits
    and applies the temperature itself, as the trainer does. Holding only the
    last step's distribution keeps memory at [batch, vocab], not [batch, steps, vocab].
    """

    def __init__(self, temperature: float):
        self.temperature, self.last, self.taken = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # the last column of input_ids was sampled from the last distribution
            self.taken.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def log_probs(self, responses: torch.Tensor) -> torch.Tensor:
        """[batch, steps] log-probs of `responses` (generate's new tokens)."""
        taken = self.taken + [self.last.gather(-1, responses[:, -1:]).squeeze(-1)]
        return torch.stack(taken, dim=1)
