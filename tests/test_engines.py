"""An engine written here, registered through common.engines, generates in a policy worker group (real Ray actors on 2
CPU ranks, the tiny model): no other room knows its name. An engine in a file of its own (engine_in_a_file.py) runs
the scripts, named on the command line alone."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

from common import engine_registry
from common.engine_registry import check_engine, register_engine
from common.engines import EngineContext, EngineSettings
from common.hf_engine import HFEngine
from common.worker_group import WorkerGroup
from helpers import TINY, PolicyProbe, metrics_of, run_script

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
    for table in ("ENGINES", "ADAPTER_RULES", "CHECKS"):
        monkeypatch.setattr(engine_registry, table, dict(getattr(engine_registry, table)))


def test_a_registered_engine_generates_in_the_policy_workers(registry, cpu_pool, tiny_model, prompts, tokenizer):
    with pytest.raises(ValueError, match="rollout engine 'recording' is not available; use 'hf' or 'vllm'"):
        check_engine("recording")
    register_engine("recording", RecordingEngine)
    check_engine("recording")  # --rollout-engine recording now passes the start-up check
    with pytest.raises(ValueError, match="rollout engine 'sglang' is not available; use 'hf' or 'vllm' or 'recording'"):
        check_engine("sglang")
    assert not engine_registry.engine_serves_adapter("recording", True, "auto", True)
    group = WorkerGroup(RecordingPolicy, cpu_pool, "recording", model_path=tiny_model, engine=EngineSettings(name="recording"))
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


@pytest.mark.parametrize(
    "flags, asked",
    [
        (["--num-workers", "2"], {"batch"}),
        (["--num-workers", "2", "--env", "calculator"], {"turn"}),
        (["--num-workers", "1", "--rollout-workers", "1", "--max-staleness", "1"], {"batch"}),
    ],
    ids=["single-turn", "episodes", "apart-and-stale"],
)
def test_an_engine_in_a_file_runs_a_script_named_on_the_command_line_alone(ray_cluster, demo_files, tmp_path, flags, asked):
    engine = Path(shutil.copy(Path(__file__).with_name("engine_in_a_file.py"), tmp_path))
    name = f"{engine}:TallyingEngine"
    result = run_script("grpo_hybrid.py", *TINY, "--total-steps", "2", "--rollout-engine", name, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, rows = metrics_of(tmp_path)
    assert rows[-1]["step"] == 2 and all(row["response/length_mean"] > 0 for row in rows if "response/length_mean" in row)
    tally = [line.split() for line in engine.with_suffix(".tally").read_text().splitlines()]
    assert {kind for kind, _ in tally} == asked  # every rollout came from the engine in the file
    assert len({process for _, process in tally}) == (1 if "--rollout-workers" in flags else 2)  # in each engine's process


def test_an_engine_named_by_a_file_that_lacks_it_stops_the_run_before_any_worker(demo_files, tmp_path):
    (tmp_path / "empty.py").write_text("")
    for name, message in [(f"{tmp_path}/none.py:Engine", "no file"), (f"{tmp_path}/empty.py:Engine", "defines no Engine")]:
        result = run_script("grpo_hybrid.py", *TINY, "--total-steps", "1", "--rollout-engine", name, cwd=tmp_path)
        assert result.returncode != 0 and message in result.stderr, result.stderr[-3000:]
