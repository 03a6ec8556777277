"""What a checkpoint's manifest costs: at save, the size and sha256 of every file (write_manifest, part of each save);
at resume, every file checked against it (checkpoint_damage, before any worker starts), on the checkpoints that a real
run of SmolLM2-135M saves, with LoRA (the times tables' default) and in full.

    python benchmarks/bench_checkpoint_checks.py

Each kind trains 1 step of `python algos/grpo_hybrid.py --model-path smollm2` and saves it; the checks are then timed
--repeats times on its checkpoint, its files in the page cache as they are right after a save (a resume from a cold
disk reads them once more for the check, then the workers read them from the cache). The save's own time is the run's
timing/save, which includes the manifest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from common.checkpoint import MANIFEST, checkpoint_damage, complete_checkpoints, write_manifest

ROOT = Path(__file__).resolve().parents[1]
ONE_STEP = ["--model-path", "smollm2", "--total-steps", "1", "--n", "2", "--no-val-before-train"]
KINDS = {"lora": [], "full": ["--lora-rank", "0"]}  # LoRA: the times tables' rank 16


@dataclass
class Args:
    repeats: int = 3
    """times each check runs on each checkpoint (the best is reported)"""
    kinds: tuple[str, ...] = ("lora", "full")
    """the checkpoints to measure: lora, full"""


def best_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main(args: Args) -> None:
    for kind in args.kinds:
        folder = Path(tempfile.mkdtemp(prefix="checkpoint_checks_"))
        command = [sys.executable, str(ROOT / "algos" / "grpo_hybrid.py"), *ONE_STEP, *KINDS[kind]]
        result = subprocess.run(command, cwd=folder, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        [run_dir] = (folder / "runs").iterdir()
        [checkpoint] = complete_checkpoints(run_dir)
        [row] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        files = json.loads((checkpoint / MANIFEST).read_text())["files"]
        size = sum(entry["size"] for entry in files.values())
        assert checkpoint_damage(checkpoint) == []
        save = best_seconds(lambda: write_manifest(checkpoint), args.repeats)
        resume = best_seconds(lambda: checkpoint_damage(checkpoint), args.repeats)
        assert checkpoint_damage(checkpoint) == []
        print(
            f"{kind}: {len(files)} files, {size / 1e9:.2f} GB; the save {row['timing/save']:.2f} s, of which the manifest "
            f"{save:.2f} s; the check at resume {resume:.2f} s ({size / 1e9 / resume:.2f} GB/s)",
            flush=True,
        )
        shutil.rmtree(folder)


if __name__ == "__main__":
    main(tyro.cli(Args))
