"""A reasoning-gym task (examples/reasoning_gym/tasks.py): rows generated on the machine, read by the loader, scored by
the task's own verifier in the reward processes, and a GRPO step trained on them."""

import importlib.util

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, TINY, metric_rows, run_script

from common.data import load_prompts
from common.isolation import CallProcesses
from common.rewards import REWARD_CALLS, score_texts

TASKS_FILE = ROOT / "examples" / "reasoning_gym" / "tasks.py"
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "max_digits": 1}  # "...: 4 + 3 =": prompts the tiny model's 128 positions hold


def tasks_module():
    spec = importlib.util.spec_from_file_location("reasoning_gym_tasks", TASKS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chain_sum_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chain_sum")
    splits = tasks_module().generate("chain_sum", CHAIN_SUM, "last-number", train_size=16, test_size=8, seed=1)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{split}.parquet")
    return folder / "train.parquet", folder / "test.parquet"


def test_rows_are_verl_style_held_out_and_scored_by_the_tasks_verifier_in_the_reward_processes(chain_sum_files, tokenizer):
    train_file, test_file = chain_sum_files
    train = load_prompts([str(train_file)], tokenizer, 128)
    test = load_prompts([str(test_file)], tokenizer, 128)
    assert set(train["data_source"]) == set(test["data_source"]) == {"reasoning_gym/chain_sum"}
    assert len(set(train["prompt_text"])) == 16 and not set(train["prompt_text"]) & set(test["prompt_text"])
    right = [f"So {truth} is the answer." for truth in test["ground_truth"][:4]]
    wrong = [f"So {int(truth) + 1} is the answer." for truth in test["ground_truth"][:2]] + ["No idea.", "<answer>x</answer>"]
    tagged = [f"<answer>{truth}</answer>, so 99" for truth in test["ground_truth"][:2]]  # the tags win over the last number
    batch = test[[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]
    pool = CallProcesses(f"{TASKS_FILE}:compute_score", 2, REWARD_CALLS, timeout=30)
    try:
        scores, metrics, extras = score_texts(right + wrong + tagged, batch, pool)
    finally:
        pool.close()
    assert scores == [1.0] * 4 + [0.0] * 4 + [1.0] * 2
    assert metrics == {"reward/errors": 0, "reward/timeouts": 0, "reward/unscored": 0}
    assert [extra["answered"] for extra in extras] == [1.0] * 6 + [0.0, 1.0] + [1.0] * 2


def test_a_grpo_step_trains_on_a_reasoning_gym_task(ray_cluster, chain_sum_files, tmp_path):
    train_file, test_file = chain_sum_files
    reward = ["--reward-fn", f"{TASKS_FILE}:compute_score", "--reward-workers", "1", "--max-prompt-length", "100"]
    files = ["--train-files", str(train_file), "--val-files", str(test_file)]
    result = run_script("grpo_hybrid.py", *TINY, "--total-steps", "1", "--test-freq", "1", *files, *reward, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    [row] = [row for row in metric_rows(run_dir) if "val/accuracy" in row]
    assert row["reward/errors"] == 0 and 0.0 <= row["reward/answered"] <= 1.0 and "val/reward/answered" in row
