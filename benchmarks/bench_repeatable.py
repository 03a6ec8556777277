"""Multi-turn runs that repeat: two GRPO runs of one seed on the real model with a tool whose answers take 0-2 s drawn
anew at every call, with --deterministic and without, on each engine: which steps of the two runs are equal (every
metric but the timings, and at the end the exported weights), and the seconds per step of each.

The policy: SmolLM2-135M-Instruct after the demo's warm start with the multiply tool (benchmarks/bench_episodes.py's,
built once into the cache), so that its episodes call the tool. The runs: `grpo_hybrid.py` as a user runs it, each in a
process of its own, with benchmarks/bench_tool_learning.py's GRPO settings (LoRA, 8 prompts x 4 samples a step, up to 3
model turns) and `--tools benchmarks/episode_tools_at_random.py:multiply` (the built-in multiply answering after 0-2 s
drawn from the machine's entropy: the two runs wait differently), on 2 CPU workers in bf16, validating at the last step
only (on 16 held-out problems, which a run always does at its end). Printed and written (--out, a markdown table and its
JSON beside it, which keeps every step's row).

    python benchmarks/bench_repeatable.py                       # hf and vllm, 3 steps
    python benchmarks/bench_repeatable.py --engines hf --steps 2
"""

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_episodes import warm_started_policy  # noqa: E402
from bench_tool_learning import grpo_flags, run_script  # noqa: E402
from demo_table import stamp, write_table  # noqa: E402

TOOL = f"{ROOT / 'benchmarks' / 'episode_tools_at_random.py'}:multiply"


def compared(row: dict) -> dict:
    """A step's metrics but those of time (the engines' idle share is the environments' timing too)."""
    timed = ("timing/", "perf/", "val/")
    return {k: v for k, v in row.items() if not k.startswith(timed) and k not in ("wall_time", "env/engine_idle_share")}


def same_weights(first: Path, second: Path) -> bool:
    from safetensors.torch import load_file

    a, b = (load_file(run_dir / "model" / "model.safetensors") for run_dir in (first, second))
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench_repeatable.md", help="the table; its JSON goes beside it (.json)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from common import demo

    cpu, commit, date = stamp()
    model_path = warm_started_policy()
    _, train_file, val_file = demo.prepare("multiply_tool")
    work = Path(tempfile.mkdtemp(prefix="bench_repeatable_"))
    pq.write_table(pq.read_table(val_file).slice(0, 16), work / "val16.parquet")
    flags = [*grpo_flags(args.steps), "--model-path", model_path, "--train-files", train_file, "--tools", TOOL]
    flags += ["--val-files", str(work / "val16.parquet"), "--chat-template", "chatml_tools", "--compute-dtype", "bfloat16"]
    flags += ["--no-val-before-train", "--seed", str(args.seed)]
    results = []
    for engine in args.engines:
        for play in ("default", "--deterministic"):
            runs = []
            for attempt in ("a", "b"):
                folder = work / f"{engine}_{play.strip('-')}_{attempt}"
                folder.mkdir()
                extra = ["--rollout-engine", engine] + ([play] if play != "default" else [])
                rows, run_dir, _ = run_script("grpo_hybrid.py", [*flags, *extra], folder)
                runs.append((rows, run_dir))
                step_seconds = sum(r["timing/step"] for r in rows) / len(rows)
                print(f"{engine}, {play}, run {attempt}: {step_seconds:.1f} s per step", flush=True)
            (first, first_dir), (second, second_dir) = runs
            equal = [compared(a) == compared(b) for a, b in zip(first, second)]
            seconds = [r["timing/step"] for rows, _ in runs for r in rows]
            results.append(
                dict(
                    engine=engine,
                    play=play,
                    equal_steps=sum(equal),
                    first_difference=None if all(equal) else equal.index(False) + 1,
                    same_weights=same_weights(first_dir, second_dir),
                    seconds_per_step=sum(seconds) / len(seconds),
                    seconds_range=(min(seconds), max(seconds)),
                    rows=[first, second],
                )
            )

    command = shlex.join(["python", "benchmarks/bench_repeatable.py", *sys.argv[1:]])
    lines = [
        f"`{command}` at {commit}, {date}; {cpu}; GRPO on the warm-started SmolLM2-135M-Instruct, {args.steps} steps "
        "of 8 prompts x 4 episodes, a tool answering after 0-2 s drawn anew at each call; two runs of seed "
        f"{args.seed} per row",
        "",
        "| engine | play | steps equal | weights equal | seconds per step (fastest-slowest) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        low, high = r["seconds_range"]
        lines.append(
            f"| {r['engine']} | {r['play']} | {r['equal_steps']} of {args.steps} | {'yes' if r['same_weights'] else 'no'} "
            f"| {r['seconds_per_step']:.1f} ({low:.1f}-{high:.1f}) |"
        )
    summary_json = dict(cpu=cpu, commit=commit, date=date, command=command, settings=vars(args), results=results)
    write_table(lines, args.out, summary_json)
