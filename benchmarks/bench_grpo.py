"""Where a GRPO step of the built-in demo spends its time and memory.

Runs algos/grpo_hybrid.py for a fixed number of steps on the demo configuration,
joined to a Ray instance started here, then reads the script's per-phase timings
and Ray's task timeline. Prints, per phase, seconds and share of the step; tokens
per second; the peak memory of the driver and of the workers; and the share of
the step spent outside worker compute (dispatch, serialisation, driver work).

    python benchmarks/bench_grpo.py --steps 40
    python benchmarks/bench_grpo.py --steps 20 -- --model-path Qwen/Qwen2.5-0.5B-Instruct ...
"""

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.worker_group import start_local_ray  # noqa: E402

STEP_METHODS = ("generate", "compute_log_prob", "compute_ref_log_prob", "update")


def calls_per_rank(events) -> dict[str, dict[int, list[float]]]:
    """Seconds of method execution per call, in call order, per method and rank (a worker's thread id)."""
    tasks, executions = defaultdict(list), defaultdict(list)
    for event in events:
        if event.get("cat", "").startswith("task::PolicyWorker."):
            tasks[event["tid"]].append(event)
        elif event.get("cat") == "task:execute":
            executions[event["tid"]].append(event)
    per_rank = defaultdict(lambda: defaultdict(list))
    for tid, rank_tasks in tasks.items():
        rank_tasks.sort(key=lambda e: e["ts"])
        rank_executions = sorted(executions[tid], key=lambda e: e["ts"])
        for task in rank_tasks:
            inside = [e for e in rank_executions if task["ts"] <= e["ts"] <= task["ts"] + task["dur"]]
            per_rank[task["name"]][tid].append(inside[0]["dur"] / 1e6 if inside else 0.0)
    return per_rank


def worker_compute_per_call(steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of method execution per call, the slowest rank's, in call order, per method of a step.

    Ray reports task events to its timeline about once a second, and a worker stopped at the end of the run takes its
    last report with it: wait for a call per step of every method on every rank, or until 3 s pass with no new call,
    then make do with the calls every rank has, as long as some come after the warm-up.
    """
    # ray.timeline() warns at every call that it will read from the dashboard some day
    logging.getLogger("ray._private.state").setLevel(logging.ERROR)
    counts, unchanged = [], 0
    while unchanged < 3:
        per_rank = {method: ranks for method, ranks in calls_per_rank(ray.timeline()).items() if method in STEP_METHODS}
        previous, counts = counts, [len(calls) for ranks in per_rank.values() for calls in ranks.values()]
        if counts and min(counts) >= steps:
            break
        unchanged = unchanged + 1 if counts == previous else 0
        time.sleep(1)
    if not counts or min(counts) <= warmup:
        sys.exit(f"Ray's timeline holds {min(counts, default=0)} calls of some worker method, none after the warm-up")
    if min(counts) < steps:
        print(f"Ray's timeline kept {min(counts)} of {steps} calls of some worker method; worker compute is over those")
    return {
        method: list(np.max([calls[: min(counts)] for calls in ranks.values()], axis=0)) for method, ranks in per_rank.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps to run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the figures")
    parser.add_argument("script_args", nargs="*", help="flags for grpo_hybrid.py, after --")
    options = parser.parse_args()
    if not 0 <= options.warmup < options.steps:
        parser.error(f"--warmup {options.warmup} must be at least 0 and below --steps {options.steps}")

    start_local_ray()
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    workdir = tempfile.mkdtemp()
    command = [
        sys.executable,
        str(ROOT / "algos" / "grpo_hybrid.py"),
        "--total-steps",
        str(options.steps),
        "--no-val-before-train",
        "--test-freq",
        str(10**9),
        *options.script_args,
    ]
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"grpo_hybrid.py failed:\n{result.stderr[-3000:]}")
    driver_peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20

    [run_dir] = (Path(workdir) / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if options.warmup < r["step"]]
    step_time = np.mean([r["timing/step"] for r in measured])
    phases = [k for k in measured[0] if k.startswith("timing/") and k not in ("timing/step", "timing/validate")]

    calls = worker_compute_per_call(options.steps, options.warmup)
    # each of these methods runs once a step
    worker_share = sum(np.mean(calls[m][options.warmup : options.steps]) for m in STEP_METHODS if m in calls) / step_time

    config = json.loads((run_dir / "config.json").read_text())
    print(
        f"GRPO, {options.steps - options.warmup} steps measured after {options.warmup} warm-up steps; "
        f"{config['num_workers']} workers, {config['train_batch_size']} prompts x {config['n']} samples per step"
    )
    print(f"{'phase':<16}{'seconds':>10}{'share':>9}")
    for phase in phases:
        seconds = np.mean([r[phase] for r in measured])
        print(f"{phase.removeprefix('timing/'):<16}{seconds:>10.4f}{seconds / step_time:>9.1%}")
    print(f"{'step':<16}{step_time:>10.4f}{1:>9.1%}")
    print(f"tokens per second: {np.mean([r['perf/tokens_per_s'] for r in measured]):.0f}")
    worker_peak_gb = max(r["perf/peak_memory_gb"] for r in rows)
    print(f"peak memory: driver {driver_peak_gb:.2f} GB, workers {worker_peak_gb:.2f} GB (each, the largest)")
    outside = 1 - worker_share
    print(f"worker compute: {worker_share:.1%} of the step; outside it (dispatch, serialisation, driver work): {outside:.1%}")
    ray.shutdown()


if __name__ == "__main__":
    main()
