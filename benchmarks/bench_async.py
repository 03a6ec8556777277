"""Asynchronous steps against the synchronous loop: GRPO on the real model with long-tailed response lengths.

Runs algos/grpo_hybrid.py on SmolLM2-135M-Instruct's times tables (`--model-path smollm2`, its demo settings) with a
longer answer budget, --max-response-length 96: before training the model talks around the question, often to the
budget, and after a few steps it answers in a few tokens, so a batch's lengths spread from one end to the other.
Each setting runs the same samples and optimiser steps, in fp32 (the vllm engine and the trainer, on any CPU), in
placements of 2 CPU slots:

- `colocated`: 2 policy workers, each generating with its own engine, then training (the default, synchronous);
- `split`: 1 policy worker and 1 rollout worker, synchronous (--max-staleness 0);
- `async`: the same 1 + 1, the engine generating the next batch while the policy trains (--max-staleness 1).

Prints per run the seconds per step (the mean over the steps after the first), the shares of a step the trainer
waited for samples and the engine waited for prompts or weights, and the held-out accuracy after the last step.

    python benchmarks/bench_async.py                                  # every setting, seeds 1 to 3 (about 50 minutes)
    python benchmarks/bench_async.py --settings split async --seeds 1
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "colocated": ["--num-workers", "2"],
    "split": ["--num-workers", "1", "--rollout-workers", "1", "--max-staleness", "0"],
    "async": ["--num-workers", "1", "--rollout-workers", "1", "--max-staleness", "1"],
}


def run(setting: str, seed: int, steps: int, prompts: int, response_length: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        flags = [
            *"--model-path smollm2 --rollout-engine vllm --rollout-dtype float32 --compute-dtype float32".split(),
            *f"--max-response-length {response_length} --total-steps {steps} --test-freq {steps}".split(),
            *f"--train-batch-size {prompts} --mini-batch-size {prompts} --no-val-before-train --seed {seed}".split(),
            *SETTINGS[setting],
        ]
        result = subprocess.run(
            [sys.executable, str(ROOT / "algos" / "grpo_hybrid.py"), *flags], cwd=folder, capture_output=True, text=True
        )
        if result.returncode:
            sys.exit(f"{setting}, seed {seed} failed:\n{result.stderr[-3000:]}")
        [metrics] = Path(folder).glob("runs/*/metrics.jsonl")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()][1:]  # after the first step
    step = np.mean([row["timing/step"] for row in rows])
    return {
        "seconds per step": step,
        "trainer waited": np.mean([row.get("timing/wait_for_rollouts", row["timing/generate"]) for row in rows]) / step,
        "engine waited": np.mean([row.get("timing/rollout_idle", step - row["timing/generate"]) for row in rows]) / step,
        "response tokens": np.mean([row["response/length_mean"] for row in rows]),
        "accuracy": rows[-1]["val/accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step, 8 samples each, one optimiser step")
    parser.add_argument("--max-response-length", type=int, default=96)
    options = parser.parse_args()
    print(
        f"GRPO, SmolLM2-135M-Instruct, {options.steps} steps of {options.prompts} prompts x 8 samples, answers up to "
        f"{options.max_response_length} tokens"
    )
    print("| setting | seed | seconds per step | trainer waited | engine waited | mean response tokens | held-out accuracy |")
    print("|---|---|---|---|---|---|---|")
    for setting in options.settings:
        for seed in options.seeds:
            figures = run(setting, seed, options.steps, options.prompts, options.max_response_length)
            print(
                f"| {setting} | {seed} | {figures['seconds per step']:.1f} | {figures['trainer waited']:.0%} | "
                f"{figures['engine waited']:.0%} | {figures['response tokens']:.0f} | {figures['accuracy']:.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
