"""Checkpoints that survive crashes and resume exactly.

A checkpoint is `runs/<run name>/checkpoints/step_<N>/`: one folder per worker
group (sharded weights, optimiser, schedule and RNG of every rank), the
driver's state (step, data-loader position, RNG, anything the script adds) and
the run's config. It is written under a scratch name and renamed when whole,
so a crash mid-save leaves the previous checkpoint as it was and never a half
one that looks complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's whole checkpoints, oldest first."""
    found = [
        p
        for p in (Path(run_dir) / "checkpoints").glob("step_*")
        if re.fullmatch(r"step_\d+", p.name) and (p / "driver.pt").exists()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


class CheckpointNotWritten(RuntimeError):
    """A checkpoint's write failed (a full disk...); its scratch folder is removed, the previous checkpoint stays the last."""

    def __init__(self, step: int, free_bytes: int, folder: Path, reason: str):
        self.step = step
        # the free space says whether the disk filled up: the writer's own error may not (torch.save's zip writer)
        free = f"{free_bytes / 1e6:.1f} MB free on the disk of {folder}"
        super().__init__(f"the checkpoint of step {step} could not be written ({free}): {reason}")


def save_checkpoint(run_dir: Path, step: int, groups: dict, driver_state: dict, keep_last: int) -> Path:
    from common.worker_group import WorkerDied

    final = Path(run_dir) / "checkpoints" / f"step_{step}"
    scratch = final.with_name(f".{final.name}.partial")
    for stale in final.parent.glob(".step_*.partial"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    try:
        scratch.mkdir(parents=True)
        for name, group in groups.items():
            group.broadcast("save", str(scratch / name))
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        shutil.copy(Path(run_dir) / "config.json", scratch / "config.json")
        torch.save({"step": step, "rng": rng, **driver_state}, scratch / "driver.pt")  # written last: marks it whole
    except Exception as error:
        free_bytes = shutil.disk_usage(final.parent).free
        shutil.rmtree(scratch, ignore_errors=True)  # the space a full disk needs to take the next one
        if isinstance(error, WorkerDied):
            raise
        # a worker's error comes wrapped in Ray's, whose text is the worker's traceback: its last line says what
        raise CheckpointNotWritten(step, free_bytes, final.parent, str(error).strip().splitlines()[-1]) from error
    if final.exists():
        shutil.rmtree(final)
    os.rename(scratch, final)
    for old in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)
    return final


def find_checkpoint(resume: str | None, runs_dir: str, run_prefix: str) -> Path | None:
    """`auto`: the newest whole checkpoint of any run named `run_prefix__*` (None if there is none); else a path."""
    if resume is None:
        return None
    if resume == "auto":
        candidates = [c for run in Path(runs_dir).glob(f"{run_prefix}__*") for c in complete_checkpoints(run)]
        return max(candidates, key=lambda c: (c / "driver.pt").stat().st_mtime).resolve() if candidates else None
    path = Path(resume).resolve()
    if not (path / "driver.pt").exists():
        raise ValueError(
            f"--resume {resume}: not a complete checkpoint (no driver.pt); pass a checkpoints/step_<N> folder or 'auto'"
        )
    return path


def check_config(checkpoint: Path, args, force: bool) -> None:
    """Refuse to resume a checkpoint made with other settings, unless forced.

    A field of `args` whose metadata says `resumable` may differ (see common.args.flag).
    """
    saved = json.loads((checkpoint / "config.json").read_text())
    current = json.loads(json.dumps(dataclasses.asdict(args), default=str))
    resumable = {field.name for field in dataclasses.fields(args) if field.metadata.get("resumable")}
    changed = {k: (saved.get(k), v) for k, v in current.items() if k not in resumable and saved.get(k) != v}
    if changed and not force:
        details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(
            f"checkpoint {checkpoint} was made with other settings ({details}); "
            "resume with the same flags, or pass --force-resume"
        )


def load_checkpoint(checkpoint: Path, groups: dict) -> dict:
    """Restore every worker group and the driver's RNG; return the driver's state."""
    for name, group in groups.items():
        group.broadcast("load", str(checkpoint / name))
    state = torch.load(checkpoint / "driver.pt", weights_only=False)
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state


class StopRequest:
    """SIGINT or SIGTERM asks the loop to save a checkpoint and stop after the current step."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    def _request(self, signum, frame):
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        name = signal.Signals(signum).name
        print(f"\n{name}: saving a checkpoint after this step, then stopping (send it again to stop at once)", flush=True)
