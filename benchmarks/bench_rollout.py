"""Rollout speed of the two engines, and the cost of sending the policy's weights to vLLM.

Builds a model of realistic shape locally (a Qwen2 with random weights, about 40M parameters, a 32k
vocabulary), starts a policy worker group on it once with `--rollout-engine hf` and once with `vllm`,
and times the same generate call on each: the same prompts, samples and number of new tokens. With vllm
it also times the weight sync alone: every weight (gathered from FSDP2 layer by layer and reloaded in
place), and with LoRA the adapter alone. Prints tokens per second per engine, their ratio, and sync
seconds, also per billion parameters sent.

    python benchmarks/bench_rollout.py
    python benchmarks/bench_rollout.py --rollout-dtype float32 --prompts 128 --new-tokens 256

With `--model-path smollm2`: the real model instead, on its demo's step (8 times-table prompts x 8 samples, at most
16 new tokens, a LoRA adapter of rank 16), with `hf`, and with vllm serving the adapter and receiving it merged:
seconds of weight sync and of generation per call, each the slowest rank's.

    python benchmarks/bench_rollout.py --model-path smollm2 --rollout-dtype float32
"""

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.dataproto import DataProto  # noqa: E402
from common.engines import EngineSettings  # noqa: E402
from common.worker_group import init_ray  # noqa: E402
from common.weight_sync import engine_adapter  # noqa: E402
from common.worker_group import ResourcePool, WorkerGroup  # noqa: E402
from common.workers import PolicyWorker  # noqa: E402

VOCAB = 32000


def build_model(path: str, dtype: torch.dtype = torch.float32, **shape) -> None:
    """A Qwen2 of 8 layers (head size 64, grouped KV), a 32k word-level tokenizer, random weights; `shape` overrides
    the configuration (another model's sizes)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8) | shape
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, shape["vocab_size"])}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>")), pad_token="<pad>", eos_token="<eos>"
    )
    config = Qwen2Config(
        **shape,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vocabulary {shape['vocab_size']}, "
        f"{shape['num_hidden_layers']} layers"
    )


class TimedPolicy(PolicyWorker):
    def timed_generate(self, data: DataProto, **sampling) -> tuple[float, float, int]:
        """Seconds of weight sync, then of generation, and the tokens generated, of one rollout as a step runs it."""
        start = time.perf_counter()
        if hasattr(self.engine, "sync_weights"):
            self.engine.sync_weights()
        synced = time.perf_counter()
        output = self.generate(data, **sampling)
        return synced - start, time.perf_counter() - synced, int(output["response_mask"].sum())

    def time_sync(self) -> tuple[float, int]:
        """Seconds for one weight sync to the engine, and the parameters it sent."""
        sent = (
            sum(t.numel() for t in engine_adapter(self.model).values())
            if self.lora
            else sum(p.numel() for p in self.model.parameters())
        )
        start = time.perf_counter()
        self.engine.sync_weights()
        return time.perf_counter() - start, sent


def prompts(count: int, length: int, seed: int) -> DataProto:
    ids = torch.randint(2, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed))
    return DataProto.from_dict({"prompts": ids, "prompt_mask": torch.ones_like(ids)})


def real_model(args, pool) -> None:
    """The engines on a packaged real model's demo step, LoRA adapter served or merged."""
    from transformers import AutoTokenizer

    from common import demo, pretrained
    from common.data import collate, load_prompts

    model_path = pretrained.prepare(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    settings = demo.TIMES_TABLES_DEFAULTS
    _, train_file, _ = demo.prepare("times_tables")
    prompts = load_prompts([train_file], tokenizer, settings["max_prompt_length"])[: settings["train_batch_size"]]
    batch = collate(prompts, tokenizer.pad_token_id).repeat(settings["n"]).select("prompts", "prompt_mask")
    lora = dict(lora_rank=settings["lora_rank"], lora_alpha=settings["lora_alpha"])
    longest = settings["max_prompt_length"] + settings["max_response_length"]  # as the scripts size it
    common = dict(model_path=model_path, use_reference=False, **lora)
    print(f"{len(batch)} sequences, at most {settings['max_response_length']} new tokens, LoRA rank {lora['lora_rank']}")
    print("| engine | weight sync | generate | step's rollout | new tokens |")
    print("|---|---|---|---|---|")
    for engine, sync in (("hf", "auto"), ("vllm", "adapter"), ("vllm", "merged")):
        name = engine if engine == "hf" else f"vllm {args.rollout_dtype}, --lora-sync {sync}"
        settings = EngineSettings(name=engine, dtype=args.rollout_dtype, max_model_len=longest, lora_sync=sync)
        policy = WorkerGroup(TimedPolicy, pool, name, engine=settings, **common)
        rollout = partial(policy.scatter, "timed_generate", batch, max_response_length=settings["max_response_length"])
        rollout()  # a warm-up call, not timed
        calls = [rollout() for _ in range(args.repeats)]
        sync, generate = (float(np.mean([max(rank[i] for rank in call) for call in calls])) for i in (0, 1))
        tokens = np.mean([sum(rank[2] for rank in call) for call in calls])
        print(f"| {name} | {sync:.1f} s | {generate:.1f} s | {sync + generate:.1f} s | {tokens:.0f} |", flush=True)
        policy.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="sequences per generate call (prompts x samples)")
    parser.add_argument("--prompt-length", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls per engine, after one warm-up call")
    parser.add_argument("--num-workers", type=int, default=2, help="policy workers (one CPU slot each without GPUs)")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the adapter whose sync is timed")
    parser.add_argument(
        "--rollout-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="what the vllm engine computes in"
    )
    parser.add_argument("--model-path", choices=["smollm2"], help="a packaged real model's demo step instead (see above)")
    args = parser.parse_args()

    init_ray()
    pool = ResourcePool(args.num_workers, use_gpu=ray.cluster_resources().get("GPU", 0) > 0)
    if args.model_path:
        real_model(args, pool)
        pool.shutdown()
        return
    model_path = tempfile.mkdtemp(prefix="bench_rollout_")
    build_model(model_path)
    batch = prompts(args.prompts, args.prompt_length, seed=0)
    max_model_len = args.prompt_length + args.new_tokens
    settings = dict(model_path=model_path, use_reference=False)
    engine_settings = EngineSettings(dtype=args.rollout_dtype, max_model_len=max_model_len)
    speed = {}
    for engine in ("hf", "vllm"):
        policy = WorkerGroup(TimedPolicy, pool, engine, engine=replace(engine_settings, name=engine), **settings)
        # eos is one token in 32k: responses run to the limit, so both engines generate the same amount
        policy.scatter("generate", batch, max_response_length=args.new_tokens)
        seconds, tokens = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            output = policy.scatter("generate", batch, max_response_length=args.new_tokens)
            seconds.append(time.perf_counter() - start)
            tokens.append(output["response_mask"].sum().item())
        speed[engine] = sum(tokens) / sum(seconds)
        print(
            f"{engine}: {speed[engine]:,.0f} tokens/s ({np.mean(seconds):.2f} s per call of {np.mean(tokens):,.0f} new tokens)"
        )
        if engine == "vllm":
            report_sync(policy, "every weight", args.repeats)
        policy.shutdown()
    print(f"vllm / hf: {speed['vllm'] / speed['hf']:.2f}x")
    adapter_settings = replace(engine_settings, name="vllm", lora_sync="adapter")
    adapter = WorkerGroup(TimedPolicy, pool, "adapter", engine=adapter_settings, lora_rank=args.lora_rank, **settings)
    report_sync(adapter, f"the rank-{args.lora_rank} LoRA adapter", args.repeats)
    adapter.shutdown()
    pool.shutdown()


def report_sync(policy, what: str, repeats: int) -> None:
    """The slowest rank's seconds per sync, the median over `repeats` syncs."""
    calls = [policy.broadcast("time_sync") for _ in range(repeats)]
    seconds, sent = float(np.median([max(s for s, _ in ranks) for ranks in calls])), calls[0][0][1]
    print(f"vllm sync of {what}: {seconds:.3f} s for {sent / 1e6:.2f}M parameters ({seconds / sent * 1e9:.1f} s per billion)")


if __name__ == "__main__":
    main()
