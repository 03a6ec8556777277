"""Long sequences split over workers (`--sequence-parallel`): per-worker peak memory and speed against response length.

The real model (SmolLM2-135M-Instruct, LoRA 16, as its demo trains it) on one sequence: a chat prompt and a response
of N made-up tokens (see bench_memory.py), with what keeps memory flat on (log-probs 1024 tokens at a time, gradient
checkpointing). For each length and each --sequence-parallel size S, a fresh group of S workers splits the sequence,
runs the log-prob pass, then one update (GRPO's loss, forward and backward), and reports the largest peak over its
workers of each method (from the method's own start) and its speed: tokens a second, and the seconds each worker
spends per 1,000 tokens (S x seconds / tokens, what the tokens cost in worker time).

    python benchmarks/bench_sequence_parallel.py --lengths 4096 8192 --sizes 1 2
"""

import argparse

import ray
import torch
from bench_memory import measure, sequences  # bench_memory puts the repository on the path

from common.fsdp_worker import compute_dtype_for
from common.pretrained import resolve
from common.worker_group import init_ray
from common.worker_group import ResourcePool


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="response lengths, in tokens")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="--sequence-parallel sizes")
    args = parser.parse_args()

    model_path = resolve("smollm2")
    init_ray()
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    dtype = compute_dtype_for("auto", torch.device("cuda" if use_gpu else "cpu"))
    print(f"SmolLM2-135M-Instruct, LoRA 16, one sequence, log-prob chunks 1024, gradient checkpointing, compute {dtype}")
    print("| response tokens | sequence parallel | log-prob pass | update |")
    print("|---|---|---|---|")
    for length in args.lengths:
        for size in args.sizes:
            pool = ResourcePool(size, use_gpu)
            batch = sequences(model_path, 1, length)
            tokens = int(batch["attention_mask"].sum())
            try:
                result = measure(pool, model_path, batch, 1024, True, sequence_parallel=size)
            finally:
                pool.shutdown()
            cells = [result.get(method, "not run") for method in ("compute_log_prob", "update")]
            passes = " | ".join(
                cell
                if isinstance(cell, str)
                else f"{cell[0]:.2f} GB, {tokens / cell[1]:.0f} tokens/s, {size * cell[1] / tokens * 1000:.1f} s/1k"
                for cell in cells
            )
            print(f"| {length:,} | {size} | {passes} |", flush=True)


if __name__ == "__main__":
    main()
