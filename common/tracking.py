"""Run names, per-step metrics on disk, and wandb."""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import contextmanager
from pathlib import Path


class Tracker:
    """Appends every step's metrics to runs/<run name>/metrics.jsonl, and to wandb with `track`."""

    def __init__(self, algo: str, args, runs_dir: str = "runs", resume_from: Path | None = None):
        """A new run, or the run of checkpoint `resume_from` (runs/<run>/checkpoints/step_<N>) continued."""
        # Absolute: workers, on this node or others, may run in another directory.
        self.run_dir = (resume_from.parent.parent if resume_from else Path(runs_dir) / f"{algo}__{args.exp_name}__{args.seed}__{int(time.time())}").resolve()
        self.run_name = self.run_dir.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = dataclasses.asdict(args)
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        metrics_path = self.run_dir / "metrics.jsonl"
        if resume_from and metrics_path.exists():
            # Steps after the checkpoint are about to be run again: their old rows go.
            resume_step = int(resume_from.name.removeprefix("step_"))
            rows = metrics_path.read_text().splitlines()
            metrics_path.write_text("".join(row + "\n" for row in rows if json.loads(row)["step"] <= resume_step))
        self.metrics_file = open(metrics_path, "a")
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project_name, entity=args.wandb_entity, name=self.run_name, config=config,
                dir=str(self.run_dir), id=self.run_name, resume="allow",
            )  # fmt: skip

    def log(self, metrics: dict, step: int) -> None:
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def log_samples(self, samples: list[dict], step: int, table_rows: int = 20) -> None:
        """Every validation completion to runs/<run>/validation/step_<N>.jsonl; the first few to a wandb table."""
        folder = self.run_dir / "validation"
        folder.mkdir(exist_ok=True)
        with open(folder / f"step_{step}.jsonl", "w") as f:
            for sample in samples:
                f.write(json.dumps(sample, default=str) + "\n")
        if self.wandb is not None:
            import wandb

            columns = list(samples[0])
            table = wandb.Table(columns=columns, data=[[str(s[c]) for c in columns] for s in samples[:table_rows]])
            self.wandb.log({"val/samples": table}, step=step)

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
