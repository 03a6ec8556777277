"""common/run.py in this process: what a Run checks when made, before any worker, and what it says when a run stops
(runs to their end and their stops: test_scripts.py, test_long_runs.py, test_faults.py)."""

import sys
from pathlib import Path

import pytest

from common.args import RunArgs
from common.run import Run, algorithm_name, likely_cause, resume_command
from common.worker_group import WorkerDied


def test_the_resume_command_is_the_command_line_with_resume_auto(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["python", "algos/grpo_hybrid.py", "--lr", "1e-3", "--resume", "runs/x/step_2"])
    assert resume_command() == "python algos/grpo_hybrid.py --lr 1e-3 --resume auto"
    monkeypatch.setattr(sys, "orig_argv", ["python", "a.py", "--resume=auto", "--exp-name", "two words"])
    assert resume_command() == "python a.py --exp-name 'two words' --resume auto"


def test_a_dead_worker_is_explained_by_what_it_was_doing():
    assert "killed (SIGKILL" in likely_cause(WorkerDied("policy", 0, "update", out_of_memory=False))
    update = likely_cause(WorkerDied("policy", 1, "update", out_of_memory=True))
    assert (
        update == "to need less memory, lower --micro-batch-size (or --micro-batch-tokens), or pass --gradient-checkpointing"
    )
    assert "--max-response-length or --train-batch-size" in likely_cause(WorkerDied("policy", 0, "generate", True))
    assert "--log-prob-chunk-tokens" in likely_cause(WorkerDied("policy", 0, "compute_log_prob", True))


@pytest.fixture
def in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # a Run sets its own
    script = Path(__file__).resolve().parents[1] / "algos" / "grpo_hybrid.py"
    monkeypatch.setattr(sys, "argv", [str(script)])  # the script a Run takes the algorithm's name from (and copies)
    return tmp_path


def run_args(demo_files, **changes) -> RunArgs:
    model, train, val = demo_files
    settings = dict(model_path=model, train_files=[train], val_files=[val], max_prompt_length=8, max_response_length=4)
    return RunArgs(**(settings | dict(train_batch_size=8, mini_batch_size=4, n=4, num_workers=2) | changes))


def test_more_prompts_a_round_than_the_data_has_fail_before_any_worker(demo_files, in_tmp_path):
    with pytest.raises(ValueError, match=r"the prompts drawn per round \(--gen-batch-size\) is 200 prompts, more than"):
        Run(run_args(demo_files), prompts_per_batch=200)
    with pytest.raises(ValueError, match="--train-batch-size is 128 prompts, more than the 100 in --train-files"):
        Run(run_args(demo_files, train_batch_size=128, mini_batch_size=64))
    assert not (in_tmp_path / "runs").exists()


def test_resume_auto_with_no_checkpoint_starts_from_step_1(demo_files, in_tmp_path, capsys):
    run = Run(run_args(demo_files, resume="auto", in_process=True))
    try:
        assert run.resume_from is None and run.start_step == 1
        assert run.val_name == "held-out accuracy"
        assert "--resume auto: no checkpoint of runs/grpo__" in capsys.readouterr().out
    finally:
        run.scorer.close()
        run.rollouts.close()
        run.tracker.close()


def test_the_algorithm_is_named_by_its_script():
    assert algorithm_name("algos/grpo_hybrid.py") == "grpo"
    assert algorithm_name("/tmp/x/my_algo_hybrid.py") == "my_algo" and algorithm_name("plain.py") == "plain"
    with pytest.raises(ValueError, match="name the script <algorithm>_hybrid.py without '__'"):
        algorithm_name("my__algo_hybrid.py")
