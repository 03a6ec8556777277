"""Draw runs from their own files: held-out accuracy and training reward, against steps and against wall time.

Each run folder (runs/<run name>, as every script writes it) gives its metrics.jsonl and its config.json. Runs are
grouped by algorithm (the script's name, first in the folder's name) and experiment (--exp-name): two scripts run with
one --exp-name draw two lines. A line is the mean over the group's runs (its seeds), the band around it spans the
lowest to the highest. Wall time is the time since the run's first logged row
(its first validation), so Ray's start-up is left out; a group's runs are averaged step by step.

    pip install matplotlib
    python benchmarks/plot_runs.py runs/* --out runs.png
"""

import argparse
import importlib.util
import json
from collections import defaultdict
from pathlib import Path

PANELS = [("val/accuracy", "held-out accuracy"), ("train/reward_mean", "training reward")]


def require_matplotlib() -> None:
    """Stop at once, not after hours of runs, when the picture could not be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("drawing the runs needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")


def load_run(folder: Path) -> tuple[str, list[dict]]:
    """(the run's group, the logged rows, each with its `elapsed` seconds since the first). The group is the algorithm
    and the experiment, `algo exp_name`, or the experiment alone where it is the script's name (`grpo_hybrid`)."""
    config = json.loads((folder / "config.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    if not rows or "wall_time" not in rows[0]:
        raise ValueError(f"{folder / 'metrics.jsonl'} has no wall_time in its rows: it was written before they had one")
    for row in rows:
        row["elapsed"] = row["wall_time"] - rows[0]["wall_time"]
    algo, exp_name = folder.name.split("__")[0], config["exp_name"]
    return exp_name if exp_name == f"{algo}_hybrid" else f"{algo} {exp_name}", rows


def curves(runs: list[list[dict]], key: str) -> dict[str, list[float]]:
    """The steps every run of a group logged `key` at, with the mean elapsed time and the mean, lowest and highest value."""
    by_step = defaultdict(list)
    for rows in runs:
        for row in rows:
            if key in row:
                by_step[row["step"]].append((row["elapsed"], row[key]))
    steps = sorted(step for step, points in by_step.items() if len(points) == len(runs))
    columns = {name: [] for name in ("step", "elapsed", "mean", "low", "high")}
    for step in steps:
        elapsed, values = zip(*by_step[step])
        row = (step, sum(elapsed) / len(elapsed), sum(values) / len(values), min(values), max(values))
        for name, value in zip(columns, row):
            columns[name].append(value)
    return columns


def plot(folders: list[Path], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    groups = defaultdict(list)
    for folder in folders:
        name, rows = load_run(folder)
        groups[name].append(rows)
    figure, axes = plt.subplots(len(PANELS), 2, figsize=(12, 4 * len(PANELS)), squeeze=False)
    for name, runs in sorted(groups.items()):
        for (key, label), row_axes in zip(PANELS, axes):
            columns = curves(runs, key)
            for ax, x in zip(row_axes, ("step", "elapsed")):
                line = ax.plot(columns[x], columns["mean"], label=f"{name} (n={len(runs)})")[0]
                ax.fill_between(columns[x], columns["low"], columns["high"], color=line.get_color(), alpha=0.2)
                ax.set_xlabel("step" if x == "step" else "wall time (s)")
                ax.set_ylabel(label)
    axes[0][0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    print(f"drew {sum(len(runs) for runs in groups.values())} runs into {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="run folders (runs/<run name>)")
    parser.add_argument("--out", type=Path, default=Path("runs.png"), help="the picture to write")
    parser.add_argument("--title", default="", help="a title above the panels")
    args = parser.parse_args()
    require_matplotlib()
    plot(args.folders, args.out, args.title)
