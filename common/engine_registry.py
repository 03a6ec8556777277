"""Which engine a name builds: `--rollout-engine NAME` the one registered under NAME (the hf and vllm engines, here),
`--rollout-engine path/to/file.py:NAME` the one NAME builds in a file of yours; an engine's own rules of its settings,
and whether it is sent the policy's LoRA adapter alone. Every process that builds engines (the policy's workers, the
rollout workers apart, the judge's) resolves the name itself (docs/rollout-engines.md)."""

from __future__ import annotations

import os
from typing import Callable

from common import hf_engine, vllm_engine
from common.engines import EngineContext, EngineSettings, RolloutEngine

def check_rollout(settings: EngineSettings) -> None:
    """Before anything is loaded: a temperature to sample at, which every engine needs, and a registered engine's own
    rules (register_engine's `check`). An engine in a file is checked as it is loaded (load_engine)."""
    if not settings.temperature > 0:
        raise ValueError(
            f"--temperature is {settings.temperature}: rollouts are sampled, so it must be above 0 "
            "(validation with --val-n 1 already decodes greedily)"
        )
    if settings.name in CHECKS:
        CHECKS[settings.name](settings)


def load_engine(settings: EngineSettings) -> Callable[[EngineContext], RolloutEngine]:
    """What builds the engines `settings` names, loaded where the run starts so that a file that defines no such
    factory stops it before any worker does; an engine in a file is held to its factory's own `check(settings)`."""
    factory = engine_factory(settings.name)
    if in_a_file(settings.name) and callable(getattr(factory, "check", None)):
        factory.check(settings)
    return factory


ENGINES: dict[str, Callable[[EngineContext], RolloutEngine]] = {}
"""name (--rollout-engine) -> factory"""
ADAPTER_RULES: dict[str, Callable[[bool, str, bool], bool]] = {}
"""name -> whether the engine serves the policy's adapter: (lora, --lora-sync, on GPUs) -> bool"""
CHECKS: dict[str, Callable[[EngineSettings], None]] = {}
"""name -> the engine's own rules of its settings, checked before any worker starts"""


def register_engine(name: str, factory: Callable[[EngineContext], RolloutEngine], serves_adapter=None, check=None) -> None:
    """Make `--rollout-engine name` build its engines with `factory`. `serves_adapter(lora, lora_sync, on_gpu)`: when
    the engine is sent the policy's LoRA adapter alone (an AdapterEngine) rather than every weight, adapter merged in
    (default: never); `check(settings)`: the engine's rules of its settings, a ValueError that names the flag. Register
    in every process that builds engines: at import of the engine's room. (An engine in a file of yours needs no line:
    `--rollout-engine FILE.py:NAME`, whose factory may carry the two as attributes.)"""
    ENGINES[name] = factory
    ADAPTER_RULES[name] = serves_adapter or (lambda lora, lora_sync, on_gpu: False)
    CHECKS[name] = check or (lambda settings: None)


def in_a_file(name: str) -> bool:
    """Whether `name` (--rollout-engine) names a factory in a file, path/to/file.py:NAME, rather than a registered engine."""
    return ":" in name and name.rpartition(":")[0].endswith(".py")


def check_engine(name: str) -> None:
    """Before any worker starts: an engine registered under `name`, or a file that exists named as FILE.py:NAME (what
    it defines is read when the engine is first built: engine_factory)."""
    if in_a_file(name):
        path = name.rpartition(":")[0]
        if not os.path.isfile(path):
            raise ValueError(f"--rollout-engine {name}: no file {path}; name a Python file and what builds the engine in it")
        return
    if name not in ENGINES:
        known = " or ".join(f"'{known}'" for known in ENGINES)
        raise ValueError(f"rollout engine '{name}' is not available; use {known} (--rollout-engine)")


def engine_factory(name: str) -> Callable[[EngineContext], RolloutEngine]:
    """What builds the engines `name` names: the registered factory, or NAME in the file path/to/file.py (loaded
    once a process, every process alike; common/isolation.py: load_user_file)."""
    check_engine(name)
    if not in_a_file(name):
        return ENGINES[name]
    from common.isolation import load_user_file

    path, _, attribute = name.rpartition(":")
    factory = getattr(load_user_file(path), attribute, None)
    if not callable(factory):
        raise ValueError(f"--rollout-engine {name}: {path} defines no {attribute} that builds an engine from its context")
    return factory


def make_engine(context: EngineContext) -> RolloutEngine:
    """The engine `context.settings.name` names, built from `context`."""
    return engine_factory(context.settings.name)(context)


def engine_serves_adapter(name: str, lora: bool, lora_sync: str, on_gpu: bool) -> bool:
    """Whether the engines `name` builds are sent the policy's LoRA adapter alone (see register_engine)."""
    if name in ADAPTER_RULES:
        return ADAPTER_RULES[name](lora, lora_sync, on_gpu)
    rule = getattr(engine_factory(name), "serves_adapter", None)
    return bool(rule(lora, lora_sync, on_gpu)) if rule is not None else False


register_engine("hf", hf_engine.build, check=hf_engine.check_settings)
register_engine("vllm", vllm_engine.VLLMEngine, serves_adapter=vllm_engine.serves_adapter, check=vllm_engine.check_settings)
