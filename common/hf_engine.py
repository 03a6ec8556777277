"""The hf engine: transformers' generate on the training policy itself (every FSDP unit gathered while it is awake), or
apart on a whole model loaded from the checkpoint (registered in common/engines.py)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from common.engines import EngineContext, EngineSettings, check_every_weight
from common.rollout import stop_end

HELD_SHARE = 0.25  # of the device's free memory at a play's start, the most episodes' kept keys and values may take


def check_settings(settings: EngineSettings) -> None:
    """What the hf engine refuses: the vllm engine's settings."""
    if settings.offload or settings.lora_sync != "auto":
        raise ValueError("--offload and --lora-sync act on the vllm engine only; drop them, or add --rollout-engine vllm")


class HFEngine:
    """transformers' generate on the training policy itself, every FSDP unit gathered from wake to sleep.

    Episodes' turns come as requests (add_request, between wake and sleep): each `finished_requests`
    gathers the requests added since the last into one generate, and an episode's keys and values are kept from one of
    its turns to the next, so a turn computes only what came after the last (the environment's answer) where the model's
    cache is transformers' plain one (every layer a DynamicLayer) and the kept ones fit in HELD_SHARE of the device's
    free memory; else a turn runs its whole context again."""

    check = staticmethod(check_settings)  # which an engine in a file built on this one keeps

    def __init__(self, policy, tokenizer, eos_token_ids: list[int], pad_token_id: int):
        self.policy, self.tokenizer, self.eos_token_ids, self.pad_token_id = policy, tokenizer, eos_token_ids, pad_token_id
        self.prefilled_tokens, self.requests, self.held, self.gathered = 0, [], {}, None
        self.held_budget = 0  # bytes the kept keys and values may take (wake)

    def wake(self) -> None:
        """Generate from the policy as it is now: its shards gathered until sleep, so that forwards need no collective."""
        self.gathered = unsharded(self.policy)
        self.gathered.__enter__()
        self.held_budget = int(HELD_SHARE * free_memory_bytes(self.policy.device))

    def sleep(self) -> None:
        """Give the policy's shards back."""
        self.gathered.__exit__(None, None, None)

    def generate(self, prompts, prompt_mask, max_response_length, **sampling):
        """[batch, steps] response tokens and their log-probs under the distribution they were sampled from."""
        cache, prefilled = shared_prompt_cache(self.policy, prompts, prompt_mask)
        return self._generate(prompts, prompt_mask, cache, prefilled, max_response_length, **sampling)[:2]

    def _generate(
        self, input_ids, attention_mask, cache, prefilled: int, max_new_tokens: int, alone=False, seeds=None, **sampling
    ):
        """generate's new tokens, their log-probs and the cache it leaves, from `cache` holding the keys and values of
        the first columns of `input_ids` (or None); `prefilled`: the context's tokens this computes, counted. `alone`:
        this rank generates on its own (else every rank of an FSDP policy generates at once, and generate keeps them in
        step until the last is done). `seeds`: each row's own random draws (None: torch's global generator)."""
        from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
        from transformers import TopPLogitsWarper

        self.policy.eval()
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            stop_strings=sampling.get("stop_strings") or None,
            do_sample=False,  # generate's greedy pick takes the one token InverseCDFSample leaves possible
            use_cache=True,  # whatever the model's folder says (a folder saved for training may say false)
            return_dict_in_generate=True,
        )
        do_sample, temperature, top_p, top_k = (sampling[key] for key in ("do_sample", "temperature", "top_p", "top_k"))
        recorder = SampledLogProbs(temperature if do_sample else 1.0)
        processors = [recorder]
        if do_sample:  # generate's own warpers, in its order and on its conditions, then one uniform draw per row
            processors += [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k != 0 else [])
            processors += ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []) + [InverseCDFSample(seeds, input_ids.device)]
        self.prefilled_tokens += prefilled
        output = self.policy.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            generation_config=config,
            logits_processor=LogitsProcessorList(processors),
            tokenizer=self.tokenizer,  # what stop strings are matched with
            **(dict(synced_gpus=False) if alone else {}),
        )
        responses = output.sequences[:, input_ids.shape[1] :]
        return responses, recorder.log_probs(responses), output.past_key_values

    def add_request(self, key: str, tokens: list[int], max_tokens: int, seed: int | None = None, **sampling) -> None:
        """Generate a response to `tokens` at the next finished_requests; `key`: the episode's, whose earlier turns'
        keys and values this one starts from where its tokens begin with theirs; `seed`: its own random draws."""
        self.requests.append((key, tokens, max_tokens, sampling, seed))

    def finished_requests(self) -> list[tuple[str, list[int], list[float], int]]:
        """Every request added since the last call, generated together (those of equal sampling settings): each one's
        key, tokens (up to its EOS or stop string), their log-probs and how many of its context's tokens it computed."""
        finished, requests, self.requests = [], self.requests, []
        for sampling in {str(sorted(r[3].items())): r[3] for r in requests}.values():  # in the order they came
            finished += self._finish([r for r in requests if r[3] == sampling], sampling)
        return finished

    def forget(self, prefix: str) -> None:
        """Drop the keys and values of the episodes whose keys start with `prefix`."""
        self.held = {key: held for key, held in self.held.items() if not key.startswith(prefix)}

    def _finish(self, requests: list, sampling: dict) -> list[tuple[str, list[int], list[float], int]]:
        reuse = [held_prefix(self.held.get(key), tokens) for key, tokens, *_ in requests]  # tokens whose cache is held
        input_ids, mask, cache, prefilled, columns = self._contexts(requests, reuse)
        max_tokens, seeds = max(r[2] for r in requests), [r[4] for r in requests]
        responses, log_probs, cache = self._generate(input_ids, mask, cache, prefilled, max_tokens, True, seeds, **sampling)
        lengths = response_lengths(responses, self.eos_token_ids, sampling.get("stop_strings"), self.tokenizer)
        for key, *_ in requests:  # what they started from is used up
            self.held.pop(key, None)
        finished, kept = [], held_bytes(self.held)
        for i, ((key, tokens, most, *_), length) in enumerate(zip(requests, lengths)):
            length = min(length, most)  # the batch generated up to its longest request's max_tokens
            response = responses[i, :length].tolist()
            if keeps_plain_cache(cache):  # the context's and the response's but the last token's, which no forward read
                taken = torch.cat([columns[i], torch.arange(input_ids.shape[1], input_ids.shape[1] + length - 1)])
                layers = [(layer.keys[i][:, taken], layer.values[i][:, taken]) for layer in cache.layers]
                size = sum(k.nbytes + v.nbytes for k, v in layers)
                if kept + size <= self.held_budget:
                    self.held[key] = (tokens + response[:-1], layers)
                    kept += size
            finished.append((key, response, log_probs[i, :length].tolist(), len(tokens) - reuse[i]))
        return finished

    def _contexts(self, requests: list, reuse: list[int]):
        """The requests' tokens left-padded into one batch, and a cache of what earlier turns computed: row i's first
        reuse[i] tokens, whose keys and values are held, end at column C (the longest held), its other tokens end the
        row, pads between are masked. Returns input_ids, attention_mask, the cache (None: nothing held), the tokens it
        leaves to compute and each row's real columns."""
        device = self.policy.device
        width_held = max(reuse)
        width_new = max(len(r[1]) - used for r, used in zip(requests, reuse))
        width = width_held + width_new
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(input_ids)
        columns = []
        for i, ((key, tokens, *_), used) in enumerate(zip(requests, reuse)):
            new = len(tokens) - used
            input_ids[i, width_held - used : width_held] = torch.tensor(tokens[:used], dtype=torch.long)
            input_ids[i, width - new :] = torch.tensor(tokens[used:], dtype=torch.long)
            mask[i, width_held - used : width_held] = 1
            mask[i, width - new :] = 1
            columns.append(mask[i].nonzero().squeeze(-1).cpu())
        if width_held == 0:  # first turns: a group's samples share their prompt's keys and values
            return input_ids, mask, *shared_prompt_cache(self.policy, input_ids, mask), columns
        return input_ids, mask, self._held_cache(requests, reuse, width_held), int(mask[:, width_held:].sum()), columns

    def _held_cache(self, requests: list, reuse: list[int], width: int):
        """A cache of `width` columns holding each row's first `reuse[i]` held keys and values, right-aligned."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.policy.config)
        some_held = self.held[next(key for (key, *_), used in zip(requests, reuse) if used)][1]
        for layer_index, (some_keys, some_values) in enumerate(some_held):
            keys, values = [], []
            for (key, *_), used in zip(requests, reuse):
                held_keys, held_values = self.held[key][1][layer_index] if used else (some_keys, some_values)
                pad = (0, 0, width - used, 0)  # zeros before: masked columns
                keys.append(torch.nn.functional.pad(held_keys[:, :used], pad))
                values.append(torch.nn.functional.pad(held_values[:, :used], pad))
            cache.update(torch.stack(keys), torch.stack(values), layer_index)
        return cache

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
        check_every_weight(sorted(set(params) - received))
        self.held = {}  # the episodes' keys and values were computed with the old weights

    @torch.no_grad()
    def prompt_log_probs(self, tokens: list[int]) -> torch.Tensor:
        """log p(token | the tokens before it) for every token of `tokens` but the first, at temperature 1."""
        logits = self.policy(torch.tensor([tokens], device=self.policy.device)).logits[0, :-1].float()
        following = torch.tensor(tokens[1:], device=logits.device)
        return torch.log_softmax(logits, dim=-1).gather(-1, following[:, None]).squeeze(-1).cpu()


def build(context: EngineContext) -> HFEngine:
    """transformers' generate on the policy itself, or apart on a whole model loaded from `model_path` in the compute
    dtype."""
    from transformers import AutoModelForCausalLM

    from common.fsdp_worker import compute_dtype_for

    model = context.policy
    if model is None:
        dtype = compute_dtype_for(context.settings.compute_dtype, context.device)
        model = AutoModelForCausalLM.from_pretrained(context.model_path, dtype=dtype)
        model = model.to(context.device).eval()
    return HFEngine(model, context.tokenizer, context.eos_token_ids, context.pad_token_id)


def shared_prompt_cache(model, prompts, prompt_mask):
    """The keys and values of every prompt token but the last, computed once per distinct prompt and copied to each row
    that holds it (a group's n samples), or None when no two rows share a prompt; and the prompt tokens computed in
    all, these and those `generate` runs then (every one, without the cache). `generate` then runs only the last prompt
    token and the response: the prompt's forward, a large part of a short response's cost, runs once, not n times.
    Positions as `generate` numbers them (the mask's cumulative sum), so each row's logits are those of a full pass."""
    from transformers import DynamicCache

    if prompts.shape[1] < 2:
        return None, int(prompt_mask.sum())
    # rows equal in tokens and mask alike: a pad id can also be a real token
    distinct, row_of = torch.unique(torch.cat([prompts, prompt_mask.to(prompts.dtype)], -1), dim=0, return_inverse=True)
    if len(distinct) == len(prompts):
        return None, int(prompt_mask.sum())
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
    return cache, int(mask[:, :-1].sum()) + int(prompt_mask[:, -1].sum())


def held_bytes(held: dict) -> int:
    """The memory of kept keys and values (HFEngine.held)."""
    return sum(k.nbytes + v.nbytes for _, layers in held.values() for k, v in layers)


def free_memory_bytes(device: torch.device) -> int:
    """The memory the device has free: the GPU's, or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def held_prefix(held, tokens: list[int]) -> int:
    """How many of `tokens`' first tokens have keys and values in `held` (an episode's earlier turn's tokens and cache):
    the prefix they share, less the last token, which the next generate must run to sample after it."""
    if held is None:
        return 0
    shared = 0
    for mine, theirs in zip(held[0], tokens[:-1]):
        if mine != theirs:
            break
        shared += 1
    return shared


def keeps_plain_cache(cache) -> bool:
    """Whether a cache's layers each keep every position's keys and values (transformers' DynamicLayer), which an
    episode's next turn can start from (a sliding window's or a linear attention's state cannot be cut per row)."""
    from transformers.cache_utils import DynamicLayer

    return cache is not None and all(type(layer) is DynamicLayer for layer in cache.layers)


def response_lengths(responses, eos_token_ids: list[int], stop_strings, tokenizer) -> list[int]:
    """Each row's tokens up to and including its first EOS or the token that completes a stop string (generate pads
    after either), or all of them."""
    lengths = []
    for row in responses.tolist():
        length = next((i + 1 for i, token in enumerate(row) if token in eos_token_ids), len(row))
        lengths.append(stop_end(row[:length], stop_strings or [], tokenizer) or length)
    return lengths


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
    engine's generation on a CPU with a 49k vocabulary. `seeds`: per row, a generator of its own seeded so (an
    episode's turn draws the same numbers whatever turns share its batch); None: torch's global one for every row."""

    def __init__(self, seeds: list[int | None] | None = None, device=None):
        self.generators = None
        if seeds is not None and any(seed is not None for seed in seeds):
            self.generators = [None if seed is None else torch.Generator(device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = torch.softmax(scores.float(), dim=-1).double().cumsum(-1)  # [batch, vocab]
        drawn = self._uniform(len(cdf), cdf.device) * cdf[:, -1:]  # [batch, 1], below the total
        tokens = torch.searchsorted(cdf, drawn, right=True).clamp_(max=cdf.shape[-1] - 1)  # the first cdf above it
        return torch.full_like(scores, -torch.inf).scatter_(-1, tokens, 0.0)

    def _uniform(self, rows: int, device) -> torch.Tensor:
        """[rows, 1] uniform draws in float64, each row's from its own generator where it has one."""
        if self.generators is None:
            return torch.rand(rows, 1, dtype=torch.float64, device=device)
        draws = [torch.rand(1, 1, dtype=torch.float64, device=device, generator=g) for g in self.generators]
        return torch.cat(draws)


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
