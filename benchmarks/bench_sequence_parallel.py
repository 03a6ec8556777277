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
import time
from functools import partial

import ray
import torch
from bench_memory import LOG_PROB_INPUTS, grpo_hybrid, sequences

from common.pretrained import resolve
from common.run import init_ray
from common.workers import PolicyWorker, ResourcePool, WorkerDied, WorkerGroup, compute_dtype_for


def measure(pool, model_path: str, length: int, size: int) -> dict[str, str]:
    batch = sequences(model_path, 1, length)
    tokens = int(batch["attention_mask"].sum())
    policy = WorkerGroup(
        PolicyWorker,
        pool,
        "policy",
        model_path=model_path,
        use_reference=False,
        lr=1e-6,
        lora_rank=16,
        lora_alpha=32,
        micro_batch_size=1,
        log_prob_chunk_tokens=1024,
        gradient_checkpointing=True,
        compute_dtype="auto",
        sequence_parallel=size,
    )
    try:
        result = {}
        loss_fn = partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0))
        calls = {
            "compute_log_prob": lambda: policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS)),
            "update": lambda: policy.scatter(
                "update", batch.select(*LOG_PROB_INPUTS, "response_mask", "rollout_log_probs", "advantages"), loss_fn=loss_fn
            ),
        }
        for method, call in calls.items():
            start = time.perf_counter()
            try:
                call()
            except (WorkerDied, ray.exceptions.OutOfMemoryError):  # Ray's memory monitor stopped it
                return result | {method: "out of memory"}
            seconds = time.perf_counter() - start
            peak_gb = max(rank[method] for rank in policy.broadcast("phase_peak_memory"))
            result[method] = f"{peak_gb:.2f} GB, {tokens / seconds:.0f} tokens/s, {size * seconds / tokens * 1000:.1f} s/1k"
        return result
    finally:
        policy.shutdown()


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
            try:
                result = measure(pool, model_path, length, size)
            finally:
                pool.shutdown()
            passes = " | ".join(result.get(method, "not run") for method in ("compute_log_prob", "update"))
            print(f"| {length:,} | {size} | {passes} |", flush=True)


if __name__ == "__main__":
    main()
