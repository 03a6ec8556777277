"""The rollout engines' one interface (`RolloutEngine`) and their registry: `--rollout-engine NAME` builds the engine
registered under NAME, in the policy's processes or in rollout workers apart. Adding an engine is a room that defines
it and one `register_engine(name, factory)` line (docs/rollout-engines.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from common.hf_engine import HFRollout
from common.vllm_engine import VLLMRollout, serves_adapter


class RolloutEngine(Protocol):
    """What the workers call on an engine (common/rollout.py: EngineWorker, common/workers/rollout.py): a batch of prompts
    at once (generate), or requests one by one (an episode's turns, as each comes: open_requests, add_request,
    finished_requests, close_requests)."""

    dtype: torch.dtype
    """the dtype the engine keeps its weights in, which the policy sends them in"""

    def generate(
        self, prompts, prompt_mask, max_response_length: int, do_sample: bool, temperature: float, top_p: float,
        top_k: int, stop_strings: list[str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One response per left-padded prompt ([batch, steps] tokens, padded after the end) and the log-prob of each
        sampled token under the distribution it was sampled from ([batch, steps])."""

    prefilled_tokens: int
    """the context tokens the engine computed so far (those its caches did not hold), which the logs count"""

    def open_requests(self) -> None:
        """Get ready to take requests one by one (an episode's turns), from the policy as it is now (the colocated
        engines wake and receive its weights here)."""

    def add_request(self, key: str, tokens: list[int], max_tokens: int, **sampling) -> None:
        """Start a response of at most `max_tokens` to `tokens` (sampling as generate takes it). `key`: the episode's,
        the same for each of its turns, whose context then begins with the earlier turn's: an engine may keep what
        it computed of one turn for the next."""

    def finished_requests(self) -> list[tuple[str, list[int], list[float], int]]:
        """Generate until at least one request under way ends (or a short while passed): each ended one's key, tokens
        (to its EOS or the token that completes a stop string), their log-probs, and how many of its context's tokens
        the engine computed (the others came from its cache)."""

    def close_requests(self, prefix: str, last: bool) -> None:
        """The requests whose keys begin with `prefix` are done with (a play of episodes ended): forget what was kept of
        them; `last`: no play is open any more (the colocated engines go back to sleep)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs named as in the model's checkpoint into the engine: every weight it has must
        arrive, or it raises (it would generate from stale ones). What the engine cached is dropped with the old
        weights."""

    def prompt_log_probs(self, tokens: list[int]) -> torch.Tensor:
        """log p(token | the tokens before it) at temperature 1 for every token of `tokens` but the first."""


class AdapterEngine(RolloutEngine, Protocol):
    """An engine that serves the policy's LoRA adapter on its base weights (registered with `serves_adapter`)."""

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config) -> None:
        """Serve this adapter (PEFT-named tensors, its LoraConfig) from now on."""


@dataclass
class EngineContext:
    """What a factory builds an engine from. In a policy worker's process `policy` is the FSDP2 model that trains (or a
    judge's frozen one) and the engine generates from it as it is at each call; in a rollout worker's own process
    `policy` is None: the engine loads `model_path` and generates from the weights last sent it."""

    policy: Any
    optimizer: Any
    tokenizer: Any
    eos_token_ids: list[int]
    pad_token_id: int
    model_path: str
    device: torch.device
    placement: dict
    """the engine's rank, world_size, rendezvous master and on_gpu (EngineWorker.engine_placement)"""
    seed: int
    rollout_dtype: str
    """--rollout-dtype, the vllm engine's weights"""
    compute_dtype: torch.dtype
    """an hf engine apart loads its model in this"""
    gpu_memory_utilization: float
    max_model_len: int
    lora_sync: str = "auto"
    offload: bool = False
    frozen: bool = False
    """the policy never changes (a judge): the engine keeps the weights it loaded"""
    adapter_config: Any = None
    """apart: the LoRA adapter the engine will be sent, which it then serves"""


def hf_engine(context: EngineContext) -> HFRollout:
    """transformers' generate on the policy itself, or apart on a whole model loaded from `model_path`."""
    from transformers import AutoModelForCausalLM

    model = context.policy
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(context.model_path, dtype=context.compute_dtype)
        model = model.to(context.device).eval()
    return HFRollout(model, context.tokenizer, context.eos_token_ids, context.pad_token_id)


def vllm_engine(context: EngineContext) -> VLLMRollout:
    """A vLLM engine in this process (see VLLMRollout)."""
    return VLLMRollout(
        context.policy,
        context.optimizer,
        context.eos_token_ids,
        context.pad_token_id,
        model_path=context.model_path,
        **context.placement,
        seed=context.seed,
        dtype=getattr(torch, context.rollout_dtype),
        gpu_memory_utilization=context.gpu_memory_utilization,
        max_model_len=context.max_model_len,
        lora_sync=context.lora_sync,
        offload=context.offload,
        frozen=context.frozen,
        adapter_config=context.adapter_config,
    )


ENGINES: dict[str, Callable[[EngineContext], RolloutEngine]] = {}
"""name (--rollout-engine) -> factory"""
ADAPTER_RULES: dict[str, Callable[[bool, str, bool], bool]] = {}
"""name -> whether the engine serves the policy's adapter: (lora, --lora-sync, on GPUs) -> bool"""


def register_engine(name: str, factory: Callable[[EngineContext], RolloutEngine], serves_adapter=None) -> None:
    """Make `--rollout-engine name` build its engines with `factory`. `serves_adapter(lora, lora_sync, on_gpu)`: when
    the engine is sent the policy's LoRA adapter alone (an AdapterEngine) rather than every weight, adapter merged in
    (default: never). Register in every process that builds engines: at import of the engine's room."""
    ENGINES[name] = factory
    ADAPTER_RULES[name] = serves_adapter or (lambda lora, lora_sync, on_gpu: False)


def check_engine(name: str) -> None:
    """Before any worker starts: an engine registered under `name`."""
    if name not in ENGINES:
        known = " or ".join(f"'{known}'" for known in ENGINES)
        raise ValueError(f"rollout engine '{name}' is not available; use {known} (--rollout-engine)")


def make_engine(name: str, context: EngineContext) -> RolloutEngine:
    """The engine registered under `name`, built from `context`."""
    check_engine(name)
    return ENGINES[name](context)


def engine_serves_adapter(name: str, lora: bool, lora_sync: str, on_gpu: bool) -> bool:
    """Whether the engines `name` builds are sent the policy's LoRA adapter alone (see register_engine)."""
    return ADAPTER_RULES[name](lora, lora_sync, on_gpu)


register_engine("hf", hf_engine)
register_engine("vllm", vllm_engine, serves_adapter=serves_adapter)
