"""Checkpoints that survive crashes and resume exactly.

A checkpoint is `runs/<run name>/checkpoints/step_<N>/`: one folder per worker
group (sharded weights, optimiser, schedule and RNG of every rank), the
driver's state (step, data-loader position, RNG, anything the script adds) and
the run's config. It is written under a scratch name and renamed when whole,
so a crash mid-save leaves the previous checkpoint as it was and never a half
one that looks complete.

Its last file, `manifest.json`, lists every other file with its size and
sha256. A resume checks the files against it before any worker loads one, so
that a file cut short, missing or changed after the save (a disk error, a copy
or sync that stopped) is named, and `--resume auto` goes back to the checkpoint
before it. A checkpoint saved before checkpoints carried a manifest is taken
unchecked, with a line that says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


MANIFEST = "manifest.json"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints whose save finished, oldest first: those with a manifest, or saved before checkpoints had
    one, with driver.pt. Whether their files are still whole is checkpoint_damage's to say."""
    found = [
        p
        for p in (Path(run_dir) / "checkpoints").glob("step_*")
        if re.fullmatch(r"step_\d+", p.name) and ((p / MANIFEST).exists() or (p / "driver.pt").exists())
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_of_each(paths: list[Path]) -> list[str]:
    # hashlib lets go of the GIL while it hashes: one thread per core reads and hashes the shards side by side
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(sha256_of, paths))


def write_manifest(folder: Path) -> None:
    """Every file under checkpoint `folder`, with its size and sha256, into folder/manifest.json: after the files, and
    whole or not at all (written under a scratch name, then renamed)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)  # none yet, during a save
    digests = sha256_of_each(files)
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": d} for p, d in zip(files, digests)}
    scratch = folder / f".{MANIFEST}.partial"
    scratch.write_text(json.dumps({"files": entries}, indent=1))
    os.replace(scratch, folder / MANIFEST)


def checkpoint_damage(checkpoint: Path) -> list[str] | None:
    """What differs between the files of `checkpoint` and its manifest, one line per file cut short, missing or changed
    ([] when every file checks out); None for a checkpoint saved without a manifest."""
    if not (checkpoint / MANIFEST).exists():
        return None
    try:
        files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return [f"{MANIFEST} cannot be read as a manifest (it changed after the save)"]
    damage = []
    for name, saved in files.items():
        path = checkpoint / name
        if not path.is_file():
            damage.append(f"{name} is missing (the manifest lists it with {saved['size']} bytes)")
        elif path.stat().st_size != saved["size"]:
            how = "cut short" if path.stat().st_size < saved["size"] else "grown"
            damage.append(f"{name} has {path.stat().st_size} bytes, the manifest says {saved['size']} ({how})")
    if damage:  # the sizes already say it: no need to read every file
        return damage
    found = sha256_of_each([checkpoint / name for name in files])
    return [
        f"{name} has sha256 {digest}, the manifest says {saved['sha256']} (its bytes changed after the save)"
        for (name, saved), digest in zip(files.items(), found)
        if digest != saved["sha256"]
    ]


class CheckpointNotWritten(RuntimeError):
    """A checkpoint's write failed (a full disk...); its scratch folder is removed, the previous checkpoint stays the last."""

    def __init__(self, step: int, free_bytes: int, folder: Path, reason: str):
        self.step = step
        # the free space says whether the disk filled up: the writer's own error may not (torch.save's zip writer)
        free = f"{free_bytes / 1e6:.1f} MB free on the disk of {folder}"
        super().__init__(f"the checkpoint of step {step} could not be written ({free}): {reason}")


def save_checkpoint(run_dir: Path, step: int, groups: dict, driver_state: dict, keep_last: int) -> Path:
    from common.worker_group import WorkerDied, WorkerStopped

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
        torch.save({"step": step, "rng": rng, **driver_state}, scratch / "driver.pt")
        write_manifest(scratch)  # last: a checkpoint with its manifest is whole
    except Exception as error:
        free_bytes = shutil.disk_usage(final.parent).free
        shutil.rmtree(scratch, ignore_errors=True)  # the space a full disk needs to take the next one
        if isinstance(error, (WorkerDied, WorkerStopped)):  # the worker's fault, not the disk's
            raise
        # a worker's error comes wrapped in Ray's, whose text is the worker's traceback: its last line says what
        raise CheckpointNotWritten(step, free_bytes, final.parent, str(error).strip().splitlines()[-1]) from error
    if final.exists():
        shutil.rmtree(final)
    os.rename(scratch, final)
    for old in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)
    return final


def saved_checkpoints(runs_dir: str, run_prefix: str) -> list[Path]:
    """The checkpoints whose save finished, of every run named `run_prefix` (algorithm, experiment and seed), newest
    first: by the time of their last file, since runs of one prefix may interleave."""
    from common.tracking import run_dirs

    found = [c.resolve() for run in run_dirs(runs_dir, run_prefix) for c in complete_checkpoints(run)]
    return sorted(found, key=lambda c: (c / (MANIFEST if (c / MANIFEST).exists() else "driver.pt")).stat().st_mtime)[::-1]


def find_checkpoint(resume: str | None, runs_dir: str, run_prefix: str) -> Path | None:
    """The checkpoint to resume, its files checked against its manifest before any worker reads them.

    `auto`: the newest checkpoint of any run named `run_prefix` that checks out, saying which newer ones it skipped and
    why (None if there is none); stops if every one is damaged. A path: that checkpoint, or a stop that names its
    damaged files and what to do. A checkpoint saved without a manifest is taken unchecked, with a line that says so."""
    if resume is None:
        return None
    if resume == "auto":
        candidates = saved_checkpoints(runs_dir, run_prefix)
        for checkpoint in candidates:
            damage = checkpoint_damage(checkpoint)
            if not damage:
                break
            print(f"--resume auto: skipped {checkpoint}, its files differ from its manifest: {'; '.join(damage)}")
        else:
            if candidates:
                raise ValueError(
                    f"--resume auto: every checkpoint of {runs_dir}/{run_prefix}__* is damaged (above, each with the file "
                    "that differs from its manifest); copy them again from where they were saved, or leave out --resume to "
                    "start a new run from step 1"
                )
            return None
    else:
        checkpoint = Path(resume).resolve()
        if not ((checkpoint / MANIFEST).exists() or (checkpoint / "driver.pt").exists()):
            raise ValueError(
                f"--resume {resume}: not a complete checkpoint (no {MANIFEST} nor driver.pt); pass a checkpoints/step_<N> "
                "folder or 'auto'"
            )
        damage = checkpoint_damage(checkpoint)
        if damage:
            names = [c.name for c in complete_checkpoints(checkpoint.parent.parent) if c.name != checkpoint.name]
            others = f"its run's other checkpoints: {', '.join(names)}" if names else "its run has no other"
            raise ValueError(
                f"--resume {resume}: this checkpoint is damaged, its files differ from its manifest:\n  "
                + "\n  ".join(damage)
                + f"\nno worker has read it. Pass an earlier checkpoint to --resume ({others}), or --resume auto, which "
                "takes the newest one that checks out; or copy this one again from where it was saved"
            )
    if damage is None:
        print(f"{checkpoint} was saved before checkpoints carried a manifest: its files are taken unchecked")
    return checkpoint


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
        self.requested, self.holding, self.held = False, False, False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    @contextlib.contextmanager
    def deferred(self):
        """A second signal within waits for its end: what is written within is written whole (a checkpoint and its
        step's metrics, which a resumed run must find together)."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.held:
            raise KeyboardInterrupt

    def _request(self, signum, frame):
        if self.requested and self.holding:  # a second signal while a checkpoint and its log are written: just after
            self.held = True
            return
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        name = signal.Signals(signum).name
        print(f"\n{name}: saving a checkpoint after this step, then stopping (send it again to stop at once)", flush=True)
