"""What a run records to compare forks: the script that ran, its commit, and in wandb (offline) group and tag; and a
folder of its own, whoever else starts a run at the same time."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import TINY, metric_rows

from common.tracking import Tracker, new_run_dir, run_dirs

ROOT = Path(__file__).resolve().parents[1]


def git(folder, *words):
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *words]
    return subprocess.run(command, cwd=folder, check=True, capture_output=True, text=True).stdout.strip()


def test_a_run_keeps_its_script_and_commit_and_wandb_groups_it_by_experiment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # A fork of grpo_hybrid.py in a checkout of its own, changed since its last commit.
    (tmp_path / "fork").mkdir()
    fork = tmp_path / "fork" / "my_algo_hybrid.py"
    fork.write_text((ROOT / "algos" / "grpo_hybrid.py").read_text())
    git(tmp_path / "fork", "init", "-q")
    git(tmp_path / "fork", "add", ".")
    git(tmp_path / "fork", "commit", "-q", "-m", "fork")
    commit = git(tmp_path / "fork", "rev-parse", "HEAD")
    fork.write_text(fork.read_text() + "# a change\n")

    provenance = dict(script=str(fork), group="exp", tags=("my_algo",))
    tracker = Tracker("my_algo__exp__1", {"lr": 1.0}, wandb_project="hybridrl", **provenance)
    try:
        tracker.log({"train/reward_mean": 0.5}, step=1)
        copy = tracker.run_dir / "code" / "my_algo_hybrid.py"
        assert copy.read_text() == fork.read_text()
        code = json.loads((tracker.run_dir / "code" / "code.json").read_text())
        assert code == {"script": "fork/my_algo_hybrid.py", "copy": copy.name, "commit": commit, "changed_since_commit": True}
        assert tracker.wandb.group == "exp" and list(tracker.wandb.tags) == ["my_algo"]
        assert tracker.wandb.id == tracker.run_name == tracker.run_dir.name
        assert tracker.wandb.config["code"] == code and tracker.wandb.config["lr"] == 1.0
        [offline] = (tracker.run_dir / "wandb").glob("offline-run-*")
        assert (offline / "files" / "code" / copy.name).read_text() == fork.read_text()  # the code travels with the run
    finally:
        tracker.close()

    # Resumed with another script: both are kept, the later one named after the checkpoint it resumed from.
    checkpoint = tracker.run_dir / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    fork.write_text(fork.read_text() + "# another change\n")
    resumed = Tracker("my_algo__exp__1", {"lr": 1.0}, resume_from=checkpoint, script=str(fork))
    resumed.close()
    assert (resumed.run_dir / "code" / "my_algo_hybrid.from_step_2.py").read_text() == fork.read_text()
    assert (resumed.run_dir / "code" / "my_algo_hybrid.py").read_text() == copy.read_text()

    # Outside a git checkout there is no commit to name; the copy is then the only record.
    loose = tmp_path / "loose_hybrid.py"
    loose.write_text("print('loose')\n")
    outside = Tracker("loose__exp__1", {}, script=str(loose))
    outside.close()
    assert json.loads((outside.run_dir / "code" / "code.json").read_text())["commit"] is None


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    # three made within a second (a mkdir takes microseconds) fall in at most two seconds: two of them share one
    folders = [new_run_dir(str(tmp_path), "grpo__x__1") for _ in range(3)]
    seconds = [folder.name.split("__")[3] for folder in folders]
    assert len(set(folders)) == 3 and len(set(seconds)) < 3
    assert all(folder.is_dir() and not any(folder.iterdir()) for folder in folders)
    # --resume auto's search: these and a run named before the random digits, not another seed's or experiment's
    others = ["grpo__x__1__1795678723", "grpo__x__10__1795678723__0a1b2c", "grpo__x__1__5__1795678723__0a1b2c"]
    for name in others:
        (tmp_path / name).mkdir()
    assert sorted(run_dirs(str(tmp_path), "grpo__x__1")) == sorted([*folders, tmp_path / others[0]])


def test_two_scripts_started_together_write_two_runs(ray_cluster, demo_files, tmp_path):
    """A sweep's two runs of one script and seed, started at once in one folder: each writes its own config, metrics
    and checkpoints."""
    rates = ["1e-6", "2e-6"]
    script = [sys.executable, str(ROOT / "algos" / "grpo_hybrid.py"), *TINY, "--total-steps", "2"]
    started = [
        subprocess.Popen([*script, "--lr", lr], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for lr in rates
    ]
    for process in started:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert sorted(json.loads((run / "config.json").read_text())["lr"] for run in runs) == [1e-6, 2e-6]
    for run in runs:
        assert [row["step"] for row in metric_rows(run)] == [1, 2]
        assert [c.name for c in (run / "checkpoints").iterdir()] == ["step_2"]
