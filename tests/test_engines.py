"""An engine written here, registered through common.engines, generates in a policy worker group (real Ray actors on 2
CPU ranks, the tiny model): no other room knows its name."""

import sys

import pytest
import torch
from ray import cloudpickle

from common import engines
from common.engines import EngineContext, check_engine, register_engine
from common.hf_engine import HFEngine
from common.worker_group import WorkerGroup
from helpers import PolicyProbe

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the engine and its worker travel by value


class RecordingEngine(HFEngine):
    """The hf engine, recording each batch it is asked for and what it returned."""

    def __init__(self, context: EngineContext):
        super().__init__(context.policy, context.tokenizer, context.eos_token_ids, context.pad_token_id)
        self.calls = []

    def generate(self, prompts, prompt_mask, max_response_length, **sampling):
        responses, log_probs = super().generate(prompts, prompt_mask, max_response_length, **sampling)
        self.calls.append((prompts.cpu(), max_response_length, responses.cpu()))
        return responses, log_probs


class RecordingPolicy(PolicyProbe):
    def setup(self, master, model_path, **settings):
        register_engine("recording", RecordingEngine)  # in the process that builds the engine, as an engine's room does
        super().setup(master, model_path, **settings)

    def engine_calls(self) -> list:
        return self.engine.calls


@pytest.fixture
def registry(monkeypatch):
    """The registry as it was, whatever the test registers."""
    monkeypatch.setattr(engines, "ENGINES", dict(engines.ENGINES))
    monkeypatch.setattr(engines, "ADAPTER_RULES", dict(engines.ADAPTER_RULES))


def test_a_registered_engine_generates_in_the_policy_workers(registry, cpu_pool, tiny_model, prompts, tokenizer):
    with pytest.raises(ValueError, match="rollout engine 'recording' is not available; use 'hf' or 'vllm'"):
        check_engine("recording")
    register_engine("recording", RecordingEngine)
    check_engine("recording")  # --rollout-engine recording now passes the start-up check
    with pytest.raises(ValueError, match="rollout engine 'sglang' is not available; use 'hf' or 'vllm' or 'recording'"):
        check_engine("sglang")
    assert not engines.engine_serves_adapter("recording", True, "auto", True)
    group = WorkerGroup(RecordingPolicy, cpu_pool, "recording", model_path=tiny_model, rollout_engine="recording")
    try:
        batch = group.scatter("generate", prompts.select("prompts", "prompt_mask"), max_response_length=4)
        calls = [call for rank in group.broadcast("engine_calls") for call in rank]
    finally:
        group.shutdown()
    assert [length for _, length, _ in calls] == [4, 4]  # one batch a rank
    start = 0
    for rows, _, generated in calls:  # rank 0's 3 prompts, then rank 1's 2 (and a padding row, dropped)
        kept = min(len(rows), len(prompts) - start)
        assert torch.equal(rows[:kept], prompts["prompts"][start : start + kept])
        responses = batch["responses"][start : start + kept, : generated.shape[1]]
        mask = batch["response_mask"][start : start + kept, : generated.shape[1]].bool()
        assert mask[:, 0].all()
        assert torch.equal(responses[mask], generated[:kept][mask])  # what the engine returned is what the batch holds
        start += kept
    assert start == len(prompts)
