"""Padded against packed and balanced micro-batches, on a model of realistic shape and long-tailed responses.

Builds the Qwen2 of bench_rollout.py locally (about 40M parameters, a 32k vocabulary, random weights) and a batch
of sequences whose prompts run from 32 to 128 tokens and whose responses follow a lognormal law (median 128,
between 16 and 1024 tokens). A policy worker group computes the responses' log-probs, then makes one update (GRPO's
loss) over the batch, two ways, each in a group of its own:

- padded, as before: each rank takes the next equal share of rows, micro-batches of --micro-batch-size rows padded
  to their longest sequence;
- packed: rows dealt to ranks by tokens (WorkerGroup.scatter), micro-batches of up to --micro-batch-tokens tokens
  (FSDPWorker.micro_batches), sequences packed without padding (common/layouts.py, response_outputs).

Prints the real tokens (no padding) per second of each pass, the slowest rank setting the pace, the peak resident
memory of a worker, each rank's tokens, and the speed-ups.

    python benchmarks/bench_packing.py
    python benchmarks/bench_packing.py --sequences 64 --micro-batch-tokens 8192
"""

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import ray
import torch
from ray import cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "algos"))

import grpo_hybrid  # noqa: E402
from bench_rollout import build_model  # noqa: E402
from common.dataproto import DataProto  # noqa: E402
from common.rollout import response_batch  # noqa: E402
from common.worker_group import init_ray  # noqa: E402
from common.worker_group import ResourcePool, WorkerGroup  # noqa: E402
from common.workers import PolicyWorker  # noqa: E402

cloudpickle.register_pickle_by_value(grpo_hybrid)
EOS = 1
LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


class BenchPolicy(PolicyWorker):
    def set(self, **settings) -> str:
        """Change settings; the layout of micro-batches it then uses."""
        for name, value in settings.items():
            setattr(self, name, value)
        return self.layout


def sequences(count: int, seed: int) -> DataProto:
    """Left-padded prompts of 32 to 128 tokens, responses of lognormal length (median 128, 16 to 1024) ending in EOS."""
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(32, 129, count)
    response_lengths = np.clip(rng.lognormal(np.log(128), 1.0, count), 16, 1024).astype(int)
    prompt_mask = torch.from_numpy(np.arange(128)[None] >= 128 - prompt_lengths[:, None]).long()
    prompts = torch.from_numpy(rng.integers(2, 32000, (count, 128))) * prompt_mask
    responses = torch.from_numpy(rng.integers(2, 32000, (count, int(response_lengths.max()))))
    responses[torch.from_numpy(np.arange(responses.shape[1])[None] == response_lengths[:, None] - 1)] = EOS
    return response_batch(prompts, prompt_mask, responses, torch.zeros(responses.shape), responses.shape[1], [EOS], 0)


def timed(call, repeats: int) -> float:
    """Seconds per call, the mean of `repeats` calls after one warm-up call."""
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def measure(pool, model_path: str, batch: DataProto, packed: bool, args) -> dict:
    name = "packed" if packed else "padded"
    policy = WorkerGroup(BenchPolicy, pool, name, model_path=model_path, use_reference=False, lr=1e-6)
    if packed:
        [layout, *_] = policy.broadcast("set", micro_batch_tokens=args.micro_batch_tokens)
        call = policy.scatter
    else:
        [layout, *_] = policy.broadcast("set", layout="padded", micro_batch_size=args.micro_batch_size, micro_batch_tokens=0)

        def call(method, data, **kwargs):  # each rank the next equal share of rows, as scatter dealt them before
            chunks = data.chunk(policy.world_size)
            return policy._get([policy._call(w, method, c, **kwargs) for w, c in zip(policy.workers, chunks)], method)

    inputs = batch.select(*LOG_PROB_INPUTS)
    log_prob_seconds = timed(lambda: call("compute_log_prob", inputs), args.repeats)
    log_prob_memory = max(rank["compute_log_prob"] for rank in policy.broadcast("phase_peak_memory"))
    loss_fn = partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0))
    update_inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages")
    update_seconds = timed(lambda: call("update", update_inputs, loss_fn=loss_fn), args.repeats)
    update_memory = max(rank["update"] for rank in policy.broadcast("phase_peak_memory"))
    policy.shutdown()
    return dict(
        layout=layout,
        log_prob_seconds=log_prob_seconds,
        log_prob_memory=log_prob_memory,
        update_seconds=update_seconds,
        update_memory=update_memory,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=32, help="sequences in the batch")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch, padded")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="tokens per micro-batch, packed")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per pass, after one warm-up call")
    parser.add_argument("--num-workers", type=int, default=2, help="policy workers (one CPU slot each without GPUs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and tokens")
    args = parser.parse_args()
    if args.micro_batch_tokens < 128 + 1024:
        parser.error("--micro-batch-tokens must hold the longest sequence: 128 + 1024 tokens")
    if args.sequences % args.num_workers:
        parser.error("--sequences must split evenly over --num-workers")

    model_path = tempfile.mkdtemp(prefix="bench_packing_")
    build_model(model_path)
    batch = sequences(args.sequences, args.seed)
    lengths = batch["attention_mask"].sum(-1)
    tokens = int(lengths.sum())
    print(
        f"{args.sequences} sequences, {tokens:,} tokens: responses of {int(batch['response_mask'].sum(-1).min())} to "
        f"{int(batch['response_mask'].sum(-1).max())} tokens (median {int(batch['response_mask'].sum(-1).median())}), "
        f"padded width {batch['attention_mask'].shape[1]}"
    )
    rng = torch.Generator().manual_seed(args.seed)
    batch["old_log_probs"] = torch.zeros(batch["responses"].shape)
    batch["advantages"] = torch.randn(len(batch), 1, generator=rng).sign() * batch["response_mask"]
    init_ray()
    pool = ResourcePool(args.num_workers, use_gpu=ray.cluster_resources().get("GPU", 0) > 0)
    results = {packed: measure(pool, model_path, batch, packed, args) for packed in (False, True)}
    pool.shutdown()

    from common.layouts import balanced_parts, part_loads

    shares = [int(chunk.sum()) for chunk in lengths.chunk(args.num_workers)]
    balanced = part_loads(lengths.tolist(), balanced_parts(lengths.tolist(), args.num_workers, equal_size=True))
    print(f"tokens per rank: in order {shares}, dealt by tokens {[int(b) for b in balanced]}")
    print("| micro-batches | log-prob tokens/s | log-prob peak memory | update tokens/s | update peak memory |")
    print("|---|---|---|---|---|")
    for packed, r in results.items():
        what = f"{r['layout']}, up to {args.micro_batch_tokens} tokens" if packed else f"padded, {args.micro_batch_size} rows"
        print(
            f"| {what} | {tokens / r['log_prob_seconds']:,.0f} | {r['log_prob_memory']:.2f} GB | "
            f"{tokens / r['update_seconds']:,.0f} | {r['update_memory']:.2f} GB |"
        )
    padded, packed = results[False], results[True]
    print(
        f"packed / padded: log-prob {padded['log_prob_seconds'] / packed['log_prob_seconds']:.2f}x, "
        f"update {padded['update_seconds'] / packed['update_seconds']:.2f}x"
    )


if __name__ == "__main__":
    main()
