"""A reasoning-gym task as verl-style parquet, generated on this machine: `python examples/reasoning_gym/tasks.py
--task chain_sum --out-dir data/chain_sum`.

reasoning-gym (`pip install -e ".[reasoning-gym]"`) generates about a hundred reasoning tasks procedurally, each with
its own verifier: nothing is downloaded. Each row's data source is `reasoning_gym/<task>`, its ground truth the task's
answer, and its extra_info what the verifier needs: the task's name and configuration and the generated entry
(question, answer, metadata) as JSON. Questions are distinct, and the test rows are held out: none is among the
training rows. `compute_score` scores a response with the task's own verifier (`score_answer`), in the reward processes:

    python algos/grpo_hybrid.py --train-files data/chain_sum/train.parquet --val-files data/chain_sum/test.parquet \
        --reward-fn examples/reasoning_gym/tasks.py:compute_score

The answer is read from the last `<answer>...</answer>` in the response, as reasoning-gym's own prompts ask for it
(`--answer-format tags`: reasoning-gym's default system prompt); `--answer-format last-number` asks for the number
only and, without tags, takes the response's last number, for numeric tasks and models too small to keep to the tags.
"""

import argparse
import functools
import json
import os
import re

TAGS_SYSTEM_PROMPT = "default"  # reasoning_gym.utils.SYSTEM_PROMPTS: think, then <answer>answer here</answer>
NUMBER_INSTRUCTION = " Reply with the number only."
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def convert(entry: dict, task: str, config: dict, answer_format: str, split: str, index: int) -> dict:
    """One generated reasoning-gym entry (question, answer, metadata) as a prompt row."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if answer_format == "tags":
        prompt = [
            {"role": "system", "content": SYSTEM_PROMPTS[TAGS_SYSTEM_PROMPT]},
            {"role": "user", "content": entry["question"]},
        ]
    else:
        prompt = [{"role": "user", "content": entry["question"] + NUMBER_INSTRUCTION}]
    return {
        "prompt": prompt,
        "data_source": f"reasoning_gym/{task}",
        "reward_model": {"ground_truth": str(entry["answer"])},
        "extra_info": {
            "split": split,
            "index": index,
            "task": task,
            "config": json.dumps(config),
            "entry": json.dumps(entry, default=str),  # metadata varies by task: one string keeps parquet's schema
            "answer_format": answer_format,
        },
    }


def distinct(entries, size: int, taken: set) -> list[dict]:
    """The first `size` entries whose questions are neither in `taken` nor seen before."""
    kept = []
    for entry in entries:
        if entry["question"] not in taken and len(kept) < size:
            taken.add(entry["question"])
            kept.append(entry)
    return kept


def generate(task: str, config: dict, answer_format: str, train_size: int, test_size: int, seed: int) -> dict:
    """{"train": rows, "test": rows} of distinct questions, none in both; an error if the task has too few."""
    import reasoning_gym

    taken = set()
    test = distinct(reasoning_gym.create_dataset(task, size=4 * test_size, seed=seed + 1, **config), test_size, taken)
    train = distinct(reasoning_gym.create_dataset(task, size=4 * train_size, seed=seed, **config), train_size, taken)
    if len(test) < test_size or len(train) < train_size:
        raise ValueError(
            f"--task {task} with --config {json.dumps(config)} gave {len(test)} distinct test and {len(train)} distinct "
            f"training questions, not --test-size {test_size} and --train-size {train_size}: lower them or widen --config"
        )
    return {
        split: [convert(entry, task, config, answer_format, split, i) for i, entry in enumerate(entries)]
        for split, entries in (("train", train), ("test", test))
    }


@functools.lru_cache(maxsize=64)
def verifier(task: str, config: str):
    """The task's own `score_answer`, on a dataset made with the rows' configuration (some verifiers read it)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(config)).score_answer


def extract_answer(solution_str: str, answer_format: str) -> str | None:
    """The last <answer>...</answer>; without one, with `last-number`, the response's last number."""
    from reasoning_gym.utils import extract_answer as tagged_answer

    answer = tagged_answer(solution_str)
    if answer is None and answer_format == "last-number":
        numbers = NUMBER.findall(solution_str)
        answer = numbers[-1] if numbers else None
    return answer


def compute_score(data_source, solution_str, ground_truth, extra_info):
    """The task's verifier on the response's answer: a float in [0, 1] (some tasks give partial credit)."""
    answer = extract_answer(solution_str, extra_info["answer_format"])
    score = verifier(extra_info["task"], extra_info["config"])(answer, json.loads(extra_info["entry"]))
    return {"score": float(score), "answered": float(answer is not None)}


if __name__ == "__main__":
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, help="a reasoning-gym task: chain_sum, basic_arithmetic, leg_counting...")
    parser.add_argument("--config", default="{}", help="the task's configuration as JSON, e.g. '{\"max_digits\": 1}'")
    parser.add_argument("--answer-format", choices=("tags", "last-number"), default="tags")
    parser.add_argument("--train-size", type=int, default=1000)
    parser.add_argument("--test-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out-dir", default=None, help="default: data/<task>")
    options = parser.parse_args()
    try:
        import reasoning_gym
    except ImportError:
        parser.error('reasoning-gym is not installed: pip install -e ".[reasoning-gym]"')
    if options.task not in reasoning_gym.factory.DATASETS:
        parser.error(
            f"--task {options.task}: reasoning-gym has no such task; some it has: "
            f"{', '.join(sorted(reasoning_gym.factory.DATASETS)[:12])}..."
        )
    try:
        config = json.loads(options.config)
    except json.JSONDecodeError as error:
        parser.error(f"--config is not JSON: {error}")
    out_dir = options.out_dir or os.path.join("data", options.task)
    os.makedirs(out_dir, exist_ok=True)
    try:
        splits = generate(options.task, config, options.answer_format, options.train_size, options.test_size, options.seed)
    except (ValueError, TypeError) as error:  # too few distinct questions, or a --config key the task does not take
        parser.error(str(error))
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(out_dir, f"{split}.parquet"))
        print(f"{len(rows)} rows -> {out_dir}/{split}.parquet")
