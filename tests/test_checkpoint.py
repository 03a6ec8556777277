"""Checkpoints that prove themselves: the save writes, last, a manifest of every file with its size and sha256, and a
resume checks each file against it before any worker reads one. `--resume auto` skips a damaged checkpoint, says why,
and goes on from the one before; `--resume PATH` to a damaged one stops, naming the file."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import EVERY_STEP_SAVED, TINY, comparable, metric_rows, run_script
from safetensors.torch import load_file

from common.checkpoint import MANIFEST, checkpoint_damage, complete_checkpoints, find_checkpoint

STEPS = EVERY_STEP_SAVED
PREFIX = "grpo__grpo_hybrid__1"


def run_grpo(*flags, cwd):
    return run_script("grpo_hybrid.py", *TINY, *flags, cwd=cwd)


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_grpo):
    """The run folder of a run never interrupted, with a checkpoint after each of its 4 steps (STEPS)."""
    return uninterrupted_grpo


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def changed_in_place(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(255 - b for b in data[middle : middle + 8])
    path.write_bytes(data)


# how a file of the newest checkpoint is damaged, which file, and what the message says of it (sizes in the manifest)
DAMAGES = {
    "cut-short": (cut_short, "policy/__0_0.distcp", "{file} has {half} bytes, the manifest says {size} (cut short)"),
    "missing": (Path.unlink, "driver.pt", "{file} is missing (the manifest lists it with {size} bytes)"),
    "changed": (changed_in_place, "policy/__1_0.distcp", "{file} has sha256 {found}, the manifest says {sha256} (its bytes"),
}


def damaged_copy(run_dir: Path, folder: Path, damage: str) -> tuple[Path, str]:
    """A copy of `run_dir` into folder/runs, without its exported model, its newest checkpoint damaged; and the
    message's line about the damaged file."""
    copy = folder / "runs" / run_dir.name
    shutil.copytree(run_dir, copy, ignore=lambda where, names: ["model"] if Path(where) == run_dir else [])
    how, file, line = DAMAGES[damage]
    saved = json.loads((copy / "checkpoints" / "step_4" / MANIFEST).read_text())["files"][file]
    path = copy / "checkpoints" / "step_4" / file
    how(path)
    found = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None
    return copy, line.format(file=file, half=saved["size"] // 2, found=found, **saved)


def test_the_manifest_lists_every_file_with_its_size_and_checksum_and_is_written_last(uninterrupted):
    for checkpoint in complete_checkpoints(uninterrupted):
        manifest = checkpoint / MANIFEST
        files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file() and p != manifest)
        saved = json.loads(manifest.read_text())["files"]
        assert sorted(saved) == files and "driver.pt" in files and "policy/rng_rank0.pt" in files
        for name in files:
            data = (checkpoint / name).read_bytes()
            assert saved[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            assert (checkpoint / name).stat().st_mtime_ns <= manifest.stat().st_mtime_ns
        assert checkpoint_damage(checkpoint) == []


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_auto_skips_a_damaged_checkpoint_and_ends_as_the_uninterrupted_run(uninterrupted, tmp_path, damage):
    run_dir, line = damaged_copy(uninterrupted, tmp_path, damage)
    result = run_grpo(*STEPS, "--resume", "auto", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = run_dir.resolve() / "checkpoints"
    assert f"--resume auto: skipped {checkpoints / 'step_4'}, its files differ from its manifest: {line}" in result.stdout
    assert f"resumed from {checkpoints / 'step_3'}" in result.stdout
    assert [comparable(r) for r in metric_rows(run_dir)] == [comparable(r) for r in metric_rows(uninterrupted)]
    weights = load_file(uninterrupted / "model" / "model.safetensors")
    exported = load_file(run_dir / "model" / "model.safetensors")
    assert all(torch.equal(exported[name], weights[name]) for name in weights)
    assert checkpoint_damage(checkpoints / "step_4") == []  # saved again, whole


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_path_to_a_damaged_checkpoint_stops_naming_the_file(uninterrupted, tmp_path, damage):
    run_dir, line = damaged_copy(uninterrupted, tmp_path, damage)
    newest = run_dir / "checkpoints" / "step_4"
    with pytest.raises(ValueError) as stop:
        find_checkpoint(str(newest), str(tmp_path / "runs"), PREFIX)
    assert f"--resume {newest}: this checkpoint is damaged, its files differ from its manifest:\n  {line}" in str(stop.value)
    others = "its run's other checkpoints: step_1, step_2, step_3"
    assert f"no worker has read it. Pass an earlier checkpoint to --resume ({others}), or --resume auto" in str(stop.value)


def test_resume_path_to_a_damaged_checkpoint_stops_the_script_before_any_worker(uninterrupted, tmp_path):
    run_dir, line = damaged_copy(uninterrupted, tmp_path, "cut-short")
    rows = (run_dir / "metrics.jsonl").read_text()
    newest = run_dir / "checkpoints" / "step_4"
    result = run_grpo(*STEPS, "--resume", str(newest), cwd=tmp_path)
    assert result.returncode != 0
    assert f"this checkpoint is damaged, its files differ from its manifest:\n  {line}" in result.stderr
    assert "PolicyWorker" not in result.stderr and (run_dir / "metrics.jsonl").read_text() == rows


def test_resume_auto_stops_when_every_checkpoint_is_damaged(uninterrupted, tmp_path, capsys):
    run_dir, _ = damaged_copy(uninterrupted, tmp_path, "cut-short")
    for checkpoint in complete_checkpoints(run_dir)[:-1]:
        cut_short(checkpoint / "driver.pt")
    with pytest.raises(ValueError, match=re.escape(f"every checkpoint of {tmp_path / 'runs'}/{PREFIX}__* is damaged")):
        find_checkpoint("auto", str(tmp_path / "runs"), PREFIX)
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--resume auto: skipped")]
    assert [line.split(",")[0].rsplit("/", 1)[1] for line in skipped] == ["step_4", "step_3", "step_2", "step_1"]


def test_a_checkpoint_saved_before_manifests_is_taken_unchecked_and_says_so(uninterrupted, tmp_path, capsys):
    """A run of the older name (no random digits) whose checkpoints have no manifest: --resume auto finds it."""
    legacy = tmp_path / "runs" / f"{PREFIX}__1795678723"
    shutil.copytree(uninterrupted, legacy)
    for checkpoint in complete_checkpoints(legacy):
        (checkpoint / MANIFEST).unlink()
    newest = (legacy / "checkpoints" / "step_4").resolve()
    assert find_checkpoint("auto", str(tmp_path / "runs"), PREFIX) == newest
    said = capsys.readouterr().out
    assert f"{newest} was saved before checkpoints carried a manifest: its files are taken unchecked" in said
