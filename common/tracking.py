"""Run names, per-step metrics on disk, and wandb."""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import contextmanager
from pathlib import Path


class Tracker:
    """Appends every step's metrics to runs/<run name>/metrics.jsonl, and to wandb with `track`."""

    def __init__(self, algo: str, args, runs_dir: str = "runs"):
        self.run_name = f"{algo}__{args.exp_name}__{args.seed}__{int(time.time())}"
        self.run_dir = Path(runs_dir) / self.run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = dataclasses.asdict(args)
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project_name, entity=args.wandb_entity, name=self.run_name, config=config, dir=str(self.run_dir)
            )

    def log(self, metrics: dict, step: int) -> None:
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.finish()


@contextmanager
def timer(name: str, timings: dict):
    """Add the seconds spent inside to timings['timing/<name>']."""
    start = time.perf_counter()
    yield
    timings[f"timing/{name}"] = timings.get(f"timing/{name}", 0.0) + time.perf_counter() - start
