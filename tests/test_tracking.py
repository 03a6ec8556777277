"""What a run records to compare forks: the script that ran, its commit, and in wandb (offline) group and tag."""

import json
import subprocess
from pathlib import Path

from common.tracking import Tracker

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
