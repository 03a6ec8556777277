"""One GPU as typed (the default --num-workers, from a count of GPUs), and the device check's dry run on the CPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.args import count_workers

ROOT = Path(__file__).resolve().parents[1]


def test_num_workers_defaults_to_every_gpu_and_to_two_cpu_slots_without():
    assert count_workers(None, gpus=1) == 1
    assert count_workers(None, gpus=8) == 8
    assert count_workers(None, gpus=0) == 2
    assert count_workers(3, gpus=0) == 3  # CPU slots: Ray's pool counts them
    assert count_workers(2, gpus=4) == 2


def test_more_workers_than_gpus_names_the_flag_and_the_count():
    with pytest.raises(ValueError, match="--num-workers 2 asks for 2 GPUs, one per worker; this machine has 1"):
        count_workers(2, gpus=1)


def test_gpu_check_dry_run_prints_its_table(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout[result.stdout.index("device: CPU") :]
    assert f"torch {torch.__version__}" in table and "attention: sdpa" in table
    assert "quick start under Ray: not run" in table
    rows = [line for line in table.splitlines() if line.startswith(("| update", "| generate"))]
    # LoRA and full at two micro-batch sizes and packed, generation at three batch sizes, packed with recomputation
    assert len(rows) == 11 and sum("packed of" in row for row in rows) == 4
    for row in rows:
        tokens_per_s, mfu, peak_gb = (cell.strip() for cell in row.split("|")[2:5])
        assert float(tokens_per_s) > 0 and mfu == "-" and float(peak_gb) > 0  # no bf16 peak on a CPU
