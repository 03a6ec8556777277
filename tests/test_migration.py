"""The pages for users coming from verl and TRL, and the fork of docs/forking.md, run as written: each page's command on
the tiny model (its model, files and sizes swapped for small ones), its data and reward as the page gives them."""

import json
import re
import shlex
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from helpers import ROOT, TINY, metric_rows, metrics_of, run_script


def page_block(page: str, language: str, holding: str) -> str:
    """The fenced `language` block of docs/`page` that holds `holding`."""
    text = (ROOT / "docs" / page).read_text()
    [block] = [b for b in re.findall(rf"```{language}\n(.*?)```", text, re.S) if holding in b]
    return block


def page_command(page: str, **swaps) -> tuple[str, list[str]]:
    """The script and flags of the page's `python algos/...` command, each flag of `swaps` given another value (every
    one of them must be on the page: the page keeps the flags the test relies on)."""
    _, script, *flags = shlex.split(page_block(page, "bash", "python algos/").replace("\\\n", " "))
    for name, value in swaps.items():
        flag = "--" + name.replace("_", "-")
        assert flag in flags, f"{page} no longer passes {flag}"
        flags[flags.index(flag) + 1] = value
    return script.removeprefix("algos/"), flags


def verl_row(source, question, truth, index):
    """A row as verl's examples/data_preprocess scripts write it."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": index},
    }


def test_the_verl_page_runs_gsm8k_and_math_rows_with_no_reward_flag(ray_cluster, tiny_model, tmp_path):
    """verl's GSM8K and MATH rows score by their built-in rewards; --filter-overlong-prompts leaves the long row out,
    --total-epochs 1 stops after the one batch of the data, and the run goes into --runs-dir."""
    rows = [
        verl_row("openai/gsm8k", "1+2= ####", "3", 0),
        verl_row("DigitalLearningGmbH/MATH-lighteval", "2+2= \\boxed{}", "4", 1),
        verl_row("openai/gsm8k", "1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1= ####", "29", 2),
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "test.parquet")
    sizes = dict(train_batch_size="2", mini_batch_size="2", micro_batch_size="4", n="2", max_prompt_length="48")
    script, flags = page_command(
        "from-verl.md",
        model_path=tiny_model,
        train_files=str(tmp_path / "train.parquet"),
        val_files=str(tmp_path / "test.parquet"),
        max_response_length="4",
        rollout_engine="hf",
        num_workers="2",
        total_epochs="1",
        runs_dir="checkpoints",
        **sizes,
    )
    assert "--filter-overlong-prompts" in flags and "--reward-fn" not in flags
    result = run_script(script, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "left out 1 prompts" in result.stdout and "--total-epochs 1 of 1 batches each: 1 steps" in result.stdout
    assert not (tmp_path / "runs").exists()
    [run_dir] = (tmp_path / "checkpoints").iterdir()
    rows = metric_rows(run_dir)
    assert run_dir.name.startswith("grpo__grpo_hybrid__1__") and (run_dir / "model" / "config.json").is_file()
    assert [row["step"] for row in rows] == [0, 1] and rows[1]["train/epoch"] == 1.0
    for source in ("openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"):
        assert f"val/accuracy/{source}" in rows[1]
    assert rows[1]["reward/errors"] == 0 and rows[1]["val/errors"] == 0


def test_the_trl_page_runs_its_dataset_and_weighted_rewards(ray_cluster, tiny_model, tmp_path):
    """TRL's rows (a string prompt, a list of messages) and its two reward functions, one returning None for some
    samples: the run trains and logs each function's mean."""
    (tmp_path / "prompts.jsonl").write_text(page_block("from-trl.md", "json", '"prompt"'))
    (tmp_path / "rewards.py").write_text(page_block("from-trl.md", "python", "def correct"))
    script, flags = page_command(
        "from-trl.md", model_path=tiny_model, n="2", max_response_length="4", micro_batch_size="4"
    )
    result = run_script(script, *flags, "--num-workers", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics_of(tmp_path)
    assert [row["step"] for row in rows] == [0, 1] and rows[1]["train/epoch"] == 1.0
    step = rows[1]
    assert {"reward/correct", "reward/brief", "val/reward/correct", "val/reward/brief"} <= step.keys()
    assert step["reward/brief"] <= 0 and 0 <= step["reward/correct"] <= 1 and step["reward/errors"] == 0
    samples = [json.loads(line) for line in (run_dir / "validation" / "step_1.jsonl").read_text().splitlines()]
    assert {"brief" in sample for sample in samples} == {True, False}  # None for the "sum" row: no score of brief


def test_a_fork_made_by_the_forking_page_runs_under_its_own_name(ray_cluster, demo_files, tmp_path):
    """docs/forking.md's three steps, in a folder of its own: copy, the diff's line replaced, one step."""
    page = (ROOT / "docs" / "forking.md").read_text()
    [(parent, copy)] = re.findall(r"^ *cp (algos/\S+) algos/(\S+)$", page, re.M)
    [(script, steps)] = re.findall(r"^ *python algos/(\S+) --total-steps (\d+)$", page, re.M)
    assert script == copy == "mediangrpo_hybrid.py"
    fork = tmp_path / "algos" / copy
    fork.parent.mkdir()
    shutil.copyfile(ROOT / parent, fork)
    diff = [line.strip() for line in page_block("forking.md", "diff", "-").splitlines()]
    [old] = [line[1:].strip() for line in diff if line.startswith("-")]
    [new] = [line[1:].strip() for line in diff if line.startswith("+")]
    assert fork.read_text().count(old) == 1
    fork.write_text(fork.read_text().replace(old, new))
    result = run_script(str(fork), *TINY, "--total-steps", steps, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics_of(tmp_path)
    assert run_dir.name.startswith("mediangrpo__mediangrpo_hybrid__1__") and rows[-1]["step"] == 1
