"""Peak memory of a policy worker against response length, with and without each measure that keeps it flat.

The real model (SmolLM2-135M-Instruct, `--model-path smollm2`, see common/pretrained.py) with a LoRA adapter of rank
16, as its demo trains it, in a group of --num-workers workers. Each worker takes one sequence: a chat prompt and a
response of N made-up tokens. For each length and setting, a fresh group runs the log-prob pass (no gradients) and
then one update (GRPO's loss, forward and backward), and reports the largest peak over its workers of each method,
from the method's own start (common/memory.measured: on Linux the resident set's high-water mark), and its seconds
(one call, the first: they include the model's warm-up), or that Ray's memory monitor stopped it.
The settings:

- `--log-prob-chunk-tokens 0`: the logits over the whole vocabulary for all of a micro-batch's response tokens at
  once, or 1024 (the default) at a time, each chunk's computed again in backward;
- `--gradient-checkpointing` off or on: every decoder layer's activations kept for backward, or computed again.

    python benchmarks/bench_memory.py --lengths 1024 4096
    python benchmarks/bench_memory.py --lengths 16384 --settings none/off none/on 1024/off
"""

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import ray
import torch
from ray import cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "algos"))

import grpo_hybrid  # noqa: E402
from common.dataproto import DataProto  # noqa: E402
from common.fsdp_worker import compute_dtype_for  # noqa: E402
from common.pretrained import resolve  # noqa: E402
from common.rollout import response_batch  # noqa: E402
from common.worker_group import init_ray  # noqa: E402
from common.worker_group import ResourcePool, WorkerDied, WorkerGroup  # noqa: E402
from common.workers import PolicyWorker  # noqa: E402

cloudpickle.register_pickle_by_value(grpo_hybrid)
LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def sequences(model_path: str, count: int, response_length: int) -> DataProto:
    """`count` copies of a times-table prompt in the model's chat template, each with a response of
    `response_length` random tokens (no EOS: the whole budget), a different one per copy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "17 * 6 ="}], add_generation_prompt=True)
    prompt = torch.tensor(prompt if isinstance(prompt, list) else prompt["input_ids"]).repeat(count, 1)
    responses = torch.randint(100, tokenizer.vocab_size, (count, response_length), generator=torch.Generator().manual_seed(0))
    eos = [tokenizer.eos_token_id]
    batch = response_batch(prompt, torch.ones_like(prompt), responses, torch.zeros(responses.shape), response_length, eos, 0)
    batch["advantages"] = torch.linspace(-1, 1, count)[:, None] * batch["response_mask"]
    return batch


def measure(
    pool, model_path: str, batch: DataProto, chunk_tokens: int, checkpointing: bool, sequence_parallel: int = 1
) -> dict[str, tuple[float, float] | str]:
    """A fresh group's log-prob pass, then one update: for each, the largest peak over its workers (GB) and the
    seconds, or that Ray's memory monitor stopped it."""
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
        log_prob_chunk_tokens=chunk_tokens,
        gradient_checkpointing=checkpointing,
        compute_dtype="auto",
        sequence_parallel=sequence_parallel,
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
            except (WorkerDied, ray.exceptions.OutOfMemoryError):
                return result | {method: "out of memory"}
            seconds = time.perf_counter() - start
            result[method] = (max(rank[method] for rank in policy.broadcast("phase_peak_memory")), seconds)
        return result
    finally:
        policy.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="response lengths, in tokens")
    parser.add_argument("--num-workers", type=int, default=1, help="policy workers, one sequence each")
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["none/off", "none/on", "1024/off", "1024/on"],
        help="log-prob chunks (none or 1024) / gradient checkpointing (off or on)",
    )
    args = parser.parse_args()

    model_path = resolve("smollm2")
    init_ray()
    pool = ResourcePool(args.num_workers, use_gpu=ray.cluster_resources().get("GPU", 0) > 0)
    dtype = compute_dtype_for("auto", torch.device("cuda" if pool.use_gpu else "cpu"))
    print(f"SmolLM2-135M-Instruct, LoRA 16, {args.num_workers} workers, one sequence each, compute {dtype}")
    print("| response tokens | log-prob chunks | gradient checkpointing | log-prob pass | update |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        batch = sequences(model_path, args.num_workers, length)
        for setting in args.settings:
            chunks, checkpointing = setting.split("/")
            result = measure(pool, model_path, batch, 0 if chunks == "none" else int(chunks), checkpointing == "on")
            cells = [result.get(method, "not run") for method in ("compute_log_prob", "update")]
            passes = " | ".join(cell if isinstance(cell, str) else f"{cell[0]:.2f} GB, {cell[1]:.1f} s" for cell in cells)
            print(f"| {length:,} | {chunks} | {checkpointing} | {passes} |", flush=True)
    pool.shutdown()


if __name__ == "__main__":
    main()
