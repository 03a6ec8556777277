"""A real model learns a tool: SmolLM2-135M-Instruct's held-out accuracy on products with the multiply tool, before any
training, after a short supervised warm start, and after GRPO with the tool from there; seeds 1-3.

The task is sft_hybrid.py's built-in demo (common/demo.py, `multiply_tool`): products of a 3-digit by a 2-digit number,
which the model cannot compute in its head, and `multiply(a, b)`, which it learns to call. The scripts run as a user runs
them, each in a process of its own, and the accuracies are read from their metrics.jsonl:

1. the base model, `grpo_hybrid.py --model-path smollm2 --tools multiply --chat-template chatml_tools`: its validation
   before the first step (greedy, the same for every seed, so measured once); and without the tool (its own chat
   template, one turn: the product in its head);
2. the warm start, `sft_hybrid.py --model-path smollm2 --total-steps 2`: the demo's transcripts and defaults but two
   steps (32 transcripts), so that it teaches the call's format without saturating the task; its exported model's
   accuracy is GRPO's validation before its first step;
3. GRPO from that export, `grpo_hybrid.py --tools multiply` (LoRA, 8 prompts x 4 samples a step): its last validation.

Validation: the first --val-problems held-out problems (never in the warm start's transcripts nor GRPO's prompts),
greedy, up to 3 turns (a call, the tool's result, the answer), scored 1 when the last number of the last turn is the
product. Printed and written (--out, a markdown table and its JSON beside it): the accuracies, the wall time of each
phase (the script's whole process: start-up, validations and export included) and GRPO's mean seconds per step.

    python benchmarks/bench_tool_learning.py                      # seeds 1-3
    python benchmarks/bench_tool_learning.py --seeds 1 --grpo-steps 4
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from demo_table import machine, write_table  # noqa: E402

# GRPO's settings, which benchmarks/bench_trl_tools.py gives TRL's GRPOTrainer too.
GRPO = dict(
    prompts=8, samples=4, lora_rank=16, lora_alpha=32, lr=5e-4, kl=0.001, max_turns=3, prompt_tokens=320, response_tokens=96
)


def grpo_flags(steps: int, tool: bool = True) -> list[str]:
    settings = dict(GRPO, steps=steps)
    return [
        *(["--tools", "multiply", "--max-turns", str(GRPO["max_turns"])] if tool else []),
        *"--total-steps {steps} --test-freq {steps}".format_map(settings).split(),
        *"--train-batch-size {prompts} --mini-batch-size {prompts} --n {samples}".format_map(settings).split(),
        *"--lora-rank {lora_rank} --lora-alpha {lora_alpha} --lr {lr} --kl-loss-coef {kl}".format_map(settings).split(),
        *"--max-prompt-length {prompt_tokens} --max-response-length {response_tokens}".format_map(settings).split(),
        *"--val-batch-size 64 --micro-batch-size 16".split(),
    ]


def run_script(script: str, flags: list[str], folder: Path) -> tuple[list[dict], Path, float]:
    """`python algos/<script> <flags>` in `folder`: its metrics.jsonl's rows, its run folder and its wall time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(ROOT / "algos" / script), *flags], cwd=folder, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - started
    (folder / f"{script}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(flags)} failed (log in {folder}):\n{result.stderr[-3000:]}")
    [run_dir] = (folder / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, run_dir, seconds


def accuracies(rows: list[dict]) -> list[float]:
    return [row["val/accuracy"] for row in rows if "val/accuracy" in row]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--sft-steps", type=int, default=2, help="warm start steps (16 transcripts each)")
    parser.add_argument("--grpo-steps", type=int, default=10)
    parser.add_argument("--val-problems", type=int, default=64, help="held-out problems each validation answers")
    parser.add_argument(
        "--skip-base", action="store_true", help="leave out the base model's row (greedy: the same for every seed)"
    )
    parser.add_argument("--out", default="bench_tool_learning.md", help="the table; its JSON goes beside it (.json)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from common import demo

    cpu = machine()
    print(cpu, flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench_tool_learning_"))
    _, train_file, val_file = demo.prepare("multiply_tool")
    val_subset = work / "val.parquet"
    pq.write_table(pq.read_table(val_file).slice(0, args.val_problems), val_subset)
    data = ["--train-files", train_file, "--val-files", str(val_subset)]

    base, base_seconds, alone, alone_seconds = None, None, None, None
    if not args.skip_base:
        # One step of 2 prompts x 2 samples: the script validates before it, and that is the figure read.
        one_step = ["--train-batch-size", "2", "--mini-batch-size", "2", "--n", "2"]
        folder = work / "base"
        folder.mkdir()
        model = ["--model-path", "smollm2", "--chat-template", "chatml_tools"]
        rows, _, base_seconds = run_script("grpo_hybrid.py", [*model, *data, *grpo_flags(1), *one_step], folder)
        base = accuracies(rows)[0]
        print(f"base model with the tool: {base:.1%} ({base_seconds:.0f} s)", flush=True)
        folder = work / "base_without_the_tool"  # its own chat template, one turn: the product in its head
        folder.mkdir()
        flags = ["--model-path", "smollm2", *data, *grpo_flags(1, tool=False), *one_step]
        rows, _, alone_seconds = run_script("grpo_hybrid.py", flags, folder)
        alone = accuracies(rows)[0]
        print(f"base model without the tool: {alone:.1%} ({alone_seconds:.0f} s)", flush=True)

    results = []
    for seed in args.seeds:
        folder = work / f"sft_{seed}"
        folder.mkdir()
        sft_flags = ["--model-path", "smollm2", "--seed", str(seed), "--total-steps", str(args.sft_steps)]
        _, sft_run, sft_seconds = run_script("sft_hybrid.py", [*sft_flags, "--no-val-before-train"], folder)
        folder = work / f"grpo_{seed}"
        folder.mkdir()
        grpo = ["--model-path", str(sft_run / "model"), "--seed", str(seed), *data, *grpo_flags(args.grpo_steps)]
        rows, _, grpo_seconds = run_script("grpo_hybrid.py", grpo, folder)
        first, *_, last = accuracies(rows)
        steps = [row["timing/step"] for row in rows if "timing/step" in row]
        step_seconds = sum(steps[1:]) / len(steps[1:])  # the first step is left out of the mean
        results.append(
            dict(
                seed=seed,
                warm_start=first,
                grpo=last,
                sft_seconds=sft_seconds,
                grpo_seconds=grpo_seconds,
                grpo_step_seconds=step_seconds,
                export=str(sft_run / "model"),
            )
        )
        print(f"seed {seed}: warm start {first:.1%}, GRPO {last:.1%} ({sft_seconds:.0f} s + {grpo_seconds:.0f} s)", flush=True)

    problems = f"{args.val_problems} held-out problems, greedy"
    base_text = "left out" if base is None else f"{base:.1%}"
    base_run = "left out" if base is None else f"{base_seconds:.0f} s for its whole run"
    alone_run = "left out" if alone is None else f"{alone:.1%}, {alone_seconds:.0f} s for its whole run"
    lines = [
        f"{cpu}; base model: `grpo_hybrid.py`'s validation before its first step ({base_run}); without the tool "
        f"({alone_run})",
        "",
        f"| seed | base model ({problems}) | after the warm start ({args.sft_steps} steps) "
        f"| after GRPO ({args.grpo_steps} steps) | warm start's wall time | GRPO's wall time | GRPO's seconds per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        lines.append(
            f"| {result['seed']} | {base_text} | {result['warm_start']:.1%} | {result['grpo']:.1%} "
            f"| {result['sft_seconds']:.0f} s | {result['grpo_seconds']:.0f} s | {result['grpo_step_seconds']:.1f} |"
        )
    without = dict(base_without_the_tool=alone, base_without_the_tool_seconds=alone_seconds)
    settings = vars(args) | {"grpo": GRPO}
    summary = dict(cpu=cpu, settings=settings, base=base, base_seconds=base_seconds, **without, seeds=results)
    write_table(lines, args.out, summary)
    print(f"the runs: {work}")
