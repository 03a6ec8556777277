"""The whole GRPO loop in one process (--in-process, no Ray) on each device present, a few steps: on the built-in demo,
and on a model of SmolLM2-135M's shape with random weights (benchmarks/configs; the real file is more than a device's
call carries) with LoRA, as its demo trains it, in the compute dtype `auto` picks (bf16 on a GPU). On the CPU that
model keeps 2 of its 30 layers: each layer's shape, the heads and the vocabulary are its own, in seconds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_check import random_model

ROOT = Path(__file__).resolve().parents[2]
FEW_STEPS = ["--in-process", "--total-steps", "2", "--test-freq", "2", "--no-val-before-train"]


@pytest.fixture
def smollm2_shaped(device, tmp_path, tiny_model):
    depth = dict(num_hidden_layers=2) if device == "cpu" else {}
    return random_model(ROOT / "benchmarks" / "configs" / "smollm2-135m.json", tmp_path / "model", tiny_model, **depth)


def grpo_in_process(device: str, cwd: Path, *flags: str) -> list[dict]:
    """The metrics of each step of grpo_hybrid.py --in-process run on `device`, after checking it ran there."""
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    result = subprocess.run(
        [sys.executable, str(ROOT / "algos" / "grpo_hybrid.py"), *FEW_STEPS, *flags],
        cwd=cwd,
        env=os.environ | hidden,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"PolicyWorker: 1 x {device}" in result.stdout
    [run_dir] = (cwd / "runs").iterdir()
    assert (run_dir / "model" / "config.json").is_file()  # exported
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_demo_in_one_process(device, demo_files, tmp_path):
    flags = ["--train-batch-size", "8", "--mini-batch-size", "4", "--n", "4"]
    rows = grpo_in_process(device, tmp_path, *flags)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["perf/peak_memory_gb/policy/update"] > 0 and row["actor/grad_norm"] > 0
        assert 0 <= row["train/reward_mean"] <= 1 and "actor/kl" in row  # the demo keeps a reference
    assert "val/accuracy" in rows[-1]


def test_grpo_on_smollm2_shaped_model_with_lora_in_one_process(device, demo_files, smollm2_shaped, tmp_path):
    import pyarrow.parquet as pq

    _, train_file, val_file = demo_files
    pq.write_table(pq.read_table(val_file).slice(0, 4), tmp_path / "val.parquet")  # validation's path, in seconds
    data = ["--model-path", smollm2_shaped, "--train-files", train_file, "--val-files", str(tmp_path / "val.parquet")]
    sizes = ["--max-prompt-length", "8", "--max-response-length", "8", "--train-batch-size", "2", "--n", "2"]
    batches = ["--mini-batch-size", "2", "--micro-batch-size", "4", "--lora-rank", "16", "--lora-alpha", "32"]
    (tmp_path / "run").mkdir()
    rows = grpo_in_process(device, tmp_path / "run", *data, *sizes, *batches, "--lr", "1e-4")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # random weights answer nothing right: the advantages, hence the gradients, may all be 0
        assert row["perf/peak_memory_gb/policy/update"] > 0 and row["actor/skipped_updates"] == 0
        assert row["response/length_mean"] > 0 and row["rollout/logprob_diff_mean"] < 0.1
