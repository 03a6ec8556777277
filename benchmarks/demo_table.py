"""The README's demo tables, as a new user gets them: each algorithm's built-in demo on each seed, from a fresh cache.

Builds the demo's cache (the tiny model, its warm start and the task files) in a new folder, then runs
`python algos/<algo>_hybrid.py --seed <seed>` for every algorithm and seed, one after another, each in a
folder of its own, and prints a markdown table: held-out accuracy before training and at the last
validation, and the run's wall time (start to exit, Ray's start included). With `--model-path smollm2`, the
real model's demo (the times tables): the model is converted into the fresh cache first, timed on its own.

    python benchmarks/demo_table.py
    python benchmarks/demo_table.py --algos grpo gspo --seeds 1 --extra-flags --rollout-engine vllm
    python benchmarks/demo_table.py --model-path smollm2 --algos grpo rloo

benchmarks/demo_spread.py runs the same demos from other warm starts, as another CPU would give them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plot_runs import plot, require_matplotlib

ROOT = Path(__file__).resolve().parents[1]
ALGOS = sorted(path.stem.removesuffix("_hybrid") for path in (ROOT / "algos").glob("*_hybrid.py"))  # every script


def machine() -> str:
    """The CPU's model name, its cores, and whether it computes bf16 natively (what --compute-dtype auto follows)."""
    import platform

    import torch

    name = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        name = names[0] if names else name
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return f"{name}, {os.cpu_count()} cores, native bf16: {'yes' if bf16 else 'no'}, torch {torch.__version__}"


def stamp() -> tuple[str, str, str]:
    """What a figure's caption names: the machine (printed, as a run starts), the commit and today's date (UTC)."""
    import datetime

    cpu = machine()
    print(cpu, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return cpu, commit, datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def write_table(lines: list[str], out: str, summary: dict) -> None:
    """Print a benchmark's markdown table (`lines`) and write it to `out`, and `summary` as JSON beside it."""
    table = "\n".join(lines)
    print("\n" + table)
    Path(out).write_text(table + "\n")
    Path(out).with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"written: {out} and {Path(out).with_suffix('.json')}")


def run_demo(algo: str, seed: int, extra_flags: list[str], env: dict) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"{algo}_{seed}_"))
    command = [sys.executable, str(ROOT / "algos" / f"{algo}_hybrid.py"), "--seed", str(seed), *extra_flags]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed in {folder}:\n{result.stderr[-3000:]}")
    [run_dir] = (folder / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [row["val/accuracy"] for row in rows if "val/accuracy" in row]
    return dict(before=validations[0], after=validations[-1], wall=wall, steps=rows[-1]["step"], run_dir=run_dir)


def table_cells(result: dict) -> str:
    """A run's markdown cells: held-out accuracy before, after, and its wall time with its steps."""
    return f"{result['before']:.0%} | {result['after']:.0%} | {result['wall']:.0f} s ({result['steps']} steps)"


def fresh_cache(model_seed: int | None = None) -> dict:
    """A new $HYBRIDRL_CACHE with the demo built in it (from `model_seed`'s initialisation, if given): the
    environment to run the scripts in."""
    cache = tempfile.mkdtemp(prefix="hybridrl_cache_")
    env = {**os.environ, "HYBRIDRL_CACHE": cache}
    started = time.perf_counter()
    seed = "" if model_seed is None else f"model_seed={model_seed}"
    subprocess.run([sys.executable, "-c", f"from common import demo; demo.prepare({seed})"], cwd=ROOT, env=env, check=True)
    print(f"fresh demo cache {cache} built in {time.perf_counter() - started:.0f} s", flush=True)
    return env


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS, help="algorithms to run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds to run each algorithm with")
    parser.add_argument("--model-path", help="a packaged real model (smollm2) for its demo, instead of the tiny one")
    parser.add_argument("--plot", type=Path, default=Path("demo_table.png"), help="the picture of the runs to write")
    parser.add_argument("--extra-flags", nargs=argparse.REMAINDER, default=[], help="flags added to every run (last)")
    args = parser.parse_args()
    require_matplotlib()

    print(machine(), flush=True)
    env = fresh_cache()
    if args.model_path:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "common.pretrained", args.model_path], cwd=ROOT, env=env, check=True)
        print(f"{args.model_path} converted into it in {time.perf_counter() - started:.0f} s", flush=True)
        args.extra_flags = ["--model-path", args.model_path, *args.extra_flags]

    print("| algorithm | seed | held-out accuracy before | after | wall time |")
    print("|---|---|---|---|---|")
    results = []
    for algo in args.algos:
        for seed in args.seeds:
            result = run_demo(algo, seed, args.extra_flags, env)
            results.append(result)
            print(f"| {algo} | {seed} | {table_cells(result)} |", flush=True)
    print(f"lowest final accuracy: {min(result['after'] for result in results):.0%}")
    plot([result["run_dir"] for result in results], args.plot, machine())
