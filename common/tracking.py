"""Run names, per-step metrics on disk, and wandb."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path


class Tracker:
    """Appends every step's metrics to runs/<run name>/metrics.jsonl, each row with its step and the time it was
    logged (`wall_time`, seconds since the epoch, for curves against wall time), and to wandb when given a project."""

    def __init__(
        self,
        run_prefix: str,
        config: dict,
        resume_from: Path | None = None,
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        runs_dir: str = "runs",
        script: str | None = None,
        group: str | None = None,
        tags: tuple[str, ...] = (),
    ):
        """A new run in a folder of its own (new_run_dir), or the run of checkpoint `resume_from`
        (runs/<run name>/checkpoints/step_<N>) continued. `config` goes to config.json and to wandb, whose run id is
        the folder's name.

        The `script` that runs is copied into runs/<run name>/code/ with the git commit it belongs to (code.json), as
        cleanrl saves the code with every run: a fork's curve keeps the code that made it. In wandb the run joins
        `group` (runs of one experiment) with `tags` (the algorithm), and carries the copy and the commit."""
        # Absolute: workers, on this node or others, may run in another directory.
        self.run_dir = (resume_from.parent.parent if resume_from else new_run_dir(runs_dir, run_prefix)).resolve()
        self.run_name = self.run_dir.name
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        metrics_path = self.run_dir / "metrics.jsonl"
        if resume_from and metrics_path.exists():
            # Steps after the checkpoint are about to be run again: their old rows go.
            resume_step = int(resume_from.name.removeprefix("step_"))
            rows = metrics_path.read_text().splitlines()
            metrics_path.write_text("".join(row + "\n" for row in rows if json.loads(row)["step"] <= resume_step))
        self.metrics_file = open(metrics_path, "a")
        code = save_code(script, self.run_dir / "code", resume_from) if script else None
        self.wandb = None
        if wandb_project is not None:
            import wandb

            self.wandb = wandb.init(
                project=wandb_project,
                entity=wandb_entity,
                name=self.run_name,
                group=group,
                tags=list(tags),
                config=config | ({"code": code} if code else {}),
                dir=str(self.run_dir),
                id=self.run_name,
                resume="allow",
            )
            if code:
                self.wandb.save(str(self.run_dir / "code" / code["copy"]), base_path=str(self.run_dir), policy="now")

    def log(self, metrics: dict, step: int) -> None:
        self.metrics_file.write(json.dumps({"step": step, "wall_time": time.time(), **metrics}) + "\n")
        self.metrics_file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def log_samples(self, samples: list[dict], step: int, table_rows: int = 20) -> None:
        """Every validation completion to runs/<run>/validation/step_<N>.jsonl; the first few to a wandb table. None (a
        supervised run's validation, a loss): nothing."""
        if not samples:
            return
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


def new_run_dir(runs_dir: str, run_prefix: str) -> Path:
    """A new run's folder, runs_dir/<run_prefix>__<unix time>__<6 random hex digits>, created here and owned by this run.

    The folder is made without exist_ok: mkdir is atomic, on a local disk and on a network file system alike, so of
    two runs that pick one name only one makes the folder, and the other draws another name. The random digits come
    from the operating system (os.urandom), not from the RNGs a run seeds, which two runs of one --seed share: runs
    started in the same second, on one machine or on many writing to one file system, draw different names (a repeat
    is 1 in 16.7 million, and is then drawn again)."""
    Path(runs_dir).mkdir(parents=True, exist_ok=True)
    while True:
        folder = Path(runs_dir) / f"{run_prefix}__{int(time.time())}__{secrets.token_hex(3)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def run_dirs(runs_dir: str, run_prefix: str) -> list[Path]:
    """The folders of the runs named `run_prefix` (algorithm, experiment and seed) in `runs_dir`: those new_run_dir
    names, and those named without the random digits before they had them."""
    name = re.compile(re.escape(run_prefix) + r"__\d+(__[0-9a-f]{6})?")
    return [folder for folder in Path(runs_dir).glob(f"{run_prefix}__*") if name.fullmatch(folder.name)]


def save_code(script: str, folder: Path, resume_from: Path | None) -> dict:
    """Copy `script` into `folder`, with its git commit and whether the script differs from it, into code.json; a run
    resumed with a script other than the one saved keeps both, the later one named after the step it resumed from."""
    folder.mkdir(exist_ok=True)
    name = Path(script).name
    copy = folder / name
    if copy.exists() and resume_from is not None and copy.read_bytes() != Path(script).read_bytes():
        copy = folder / f"{Path(script).stem}.from_{resume_from.name}.py"
    shutil.copyfile(script, copy)
    code = {"script": os.path.relpath(script), "copy": copy.name, **git_state(script)}
    (folder / "code.json").write_text(json.dumps(code, indent=2))
    return code


def git_state(path: str) -> dict:
    """The commit of the git checkout that holds `path`, and whether the file differs from it (None outside git)."""

    def git(*words):
        result = subprocess.run(["git", *words], cwd=os.path.dirname(os.path.abspath(path)), capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else None

    try:
        commit = git("rev-parse", "HEAD")
        changed = commit is not None and git("status", "--porcelain", "--", os.path.abspath(path)) != ""
    except OSError:  # no git on this machine
        commit, changed = None, False
    return {"commit": commit, "changed_since_commit": changed}


@contextmanager
def timer(name: str, timings: dict):
    """Add the seconds spent inside to timings['timing/<name>']."""
    start = time.perf_counter()
    yield
    timings[f"timing/{name}"] = timings.get(f"timing/{name}", 0.0) + time.perf_counter() - start
