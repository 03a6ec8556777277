"""The algorithm scripts run for real: two steps, two workers, as a user would start them."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, SMALL_RUN, VLLM_FP32, metric_rows, metrics_of, run_script, stop_in_process

SHARED_METRICS = [
    "train/reward_mean",
    "val/accuracy",
    "val/accuracy/addition",
    "actor/pg_loss",
    "actor/entropy",
    "actor/clipfrac",
    "actor/grad_norm",
    "actor/lr",
    "response/length_mean",
    "response/clip_ratio",
    "timing/generate",
    "timing/update",
    "timing/step",
    "perf/tokens_per_s",
    "perf/peak_memory_gb",
    "perf/peak_memory_gb/policy/generate",
    "perf/peak_memory_gb/policy/update",
    "reward/errors",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
    "rollout/ratio_std",
    "rollout/ratio_max",
    "rollout_corr/weight_mean",
    "rollout_corr/weight_max",
    "rollout_corr/weight_min",
    "rollout_corr/ess",
    "rollout_corr/rejected_token_share",
    "rollout_corr/emptied_seq_share",
    "rollout_corr/kl_k1",
    "rollout_corr/kl_k3",
    "rollout_corr/ppl_trainer",
    "rollout_corr/ppl_rollout",
    "rollout_corr/log_ppl_diff",
    "rollout_corr/chi2_centered_token",
    "rollout_corr/chi2_centered_seq",
]


ALGORITHM_METRICS = {
    "grpo": ["actor/kl"],
    "ppo": [
        "actor/kl",
        "actor/kl_coef",
        "critic/loss",
        "critic/vf_clipfrac",
        "critic/values_mean",
        "critic/explained_variance",
        "perf/peak_memory_gb/critic/compute_values",
        "perf/peak_memory_gb/critic/update",
    ],
    "rloo": ["actor/kl"],
    "reinforcepp": ["actor/kl"],
    "gspo": [],
    "dapo": [
        "train/num_gen_batches",
        "train/filtered_prompt_ratio",
        "reward/overlong_penalty_mean",
        "response/overlong_ratio",
    ],
}


LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2"]


@pytest.mark.parametrize(
    "algo, flags",
    [
        ("grpo", []),
        ("grpo", LORA),
        ("ppo", ["--critic-warmup", "2", "--micro-batch-tokens", "auto"]),
        ("ppo", LORA + ["--tis"]),
        ("ppo", ["--sequence-parallel", "2"]),
        ("dapo", ["--tis", "--overlong-buffer-length", "0"]),
        # one optimiser step, no KL: no old-log-prob pass; the entropy bonus has a gradient when every group agrees
        ("rloo", ["--mini-batch-size", "8", "--kl-coef", "0", "--entropy-coef", "0.01"]),
        ("reinforcepp", ["--baseline", "--rollout-rs", "icepop,seq_mean_k3", "--rollout-rs-threshold", ",0.01"]),
        ("gspo", ["--rollout-is", "sequence"]),
        ("grpo", VLLM_FP32),
        ("ppo", VLLM_FP32 + LORA + ["--lora-sync", "merged"]),
        ("dapo", VLLM_FP32 + ["--tis"]),
    ],
    ids=[
        "grpo",
        "grpo-lora",
        "ppo-critic-warmup-auto-micro-batches",
        "ppo-lora-tis",
        "ppo-sequence-parallel",
        "dapo-tis-no-shaping",
        "rloo-one-step",
        "reinforcepp-baseline-rejection",
        "gspo-sequence-is",
        "grpo-vllm",
        "ppo-vllm-lora-merge",
        "dapo-vllm-tis",
    ],
)
def test_two_steps_with_two_workers(ray_cluster, demo_files, tmp_path, algo, flags):
    result = run_script(f"{algo}_hybrid.py", *SMALL_RUN, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics_of(tmp_path)
    assert run_dir.name.startswith(f"{algo}__{algo}_hybrid__1__")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in SHARED_METRICS + ALGORITHM_METRICS[algo]:
        assert name in rows[2], name
    assert rows[2]["actor/grad_norm"] > 0
    peaks = [value for key, value in rows[2].items() if key.startswith("perf/peak_memory_gb/")]
    assert 0 < min(peaks) and max(peaks) == rows[2]["perf/peak_memory_gb"]
    if "--overlong-buffer-length" in flags:  # 0: no overlong shaping at all
        assert rows[2]["reward/overlong_penalty_mean"] == 0 and rows[2]["response/overlong_ratio"] == 0
    if "--critic-warmup" in flags:  # the policy first updates at that step, the critic from the start
        assert "actor/pg_loss" not in rows[1] and "critic/loss" in rows[1]
    if "auto" in flags:  # each group fitted its budget (one demo sequence at least: 8 + 4 tokens), and none ran out
        for worker, group in (("PolicyWorker", "actor"), ("CriticWorker", "critic")):
            assert f"{worker}: micro-batches of at most" in result.stdout
            assert rows[2][f"{group}/micro_batch_tokens"] >= 8 + 4 and rows[2][f"{group}/memory_retries"] == 0
    # both engines compute in fp32 here, as the trainer does: log-probs differ by float rounding only, so every importance
    # weight is 1 and no criterion rejects a token
    assert rows[2]["rollout/logprob_diff_max"] < 1e-4
    for name in ("weight_mean", "weight_max", "weight_min", "ess"):
        assert rows[2][f"rollout_corr/{name}"] == pytest.approx(1.0, abs=1e-4), name
    assert rows[2]["rollout/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert rows[2]["rollout_corr/rejected_token_share"] == rows[2]["rollout_corr/emptied_seq_share"] == 0
    assert "held-out accuracy" in result.stdout
    assert json.loads((run_dir / "config.json").read_text())["lora_rank"] == (8 if "--lora-rank" in flags else 0)


@pytest.mark.parametrize("algo, flags", [("grpo", []), ("ppo", VLLM_FP32)], ids=["grpo-hf", "ppo-vllm"])
def test_multi_turn_episodes_with_the_calculator(ray_cluster, demo_files, tmp_path, algo, flags):
    result = run_script(f"{algo}_hybrid.py", *SMALL_RUN, "--env", "calculator", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "calculator task" in result.stdout
    _, rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["env/turns_mean"] > 1  # the warm start taught the model to call the tool before it answers
        assert row["env/ended_error"] == row["env/ended_timeout"] == 0
        assert row["rollout/logprob_diff_max"] < 1e-4 and "val/accuracy/multiplication" in row


def test_multi_turn_episodes_play_on_a_rollout_worker_while_the_policy_trains(ray_cluster, demo_files, tmp_path):
    flags = ["--num-workers", "1", "--rollout-workers", "1", "--max-staleness", "1", "--env", "calculator"]
    result = run_script("grpo_hybrid.py", *SMALL_RUN[:-2], *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, rows = metrics_of(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["rollout/staleness_max"] <= 1 and row["env/turns_mean"] > 1
        assert row["env/ended_error"] == row["env/ended_timeout"] == 0 and row["env/newer_turns"] >= 0
    assert rows[2]["rollout/staleness_max"] == 1  # the second step's episodes played while the policy took the first


def test_in_process_trains_as_one_ray_worker_does(ray_cluster, in_process_run, tmp_path):
    """--in-process: the worker runs inside the driver's process, so breakpoint() in a loss, a reward or a worker
    stops in the user's terminal. Two steps give the metrics that one Ray worker gives."""
    under_ray = run_script("grpo_hybrid.py", *SMALL_RUN[:-2], "--num-workers", "1", cwd=tmp_path)
    assert under_ray.returncode == 0, under_ray.stderr[-3000:]
    # A Ray actor with one CPU computes on one thread; so does the in-process run, so that sums round alike.
    in_process, in_process_dir = in_process_run
    # Ray prefixes what its actor prints (its start-up line on stdout); in process there is no actor
    assert "(PolicyWorker pid=" in under_ray.stdout + under_ray.stderr
    assert "(PolicyWorker pid=" not in in_process.stdout + in_process.stderr
    _, rows_under_ray = metrics_of(tmp_path)
    rows_in_process = metric_rows(in_process_dir)
    training = [
        {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/")) and "memory" not in k and k != "wall_time"}
        for row in rows_under_ray
    ]
    assert [r["step"] for r in rows_in_process] == [0, 1, 2]
    for expected, row in zip(training, rows_in_process):
        for key, value in expected.items():
            assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_in_process_needs_no_ray(demo_files, tmp_path):
    """--in-process imports Ray nowhere: the whole loop runs where `import ray` fails as it does without Ray installed."""
    shadow = tmp_path / "without_ray" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    without_ray = {"PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    ray_import = subprocess.run(
        [sys.executable, "-c", "import ray"], env={**os.environ, **without_ray}, capture_output=True, text=True
    )
    assert "No module named 'ray'" in ray_import.stderr  # the installed Ray is out of reach
    (tmp_path / "run").mkdir()
    result = run_script("grpo_hybrid.py", *SMALL_RUN, "--in-process", cwd=tmp_path / "run", env=without_ray)
    assert result.returncode == 0, result.stderr[-3000:]
    _, rows = metrics_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_dapo_dynamic_sampling_bound_is_a_clear_error(ray_cluster, demo_files, tmp_path):
    # near-greedy sampling makes every group unanimous, so no prompt survives the filter
    result = run_script(
        "dapo_hybrid.py", *SMALL_RUN, "--temperature", "1e-4", "--max-gen-batches", "2", "--no-val-before-train", cwd=tmp_path
    )
    assert result.returncode != 0
    assert "dynamic sampling kept 0 of 8 prompts in 2 rounds" in result.stderr
    assert "Raise --max-gen-batches" in result.stderr


def test_dapo_overlong_buffer_must_fit_in_the_limit(demo_files, tmp_path, monkeypatch):
    stop = stop_in_process("dapo_hybrid.py", "--overlong-buffer-length", "4", cwd=tmp_path, monkeypatch=monkeypatch)
    assert "--overlong-buffer-length 4 with --max-response-length 4: the buffer is the last part of the limit" in stop
    assert "PolicyWorker" not in stop  # the demo's limit is 4 tokens


def test_grpo_tracks_to_wandb_offline_with_the_rewards_own_keys(ray_cluster, demo_files, tmp_path):
    """What a reward returns beside "score" is logged per step, written to the validation files and shown in wandb."""
    (tmp_path / "keyed.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    exact = float(solution_str.strip() == ground_truth)\n"
        "    return {'score': exact, 'exact': exact, 'length': len(solution_str), 'verdict': 'ok' if exact else 'wrong'}\n"
    )
    flags = [*SMALL_RUN, "--total-steps", "1", "--track", "--reward-fn", f"{tmp_path}/keyed.py:compute_score"]
    result = run_script("grpo_hybrid.py", *flags, cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics_of(tmp_path)
    assert rows[1]["reward/exact"] == pytest.approx(rows[1]["train/reward_mean"]) and rows[1]["reward/length"] > 0
    assert rows[1]["val/reward/exact"] == pytest.approx(rows[1]["val/accuracy"])
    sample = json.loads((run_dir / "validation" / "step_1.jsonl").read_text().splitlines()[0])
    assert sample["verdict"] == ("ok" if sample["score"] else "wrong") and sample["exact"] == sample["score"]
    [offline_run] = (run_dir / "wandb").glob("offline-run-*")
    assert any(offline_run.glob("*.wandb"))
    tables = list(offline_run.glob("files/media/table/val/samples_*.table.json"))  # before training and at step 1
    assert len(tables) == 2
    for table in tables:
        assert {"exact", "length", "verdict", "score"} <= set(json.loads(table.read_text())["columns"])


def test_malformed_data_stops_before_any_worker(demo_files, tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    row = {"prompt": [{"role": "user", "content": "1+1="}], "data_source": "addition", "reward_model": {"answer": "2"}}
    bad.write_text(json.dumps(row) + "\n")
    flags = ["--model-path", demo_files[0], "--train-files", str(bad)]
    stop = stop_in_process("grpo_hybrid.py", *flags, cwd=tmp_path, monkeypatch=monkeypatch)
    assert "bad.jsonl, row 0: field 'reward_model' must be a dict with a 'ground_truth'" in stop
    assert "PolicyWorker" not in stop


def test_an_env_that_does_not_load_stops_before_any_worker(demo_files, tmp_path, monkeypatch):
    model, train, _ = demo_files
    flags = ["--model-path", model, "--train-files", train, "--env", "nowhere.py:Env"]
    stop = stop_in_process("grpo_hybrid.py", *flags, cwd=tmp_path, monkeypatch=monkeypatch)
    assert "--env 'nowhere.py:Env': no file nowhere.py" in stop
    assert "PolicyWorker" not in stop


def test_indivisible_batch_stops_before_any_worker(demo_files, tmp_path, monkeypatch):
    flags = ["--num-workers", "3", "--train-batch-size", "4", "--mini-batch-size", "4", "--n", "2"]
    stop = stop_in_process("grpo_hybrid.py", *flags, cwd=tmp_path, monkeypatch=monkeypatch)
    assert "does not split evenly over --num-workers 3" in stop
    assert "PolicyWorker" not in stop
