"""The dataset converters on hand-written rows, read back by the loader and scored by the built-in rewards."""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.data import load_prompts
from common.rewards import default_reward

ROOT = Path(__file__).resolve().parents[1]


def converter(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(name):
    return [json.loads(line) for line in (ROOT / "tests" / "data" / f"{name}_rows.jsonl").read_text().splitlines()]


def test_gsm8k_conversion(tmp_path, tokenizer):
    gsm8k = converter("gsm8k")
    converted = [gsm8k.convert(row, "train", i) for i, row in enumerate(rows("gsm8k"))]
    assert [r["reward_model"]["ground_truth"] for r in converted] == ["72", "2400"]
    assert converted[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    pq.write_table(pa.Table.from_pylist(converted), tmp_path / "train.parquet")
    data = load_prompts([str(tmp_path / "train.parquet")], tokenizer, 1000)
    assert list(data["data_source"]) == ["openai/gsm8k"] * 2
    assert default_reward("openai/gsm8k", "so #### 2,400", data["ground_truth"][1], {}) == 1.0


def test_math_conversion_and_reward(tmp_path, tokenizer):
    math = converter("hendrycks_math")
    converted = [math.convert(row, "test", i) for i, row in enumerate(rows("math"))]
    assert [r["reward_model"]["ground_truth"] for r in converted] == ["\\frac{3}{4}", "3"]
    assert converted[0]["extra_info"]["level"] == "Level 1"
    pq.write_table(pa.Table.from_pylist(converted), tmp_path / "test.parquet")
    data = load_prompts([str(tmp_path / "test.parquet")], tokenizer, 1000)
    truth = data["ground_truth"][0]
    assert default_reward("math", "Adding gives \\boxed{0.75}.", truth, {}) == 1.0
    assert default_reward("math", "Adding gives \\boxed{\\frac{2}{3}}.", truth, {}) == 0.0
    assert math.last_boxed("a \\boxed{x} then \\boxed{\\frac{1}{\\sqrt{2}}} end") == "\\frac{1}{\\sqrt{2}}"
    with pytest.raises(ValueError, match="no \\\\boxed"):
        math.convert({"problem": "p", "solution": "no answer"}, "train", 7)
