"""Split placement (--rollout-workers): rollout engines in processes of their own, apart from the policy's 2 CPU ranks.

After an update the policy's rank 0 sends its weights (every weight, or the LoRA adapter) to every engine over their
own gloo group. In fp32 each engine's log-probs of its own samples must then equal the trainer's, and every sample
carries the version of the weights that generated it; before the weights arrive, the engines still sample from the
old ones, which the trainer's log-probs show.
"""

import signal
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from ray import cloudpickle

from common.checkpoint import complete_checkpoints
from common.engines import EngineSettings
from common.rollout_correction import check_probe
from common.weight_sync import engine_weights, send_tensors
from common.worker_group import ResourcePool, WorkerGroup, wait_all
from common.workers import RolloutWorker
from helpers import (
    FP32_GAP,
    LOG_PROB_INPUTS,
    SMALL_RUN,
    TINY,
    VLLM_FP32,
    PolicyProbe,
    gap,
    metric_rows,
    metrics_of,
    run_script,
    start_script,
    train,
    wait_for_steps,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@contextmanager
def placed(cpu_pool, model_path, engines, name, adapter=False, policy_cls=PolicyProbe, engine_cls=RolloutWorker, **policy):
    """A policy group with no engine of its own, `engines` rollout workers on CPU bundles of their own, and the weight
    group between them."""
    policy = dict(model_path=model_path, generates=False, lr=1e-2, weight_decay=0.0, micro_batch_size=10) | policy
    policy = WorkerGroup(policy_cls, cpu_pool, "split_policy", **policy)
    pool = ResourcePool(engines, use_gpu=False)
    adapter_config = policy.broadcast("adapter_config")[0] if adapter else None
    engine = EngineSettings(name=name, dtype="float32", max_model_len=16, compute_dtype="float32")
    settings = dict(model_path=model_path, adapter_config=adapter_config, engine=engine)
    group = WorkerGroup(engine_cls, pool, "split_engines", **settings)
    try:
        address, size = policy.broadcast("master_address")[0], engines + 1
        wait_all(policy.submit("join_weight_group", address, size), group.submit("join_weight_group", address, size))
        yield policy, group
    finally:
        group.shutdown()
        policy.shutdown()
        pool.shutdown()


def rollout(engines, policy, prompts):
    """The engines sample, the trainer scores their samples: the batch holds both log-probs."""
    batch = prompts.repeat(4)
    batch |= engines.scatter("generate", batch.select("prompts", "prompt_mask"), max_response_length=4)
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    return batch


def scored_probe(policy, probe):
    """The trainer's log-probs of `probe`'s response, and the probe's tokens as an engine takes them."""
    trainer = policy.scatter("probe_log_probs", probe.select(*LOG_PROB_INPUTS))["old_log_probs"][probe["response_mask"].bool()]
    return trainer, probe["input_ids"][probe["attention_mask"].bool()].tolist()


def send(policy, engines, version, adapter, probe):
    """The weights to every engine, which each then score `probe`'s response: as the trainer does."""
    trainer, tokens = scored_probe(policy, probe)
    receive = engines.submit("receive_weights", version, tokens, len(trainer))
    _, engine_probes = wait_all(policy.submit("send_weights", adapter), receive)
    assert len(engine_probes) == engines.world_size
    for engine_probe in engine_probes:
        assert (engine_probe - trainer).abs().max() < FP32_GAP


def check_versions(policy, engines, prompts, adapter=False):
    """Two updates, each followed by the weights reaching every engine."""
    first = rollout(engines, policy, prompts)
    assert torch.all(first["weight_version"] == 0)
    probe = first[np.array([0])]
    for version in (1, 2):
        train(policy, rollout(engines, policy, prompts))
        assert gap(rollout(engines, policy, prompts)) > 0.01  # the engines still hold the last version
        trainer, tokens = scored_probe(policy, probe)
        with pytest.raises(RuntimeError, match=f"after the weights of update {version} reached the rollout workers"):
            check_probe(version, trainer, engines.broadcast("probe_log_probs", tokens, len(trainer)), bound=0.01)
        send(policy, engines, version, adapter, probe)
        batch = rollout(engines, policy, prompts)
        assert torch.all(batch["weight_version"] == version)
        assert gap(batch) < FP32_GAP


def test_vllm_engines_apart_receive_every_weight_after_each_update(cpu_pool, tiny_model, prompts):
    with placed(cpu_pool, tiny_model, 2, "vllm") as (policy, engines):
        check_versions(policy, engines, prompts)


def test_vllm_engine_apart_serves_the_lora_adapter_it_is_sent(cpu_pool, tiny_model, prompts):
    with placed(cpu_pool, tiny_model, 1, "vllm", adapter=True, lora_rank=8) as (policy, engines):
        check_versions(policy, engines, prompts, adapter=True)


def test_hf_engines_apart_receive_the_lora_adapter_merged(cpu_pool, tiny_model, prompts):
    with placed(cpu_pool, tiny_model, 2, "hf", lora_rank=8) as (policy, engines):
        check_versions(policy, engines, prompts)


class BucketedPolicy(PolicyProbe):
    weight_bucket_bytes = 4096  # many buckets, and tensors larger than one, which travel alone

    def engine_weights(self) -> dict:
        return {name: tensor.to("cpu", copy=True) for name, tensor in engine_weights(self.model)}

    def send_weights_without(self, dropped: str) -> None:
        """send_weights, but the weight `dropped` never leaves: as a broken sync would send."""
        weights = engine_weights(self.model)
        kept = [(name, tensor.to("cpu", copy=True)) for name, tensor in weights if name != dropped]
        if self.rank == 0:
            send_tensors(self.weight_group, kept, self.device, self.weight_bucket_bytes)


class InspectedEngine(RolloutWorker):
    def weights(self) -> dict:
        return {name: param.detach().clone() for name, param in self.engine.policy.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora-merged"])
def test_bucketed_sync_leaves_every_engine_tensor_equal_to_the_trainers(cpu_pool, tiny_model, prompts, lora):
    settings = dict(lora_rank=8) if lora else {}
    with placed(cpu_pool, tiny_model, 2, "hf", policy_cls=BucketedPolicy, engine_cls=InspectedEngine, **settings) as (
        policy,
        engines,
    ):
        first = rollout(engines, policy, prompts)
        train(policy, first)
        trainer = policy.broadcast("engine_weights")[0]
        stale = engines.broadcast("weights")[0]
        assert sum(not torch.equal(stale[name], tensor.to(stale[name].dtype)) for name, tensor in trainer.items()) >= 7 * 2
        send(policy, engines, 1, False, first[np.array([0])])
        for engine in engines.broadcast("weights"):
            assert set(engine) == set(trainer)
            for name, tensor in trainer.items():
                torch.testing.assert_close(engine[name], tensor.to(engine[name].dtype), rtol=0, atol=0)


def test_an_engine_apart_that_misses_a_weight_stops_the_run(cpu_pool, tiny_model):
    with placed(cpu_pool, tiny_model, 1, "hf", policy_cls=BucketedPolicy) as (policy, engines):
        receive = engines.submit("receive_weights", 1, [1, 2, 3], 1)
        policy.broadcast("send_weights_without", "model.norm.weight")
        with pytest.raises(RuntimeError, match=r"received no weights for \['model.norm.weight'\]"):
            receive.result()


ASYNC = ["--num-workers", "1", "--rollout-workers", "1", *VLLM_FP32]


@pytest.mark.parametrize(
    "algo, flags",
    [
        ("grpo", ["--max-staleness", "0"]),
        ("grpo", ["--max-staleness", "2", "--total-steps", "4", "--mini-batch-size", "8"]),
        ("ppo", ["--max-staleness", "1"]),
        ("dapo", ["--max-staleness", "1"]),
    ],
    ids=["grpo-synchronous", "grpo-staleness-2-one-mini-batch", "ppo-staleness-1", "dapo-staleness-1"],
)
def test_steps_on_a_rollout_worker(ray_cluster, demo_files, tmp_path, algo, flags):
    """The policy on one worker and the vLLM engine on another: the engine generates the next batches while the policy
    trains, none more than --max-staleness updates behind it, and the weight probe finds the engine's weights exact."""
    result = run_script(f"{algo}_hybrid.py", *SMALL_RUN[:-2], *ASYNC, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    bound = int(flags[1])
    run_dir, rows = metrics_of(tmp_path)
    assert "(RolloutWorker pid=" in (run_dir / "console.log").read_text()  # the console hides the engine's hints
    steps = rows[1:]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    for row in steps:
        assert row["rollout/staleness_max"] <= bound
        assert "timing/wait_for_rollouts" in row and "timing/rollout_idle" in row
        assert row.get("rollout/probe_logprob_diff", 0) < 1e-4
        assert row["perf/peak_memory_gb/rollout/generate"] > 0 and row["perf/peak_memory_gb/policy/send_weights"] > 0
        # one epoch over one mini-batch: the update's own log-probs are the proximal policy's, with no pass of their own
        assert ("timing/old_log_prob" in row) == ("--mini-batch-size" not in flags)
    assert sum("rollout/probe_logprob_diff" in row for row in steps) >= len(steps) - bound
    # from the second step the engine has been generating while the policy trained
    assert max(row["rollout/staleness_max"] for row in steps) == bound
    if bound == 0:  # every sample from the policy's own weights: the engine's log-probs are the trainer's
        assert all(row["rollout/logprob_diff_max"] < 1e-4 for row in steps)
    else:
        assert max(row["rollout/ratio_std"] for row in steps) > 0
        # the correction's weights spread both ways around 1, measured by the update where it stands in for the pass
        assert max(row["rollout_corr/weight_max"] for row in steps) > 1 > min(row["rollout_corr/weight_min"] for row in steps)
        assert max(row["rollout_corr/chi2_centered_token"] for row in steps) > 0


def test_sigterm_saves_the_engines_batches_in_flight_and_the_run_resumes(ray_cluster, demo_files, tmp_path):
    """The batches the engine was asked for and no step trained on (2, with --max-staleness 2) are saved with the
    checkpoint, generated to their end, and the data's position after their prompts: the resumed run trains on them."""
    flags = [*TINY, *ASYNC, "--max-staleness", "2", "--save-freq", "1000"]
    process = start_script("grpo_hybrid.py", *flags, "--total-steps", "500", cwd=tmp_path)
    run_dir = wait_for_steps(tmp_path, 2, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    [checkpoint] = complete_checkpoints(run_dir)
    step = int(checkpoint.name.removeprefix("step_"))
    driver = torch.load(checkpoint / "driver.pt", weights_only=False)
    assert driver["loader"] == {"epoch": 0, "batch_index": step + 2}
    assert [entry[0] for entry in driver["in_flight"]].count("batch") == 2
    result = run_script("grpo_hybrid.py", "--total-steps", str(step + 2), "--resume", "auto", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"runs/{run_dir.name}/checkpoints/step_{step}" in result.stdout
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows][-2:] == [step + 1, step + 2]
    assert all(row["rollout/staleness_max"] <= 2 for row in rows)
