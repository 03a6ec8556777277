"""Run names, per-step metrics on disk, and wandb."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path


class Tracker:
    """Appends every step's metrics to runs/<run name>/metrics.jsonl, and to wandb when given a project."""

    def __init__(
        self,
        run_prefix: str,
        config: dict,
        resume_from: Path | None = None,
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        runs_dir: str = "runs",
    ):
        """A new run, runs/<run_prefix>__<unix time>, or the run of checkpoint `resume_from`
        (runs/<run name>/checkpoints/step_<N>) continued. `config` goes to config.json and to wandb."""
        new_run = Path(runs_dir) / f"{run_prefix}__{int(time.time())}"
        # Absolute: workers, on this node or others, may run in another directory.
        self.run_dir = (resume_from.parent.parent if resume_from else new_run).resolve()
        self.run_name = self.run_dir.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        metrics_path = self.run_dir / "metrics.jsonl"
        if resume_from and metrics_path.exists():
            # Steps after the checkpoint are about to be run again: their old rows go.
            resume_step = int(resume_from.name.removeprefix("step_"))
            rows = metrics_path.read_text().splitlines()
            metrics_path.write_text("".join(row + "\n" for row in rows if json.loads(row)["step"] <= resume_step))
        self.metrics_file = open(metrics_path, "a")
        self.wandb = None
        if wandb_project is not None:
            import wandb

            self.wandb = wandb.init(
                project=wandb_project,
                entity=wandb_entity,
                name=self.run_name,
                config=config,
                dir=str(self.run_dir),
                id=self.run_name,
                resume="allow",
            )

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

            shown = samples[:table_rows]
            columns = list(dict.fromkeys(column for sample in shown for column in sample))  # the reward's keys too
            table = wandb.Table(columns=columns, data=[[str(s.get(c, "")) for c in columns] for s in shown])
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
