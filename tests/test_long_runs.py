"""Long runs that survive: exact resume, signals, crashes mid-save, NaNs, hanging rewards, bad input (dying workers and
the other faults mid-run: test_faults.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.checkpoint import complete_checkpoints, find_checkpoint, save_checkpoint
from common.dataproto import DataProto
from common.isolation import InProcessCalls
from common.rewards import REWARD_CALLS
from common.worker_group import WorkerDied, WorkerGroup
from common.workers import PolicyWorker
from helpers import (
    ROOT,
    TINY,
    PolicyProbe,
    comparable,
    metric_rows,
    run_script,
    score,
    start_script,
    stop_in_process,
    wait_for_steps,
)


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dapo"])
def test_resumed_run_repeats_an_uninterrupted_one_step_for_step(ray_cluster, demo_files, tmp_path, algo):
    # The demo's cosine learning rate follows --total-steps, which the interrupted run raises from 2 to 4.
    constant_lr = ["--lr-schedule", "constant"]
    (tmp_path / "straight").mkdir()
    result = run_script(
        f"{algo}_hybrid.py",
        *TINY,
        "--total-steps",
        "4",
        "--save-freq",
        "1",
        "--keep-last",
        "2",
        *constant_lr,
        cwd=tmp_path / "straight",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [straight] = (tmp_path / "straight" / "runs").iterdir()
    assert [c.name for c in complete_checkpoints(straight)] == ["step_3", "step_4"]
    assert not list((straight / "checkpoints").glob(".*partial"))

    (tmp_path / "resumed").mkdir()
    result = run_script(
        f"{algo}_hybrid.py", *TINY, "--total-steps", "2", "--save-freq", "2", *constant_lr, cwd=tmp_path / "resumed"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # a flag marked resumable may change: DAPO's advice when dynamic sampling runs out is to raise --max-gen-batches
    raised = ["--max-gen-batches", "20"] if algo == "dapo" else []
    flags = ["--total-steps", "4", "--save-freq", "2", "--resume", "auto", *constant_lr, *raised]
    result = run_script(f"{algo}_hybrid.py", *TINY, *flags, cwd=tmp_path / "resumed")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    [resumed] = (tmp_path / "resumed" / "runs").iterdir()
    assert [r["step"] for r in metric_rows(resumed)] == [1, 2, 3, 4]
    assert [comparable(r) for r in metric_rows(resumed)] == [comparable(r) for r in metric_rows(straight)]


@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_a_signal_saves_a_checkpoint_that_resumes(ray_cluster, demo_files, tmp_path, stop):
    process = start_script("grpo_hybrid.py", *TINY, "--total-steps", "500", "--save-freq", "1000", cwd=tmp_path)
    run_dir = wait_for_steps(tmp_path, 2, process)
    if stop == "sigterm":
        process.send_signal(signal.SIGTERM)
    else:
        os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    [checkpoint] = complete_checkpoints(run_dir)
    step = int(checkpoint.name.removeprefix("step_"))
    assert 2 <= step < 500
    assert [r["step"] for r in metric_rows(run_dir)][-1] == step
    result = run_script(
        "grpo_hybrid.py", *TINY, "--total-steps", str(step + 1), "--save-freq", "1000", "--resume", "auto", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"runs/{run_dir.name}/checkpoints/step_{step}" in result.stdout
    assert [r["step"] for r in metric_rows(run_dir)][-1] == step + 1


def test_other_config_is_refused_unless_forced_and_export_adapter_only(ray_cluster, demo_files, tmp_path):
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"]
    result = run_script("grpo_hybrid.py", *TINY, "--total-steps", "1", *lora, "--export-adapter-only", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert (run_dir / "model" / "adapter_config.json").exists()

    result = run_script("grpo_hybrid.py", *TINY, "--total-steps", "2", *lora[:-1], "5e-3", "--resume", "auto", cwd=tmp_path)
    assert result.returncode != 0
    assert "was made with other settings (lr: 0.01 -> 0.005)" in result.stderr and "--force-resume" in result.stderr
    assert "PolicyWorker" not in result.stderr

    result = run_script(
        "grpo_hybrid.py", *TINY, "--total-steps", "2", *lora[:-1], "5e-3", "--resume", "auto", "--force-resume", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert not any("lora" in name for name in merged.state_dict())
    assert (run_dir / "model" / "tokenizer.json").exists()


def test_exported_model_is_the_trained_policy(ray_cluster, demo_files, tmp_path):
    """The merged export reproduces the policy's greedy answers on the held-out problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = run_script(
        "grpo_hybrid.py",
        *TINY,
        "--total-steps",
        "3",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lr",
        "1e-2",
        "--test-freq",
        "3",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    samples = [json.loads(line) for line in (run_dir / "validation" / "step_3.jsonl").read_text().splitlines()]
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(run_dir / "model"),
        AutoTokenizer.from_pretrained(run_dir / "model"),
    )
    for sample in samples[:10]:
        prompt = tokenizer(sample["prompt"], return_tensors="pt")
        output = model.generate(**prompt, max_new_tokens=4, do_sample=False)
        assert tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True) == sample["response"]


def test_nan_gradients_skip_updates_then_stop_the_run(ray_cluster, demo_files, tmp_path):
    result = run_script(
        "grpo_hybrid.py", *TINY, "--total-steps", "10", "--max-bad-steps", "2", "--entropy-coef", "nan", cwd=tmp_path
    )
    assert result.returncode != 0
    assert (
        "2 steps in a row had NaN or inf gradients; their updates were skipped, so no weights are corrupted" in result.stderr
    )
    [run_dir] = (tmp_path / "runs").iterdir()
    assert [r["actor/skipped_updates"] for r in metric_rows(run_dir)] == [2.0, 2.0]  # both mini-batches of both steps


@pytest.mark.parametrize(
    "body, failure",
    [
        ("return float('nan')", "ValueError: the reward function returned the score nan"),
        ("return None", "TypeError: the reward function returned None"),
        ("return {'exact': 1.0}", "TypeError: the reward function returned {'exact': 1.0}"),
        ("import sys; sys.exit()", "SystemExit"),
        ("import ctypes; ctypes.string_at(0)", "the reward process died with exit code -11"),
    ],
    ids=["nan", "none", "no-score", "sys-exit", "segfault"],
)
def test_a_reward_broken_for_every_sample_stops_at_the_first_step(ray_cluster, demo_files, tmp_path, body, failure):
    (tmp_path / "broken.py").write_text(f"def score(data_source, solution_str, ground_truth, extra_info):\n    {body}\n")
    flags = ["--total-steps", "3", "--reward-fn", f"{tmp_path}/broken.py:score", "--reward-workers", "2"]
    result = run_script("grpo_hybrid.py", *TINY, *flags, cwd=tmp_path)
    assert result.returncode != 0
    assert "the reward function failed for 32 of 32 samples, more than --max-reward-error-share 0.5 allows" in result.stderr
    assert "for data_source 'addition', ground_truth" in result.stderr and failure in result.stderr
    assert (
        f"(the reward: {tmp_path}/broken.py:score)" in result.stderr
        and "prompt '" in result.stderr
        and "response '" in result.stderr
    )
    [run_dir] = (tmp_path / "runs").iterdir()
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()  # no step finished


def test_nan_loss_leaves_the_weights_untouched(cpu_pool, tiny_model, tokenizer, demo_files):
    from common.data import collate, load_prompts

    group = WorkerGroup(
        PolicyProbe, cpu_pool, "policy", model_path=tiny_model, lr=1e-2, use_reference=False, micro_batch_size=2
    )
    try:
        prompts = collate(load_prompts([demo_files[1]], tokenizer, 8)[:4], tokenizer.pad_token_id)
        batch = prompts | group.scatter("generate", prompts.select("prompts", "prompt_mask"), max_response_length=4)
        before = group.broadcast("full_state_dict")[0]

        def nan_loss(batch, outputs, minibatch_tokens, minibatch_seqs):
            return outputs[0].sum() * float("nan"), {}

        inputs = batch.select("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
        [metrics, _] = group.scatter("update", inputs, loss_fn=nan_loss)
        assert metrics["skipped_updates"] == 1
        after = group.broadcast("full_state_dict")[0]
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        group.shutdown()


def test_a_crash_mid_save_leaves_the_previous_checkpoint(cpu_pool, tiny_model, tmp_path):
    run_dir = tmp_path / "runs" / "grpo__x__1__0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    group = WorkerGroup(PolicyWorker, cpu_pool, "policy", model_path=tiny_model, use_reference=False)
    save_checkpoint(run_dir, 1, {"policy": group}, {"loader": {}}, keep_last=2)
    group.shutdown()
    with pytest.raises(WorkerDied, match="died during 'save'"):
        save_checkpoint(run_dir, 2, {"policy": group}, {"loader": {}}, keep_last=2)
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step_1"]
    assert find_checkpoint("auto", str(tmp_path / "runs"), "grpo__x__1") == (run_dir / "checkpoints" / "step_1").resolve()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        find_checkpoint(str(run_dir / "checkpoints" / ".step_2.partial"), str(tmp_path / "runs"), "grpo__x__1")


def test_a_hanging_reward_is_cut_off(tokenizer):
    def slow(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "12":
            time.sleep(30)
        return 1.0

    responses = torch.tensor([tokenizer("3")["input_ids"] + [0], tokenizer("12")["input_ids"]])
    batch = DataProto.from_dict(
        {"responses": responses}, {"data_source": ["addition"] * 2, "ground_truth": ["3", "12"], "extra_info": [{}, {}]}
    )
    started = time.time()
    scores, metrics, _ = score(batch, tokenizer, InProcessCalls(slow, "slow.py:slow", REWARD_CALLS, timeout=0.5))
    assert time.time() - started < 5
    assert scores.tolist() == [1.0, 0.0]
    assert metrics == {"reward/errors": 0, "reward/timeouts": 1, "reward/unscored": 0}


# The flags of each case ({tmp}: the test's folder, {model}, {val}: the demo's), and what the refusal says
BAD_INPUT = {
    "missing-file": (["--train-files", "{tmp}/missing.parquet"], "missing.parquet does not exist"),
    "empty-file": (["--train-files", "{tmp}/empty.jsonl"], "empty.jsonl has no rows"),
    "long-prompt": (
        ["--train-files", "{tmp}/long.jsonl"],
        "long.jsonl, row 0: the prompt has 9 tokens, more than --max-prompt-length 8",
    ),
    "batch-larger-than-data": (
        ["--train-batch-size", "128", "--mini-batch-size", "64"],
        "--train-batch-size is 128 prompts, more than the 100 in --train-files",
    ),
    "indivisible-workers": (["--num-workers", "3"], "does not split evenly over --num-workers 3"),
    "indivisible-mini-batch": (
        ["--train-batch-size", "8", "--mini-batch-size", "3"],
        "--train-batch-size 8 is not a multiple of --mini-batch-size 3",
    ),
    "vllm-top-p": (
        ["--rollout-engine", "vllm", "--top-p", "0.9"],
        "--rollout-engine vllm samples from the whole distribution here",
    ),
    "test-freq-0": (["--test-freq", "0"], "--test-freq is 0; it must be above 0"),
    "save-freq-0": (["--save-freq", "0"], "--save-freq is 0; it must be above 0"),
    "mini-batch-0": (["--mini-batch-size", "0"], "--mini-batch-size is 0; it must be above 0"),
    "micro-batch-0": (["--micro-batch-size", "0"], "--micro-batch-size is 0; it must be above 0"),
    "micro-batch-tokens-below-one-sequence": (
        ["--micro-batch-tokens", "10"],
        "--micro-batch-tokens 10 cannot hold one sequence of --max-prompt-length + --max-response-length = 12 tokens",
    ),
    "micro-batch-tokens-negative": (
        ["--micro-batch-tokens", "-1"],
        "--micro-batch-tokens is -1; use 0 to count sequences, auto, or more",
    ),
    "max-memory-share-above-1": (
        ["--max-memory-share", "1.5"],
        "--max-memory-share is 1.5; it is a share of the memory, at most 1",
    ),
    "max-memory-share-without-auto": (
        ["--max-memory-share", "0.5"],
        "--max-memory-share 0.5 sizes the micro-batches of --micro-batch-tokens auto",
    ),
    "sequence-parallel-indivisible-workers": (
        ["--sequence-parallel", "3"],
        "--sequence-parallel 3 does not divide --num-workers 2 into groups of workers",
    ),
    "staleness-without-rollout-workers": (
        ["--max-staleness", "1"],
        "which needs engines apart from the policy's processes (--rollout-workers 1 or more)",
    ),
    "rollout-workers-negative": (
        ["--rollout-workers", "-1"],
        "--rollout-workers is -1; use 0 for the policy's own processes to generate",
    ),
    "sequence-parallel-above-heads": (
        ["--num-workers", "4", "--sequence-parallel", "4"],
        "has 2 attention heads, and each rank attends for at least one; use at most 2",
    ),
    "max-response-length-0": (["--max-response-length", "0"], "--max-response-length is 0; it must be above 0"),
    "max-turns-0": (["--env", "calculator", "--max-turns", "0"], "--max-turns is 0; it must be above 0"),
    "temperature-0": (["--temperature", "0"], "--temperature is 0.0: rollouts are sampled, so it must be above 0"),
    "reward-workers-negative": (["--reward-workers", "-1"], "--reward-workers is -1; use 0 to score in this process, or more"),
    "model-path-missing": (
        ["--model-path", "{tmp}/nowhere", "--train-files", "{val}"],
        "--model-path {tmp}/nowhere: no such folder",
    ),
    "model-path-without-config": (
        ["--model-path", "{tmp}", "--train-files", "{val}"],
        "--model-path {tmp}: no config.json in it",
    ),
    "no-train-files": (["--model-path", "{model}", "--val-files", "{val}"], "--train-files is missing"),
    "n-1-in-grpo": (["--n", "1"], "--n 1: the advantage compares each response with the others sampled for its prompt"),
    "empty-prompt": (["--train-files", "{tmp}/empty_prompt.jsonl"], "empty_prompt.jsonl, row 1: field 'prompt' has no text"),
    "null-ground-truth": (
        ["--train-files", "{tmp}/null_truth.jsonl"],
        "null_truth.jsonl, row 0: field 'reward_model' has a null 'ground_truth'",
    ),
}
# run as processes of their own as well: a file's error, a rule of the script, a check of the model folder
COMMAND_LINE_IDS = ["missing-file", "n-1-in-grpo", "model-path-without-config"]


def write_bad_files(folder: Path) -> None:
    """Prompt files that fail the checks: empty, a prompt over 8 tokens, an empty prompt, a null ground truth."""
    (folder / "empty.jsonl").write_text("")
    row = {
        "prompt": [{"role": "user", "content": "123456+7="}],
        "data_source": "addition",
        "reward_model": {"ground_truth": "123463"},
    }
    (folder / "long.jsonl").write_text(json.dumps(row) + "\n")
    short, empty = ({**row, "prompt": [{"role": "user", "content": text}]} for text in ("1+2=", " "))
    (folder / "empty_prompt.jsonl").write_text(json.dumps(short) + "\n" + json.dumps(empty) + "\n")
    (folder / "null_truth.jsonl").write_text(json.dumps({**row, "reward_model": {"ground_truth": None}}) + "\n")


def filled_in(flags, message, tmp_path, demo_files):
    paths = {"{tmp}": str(tmp_path), "{model}": demo_files[0], "{val}": demo_files[2]}
    for pattern, path in paths.items():
        flags, message = [f.replace(pattern, path) for f in flags], message.replace(pattern, path)
    return flags, message


@pytest.mark.parametrize("flags, message", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_stops_before_any_worker(demo_files, tmp_path, monkeypatch, flags, message):
    """The script's own code in this process, as `python algos/grpo_hybrid.py FLAGS` runs it: it stops with the message
    before it would start Ray (where it would, the test fails)."""
    write_bad_files(tmp_path)
    flags, message = filled_in(flags, message, tmp_path, demo_files)
    stop = stop_in_process("grpo_hybrid.py", *flags, cwd=tmp_path, monkeypatch=monkeypatch)
    assert message in stop and "PolicyWorker" not in stop
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flags, message", [BAD_INPUT[name] for name in COMMAND_LINE_IDS], ids=COMMAND_LINE_IDS)
def test_bad_input_on_the_command_line_stops_before_any_worker(demo_files, tmp_path, flags, message):
    """A few of the cases above as a user types them: a process of its own, its message on stderr."""
    write_bad_files(tmp_path)
    flags, message = filled_in(flags, message, tmp_path, demo_files)
    result = subprocess.run(
        [sys.executable, str(ROOT / "algos" / "grpo_hybrid.py"), *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert "PolicyWorker" not in result.stderr and not (tmp_path / "runs").exists()


def test_resume_auto_with_nothing_to_resume_and_validation_on_the_training_prompts_say_so(ray_cluster, demo_files, tmp_path):
    model, train, _ = demo_files
    result = run_script(
        "grpo_hybrid.py",
        *TINY,
        "--model-path",
        model,
        "--train-files",
        train,
        "--total-steps",
        "1",
        "--resume",
        "auto",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--resume auto: no checkpoint of runs/grpo__grpo_hybrid__1__* yet, so this run starts from step 1" in result.stdout
    assert "accuracy on the training prompts (no --val-files): " in result.stdout and "held-out" not in result.stdout


def test_a_script_joins_a_cluster_started_by_ray_start_with_token_authentication(demo_files, tmp_path):
    """docs/several-nodes.md's path as typed: `ray start --head`, then `RAY_ADDRESS=HEAD:PORT python ...`, nothing else.

    A local Ray (2.59 and later) leaves a token in ~/.ray/auth_token; `ray start` then turns token authentication on
    for the cluster, which refuses a driver that is not in token mode."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}
    subprocess.run([ray_cli, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    head_flags = [f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--block"]
    head = subprocess.Popen(
        [ray_cli, "start", "--head", *head_flags], env=env, start_new_session=True, stdout=subprocess.DEVNULL
    )
    try:
        env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        join = [sys.executable, "-c", "import ray; ray.init(); print(ray.cluster_resources()['CPU'])"]
        deadline = time.time() + 120
        while subprocess.run(join, env=env | {"RAY_AUTH_MODE": "token"}, capture_output=True).returncode != 0:
            assert time.time() < deadline and head.poll() is None, "the head node did not start"
            time.sleep(1)
        refused = subprocess.run(join, env=env | {"RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0  # token authentication is on
        script = [sys.executable, str(ROOT / "algos" / "grpo_hybrid.py"), *TINY, "--total-steps", "1"]
        result = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        [run_dir] = (tmp_path / "runs").iterdir()
        assert [r["step"] for r in metric_rows(run_dir)] == [1]
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the head and everything it started, not the tests' own Ray
        head.wait()


MULTI_NODE = """
import os, subprocess, sys
# the nodes and the script in one authentication mode, whatever the tests' own Ray left in the environment
os.environ["RAY_AUTH_MODE"] = "disabled"
import ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
cluster.add_node(num_cpus=1)
ray.init(address=cluster.address)
assert len([n for n in ray.nodes() if n["Alive"]]) == 2
# each node has one CPU, so the two policy workers must land on different nodes
env = {**os.environ, "RAY_ADDRESS": cluster.address}
result = subprocess.run([sys.executable, sys.argv[1], *sys.argv[2:]], env=env, capture_output=True, text=True)
print(result.stdout)
print(result.stderr[-3000:], file=sys.stderr)
ray.shutdown()
cluster.shutdown()
sys.exit(result.returncode)
"""


def test_a_worker_group_spans_two_nodes(demo_files, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-c", MULTI_NODE, str(ROOT / "algos" / "grpo_hybrid.py"), *TINY, "--total-steps", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert [r["step"] for r in metric_rows(run_dir)] == [1, 2]
