"""The demos from other starting points: what another CPU gives a user, measured on this one.

The same seeded warm start computes other floats on another CPU, hence another model to start RL from. This
script makes such starts here: the tiny model initialised from another seed (`demo.prepare(model_seed=...)`), warm
started as usual, each start in a fresh cache of its own. Then every algorithm's demo runs from each start on each
seed, as `demo_table.py` runs them, and it prints a markdown table, each algorithm's worst case, and a picture of all
runs (mean and spread of each algorithm over starts and seeds). Start 0 is the demo's own model.

    python benchmarks/demo_spread.py --starts 0 1 2 3 4 --algos grpo
    python benchmarks/demo_spread.py --starts 0 1 --algos dapo ppo rloo reinforcepp gspo
"""

import argparse
from collections import defaultdict
from pathlib import Path

from demo_table import ALGOS, fresh_cache, machine, run_demo, table_cells
from plot_runs import plot, require_matplotlib

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="the tiny model's init seeds")
    parser.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS, help="algorithms to run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds to run each algorithm with")
    parser.add_argument("--plot", type=Path, default=Path("demo_spread.png"), help="the picture of the runs to write")
    parser.add_argument("--extra-flags", nargs=argparse.REMAINDER, default=[], help="flags added to every run (last)")
    args = parser.parse_args()
    require_matplotlib()

    print(machine(), flush=True)
    environments = {start: fresh_cache(start) for start in args.starts}
    print("| algorithm | start | seed | held-out accuracy before | after | wall time |")
    print("|---|---|---|---|---|---|")
    results = defaultdict(list)
    for algo in args.algos:
        for start in args.starts:
            for seed in args.seeds:
                result = run_demo(algo, seed, args.extra_flags, environments[start])
                results[algo].append(result)
                print(f"| {algo} | {start} | {seed} | {table_cells(result)} |", flush=True)
    print("\n| algorithm | runs | before | after | smallest lift | longest run |")
    print("|---|---|---|---|---|---|")
    for algo, runs in results.items():
        before, after = [run["before"] for run in runs], [run["after"] for run in runs]
        lift = min(run["after"] - run["before"] for run in runs)
        print(
            f"| {algo} | {len(runs)} | {min(before):.0%}-{max(before):.0%} | {min(after):.0%}-{max(after):.0%} | "
            f"{lift * 100:+.0f} points | {max(run['wall'] for run in runs):.0f} s |"
        )
    runs = [run["run_dir"] for algo_runs in results.values() for run in algo_runs]
    plot(runs, args.plot, f"{len(args.starts)} starts x {len(args.seeds)} seeds; {machine()}")
