"""The rollout engines' seam: what an engine offers the workers (`RolloutEngine`), how the run's engines generate
(`EngineSettings`, one object decided once from the flags), what an engine is built from (`EngineContext`), and what
every engine shares (the tokens that end a response, the check that every weight arrived, responses padded into a
batch). The engines are a room each (common/hf_engine.py, common/vllm_engine.py, or a file of yours); which name
builds which is common/engine_registry.py (docs/rollout-engines.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch

class RolloutEngine(Protocol):
    """What the workers call on an engine (EngineWorker and RolloutWorker, common/workers.py). Between `wake` and
    `sleep` it generates: a batch of prompts at once (`generate`), or requests one by one (an episode's turns, as each
    comes: `add_request`, `finished_requests`, `forget`)."""

    dtype: torch.dtype
    """the dtype the engine keeps its weights in, which the policy sends them in"""

    prefilled_tokens: int
    """the context tokens the engine computed so far (those its caches did not hold), which the logs count"""

    def wake(self) -> None:
        """Get ready to generate from the policy as it is now: in the policy's process the policy's weights reach the
        engine (the hf engine gathers the policy's shards, the vllm one wakes and loads them); apart, the engine
        generates from the weights last loaded."""

    def sleep(self) -> None:
        """Done generating until the next wake: give back what the policy trains with (the hf engine lets the shards
        go, the vllm one sleeps on GPUs and puts an offloaded policy back)."""

    def generate(self, prompts, prompt_mask, max_response_length: int, **sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """One response per left-padded prompt ([batch, steps] tokens, padded after the end) and the log-prob of each
        sampled token under the distribution it was sampled from ([batch, steps]). `sampling`: EngineSettings.sampling's
        do_sample, temperature, top_p, top_k and stop_strings (a list, or None)."""

    def add_request(self, key: str, tokens: list[int], max_tokens: int, seed: int | None = None, **sampling) -> None:
        """Start a response of at most `max_tokens` to `tokens` (sampling as generate takes it). `key`: the episode's,
        the same for each of its turns, whose context then begins with the earlier turn's: an engine may keep what
        it computed of one turn for the next. `seed`: the turn's own random draws (the play's turn_seed), so that what
        it samples does not depend on the turns beside it; None: the engine's."""

    def finished_requests(self) -> list[tuple[str, list[int], list[float], int]]:
        """Generate until at least one request under way ends (or a short while passed): each ended one's key, tokens
        (to its EOS or the token that completes a stop string), their log-probs, and how many of its context's tokens
        the engine computed (the others came from its cache)."""

    def forget(self, prefix: str) -> None:
        """The requests whose keys begin with `prefix` are done with (a play of episodes ended): drop what was kept of
        them."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs named as in the model's checkpoint into the engine: every weight it has must
        arrive, or it raises (check_every_weight). What the engine cached is dropped with the old weights."""

    def prompt_log_probs(self, tokens: list[int]) -> torch.Tensor:
        """log p(token | the tokens before it) at temperature 1 for every token of `tokens` but the first."""


class AdapterEngine(RolloutEngine, Protocol):
    """An engine that serves the policy's LoRA adapter on its base weights (registered with `serves_adapter`)."""

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config) -> None:
        """Serve this adapter (PEFT-named tensors, its LoraConfig) from now on."""


@dataclass(frozen=True)
class EngineSettings:
    """How the run's rollout engines generate, decided once from the flags (args.engine_settings) and handed whole to
    every engine, in the policy's processes or apart. A judge's engine takes the run's, with its own lengths and
    temperature 1 (dataclasses.replace)."""

    name: str = "hf"
    """--rollout-engine: a registered engine's name, or path/to/file.py:NAME (the path made absolute)"""
    temperature: float = 1.0
    """--temperature: rollouts are sampled at it, and the trainer's log-probs computed at it"""
    top_p: float = 1.0
    top_k: int = 0
    max_model_len: int = 2048
    """the longest context an engine holds: --max-prompt-length + --max-response-length"""
    dtype: str = "bfloat16"
    """--rollout-dtype: what the vllm engine keeps its weights in"""
    compute_dtype: str = "float32"
    """--compute-dtype: what an hf engine apart loads its model in"""
    gpu_memory_utilization: float = 0.5
    """--rollout-gpu-memory-utilization: the vllm engine's share of a GPU while awake"""
    lora_sync: str = "auto"
    offload: bool = False
    seed: int = 1

    def sampling(self, **call) -> dict:
        """What one call samples with: the settings' temperature, top-p and top-k, sampled and without stop strings
        unless `call` says otherwise (do_sample False: validation's greedy decoding; stop_strings: a tool call's end)."""
        sampling = dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, stop_strings=None)
        return sampling | call


@dataclass
class EngineContext:
    """What a factory builds an engine from. In a policy worker's process `policy` is the FSDP2 model that trains (or a
    judge's frozen one) and the engine generates from it as it is when it wakes; in a rollout worker's own process
    `policy` is None: the engine loads `model_path` and generates from the weights last sent it."""

    settings: EngineSettings
    policy: Any
    optimizer: Any
    tokenizer: Any
    eos_token_ids: list[int]
    pad_token_id: int
    model_path: str
    device: torch.device
    placement: dict
    """the engine's rank, world_size, rendezvous master and on_gpu (EngineWorker.engine_placement)"""
    frozen: bool = False
    """the policy never changes (a judge): the engine keeps the weights it loaded"""
    adapter_config: Any = None
    """apart: the LoRA adapter the engine will be sent, which it then serves"""


def eos_token_ids(model_path: str, tokenizer) -> list[int]:
    """The tokens that end a response: those of the model's generation config, else the tokenizer's EOS."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: transformers derives one from the model's config
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def check_every_weight(missing: list[str]) -> None:
    """An engine's weights after a load: those that `missing` names received nothing, and the engine would generate
    with stale ones."""
    if missing:
        raise RuntimeError(f"the rollout engine received no weights for {missing}: it would generate with stale ones")


def padded_responses(tokens: list[list[int]], log_probs: list[list[float]], pad_token_id: int, device):
    """Responses of several lengths as one [batch, longest] batch of tokens, padded after each end, and their
    log-probs (0 on padding)."""
    longest = max(1, max(len(row) for row in tokens))
    responses = torch.full((len(tokens), longest), pad_token_id, dtype=torch.long)
    response_log_probs = torch.zeros(len(tokens), longest)
    for i, (ids, values) in enumerate(zip(tokens, log_probs)):
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_log_probs[i, : len(values)] = torch.tensor(values)
    return responses.to(device), response_log_probs.to(device)
