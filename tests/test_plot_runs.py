"""benchmarks/plot_runs.py draws runs from the files every script writes: two real runs of one experiment."""

import json
import sys
from pathlib import Path

import pytest

from helpers import SMALL_RUN, metrics_of, run_script

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plot_runs import curves, load_run, plot  # noqa: E402


def test_two_seeds_draw_as_one_experiment_with_their_spread(in_process_run, tmp_path):
    flags = [*SMALL_RUN[:-2], "--num-workers", "1", "--in-process", "--seed", "2"]  # the shared run's, but the seed
    result = run_script("grpo_hybrid.py", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    folders = [in_process_run[1], metrics_of(tmp_path)[0]]
    runs = [load_run(folder) for folder in folders]
    assert {name for name, _ in runs} == {"grpo_hybrid"}
    rewards = curves([rows for _, rows in runs], "train/reward_mean")
    assert rewards["step"] == [1, 2]
    for i, step in enumerate(rewards["step"]):
        values = [next(row["train/reward_mean"] for row in rows if row["step"] == step) for _, rows in runs]
        assert rewards["mean"][i] == pytest.approx(sum(values) / 2)
        assert (rewards["low"][i], rewards["high"][i]) == (min(values), max(values))
        assert rewards["elapsed"][i] > 0  # after the first validation, the run's first row
    assert curves([rows for _, rows in runs], "val/accuracy")["step"] == [0, 1, 2]

    plot(folders, tmp_path / "runs.png", "two seeds")
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_logged_before_wall_time_is_named(demo_files, tmp_path):
    old = tmp_path / "old_run"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"exp_name": "grpo_hybrid"}))
    (old / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/accuracy": 0.5}) + "\n")
    with pytest.raises(ValueError, match="old_run/metrics.jsonl has no wall_time in its rows"):
        load_run(old)


def test_two_algorithms_of_one_experiment_draw_as_two_lines(tmp_path):
    folders = []
    for algo, reward in (("grpo", 0.5), ("my_algo", 0.7)):
        folder = tmp_path / f"{algo}__compare__1__1767225600__abcdef"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"exp_name": "compare"}))
        rows = [{"step": step, "wall_time": 100.0 + step, "train/reward_mean": reward} for step in (1, 2)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        folders.append(folder)
    assert [load_run(folder)[0] for folder in folders] == ["grpo compare", "my_algo compare"]
    default = tmp_path / "grpo__grpo_hybrid__1__1767225600__abcdef"
    default.mkdir()
    (default / "config.json").write_text(json.dumps({"exp_name": "grpo_hybrid"}))
    (default / "metrics.jsonl").write_text(json.dumps({"step": 1, "wall_time": 1.0}) + "\n")
    assert load_run(default)[0] == "grpo_hybrid"  # the script's own name says the algorithm already
