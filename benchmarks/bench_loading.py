"""Peak resident memory of each policy worker process at start-up (the policy and its reference loaded and sharded, no
rollout engine), on 1 and 2 CPU ranks.

    python benchmarks/bench_loading.py --model-path smollm2 --ranks 1
    python benchmarks/bench_loading.py --model-path qwen2.5-1.5b-shape --ranks 2

`qwen2.5-1.5b-shape` is a model of Qwen2.5-1.5B's shape with random weights, built once (fp32 safetensors, about
6 GB) into $HYBRIDRL_CACHE/models. The load before sharded loading is measured by running this same file with
PYTHONPATH at a worktree of the commit before it (`git worktree add /tmp/old <commit>`).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import tyro

from common.pretrained import cache_root, resolve
from common.workers import PolicyWorker

RANDOM_MODELS = {
    "qwen2.5-1.5b-shape": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
}


@dataclass
class Args:
    model_path: str = "smollm2"
    """a model folder, a name of common.pretrained's, or qwen2.5-1.5b-shape (random weights, built once)"""
    ranks: int = 1
    """worker processes (FSDP2 ranks over gloo)"""


def random_model(name: str) -> str:
    """The folder of RANDOM_MODELS[name], its weights drawn once and saved as fp32 safetensors, with SmolLM2's
    tokenizer (the benchmark tokenises nothing; the worker loads one)."""
    folder = cache_root() / "models" / f"{name}-random"
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**RANDOM_MODELS[name])).to(torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve("smollm2")).save_pretrained(folder)
    return str(folder)


class StartupPeak(PolicyWorker):
    def peak_gb(self) -> float:
        """This process's peak resident memory since it started, in GB (Linux reports KiB)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


if __name__ == "__main__":
    from common.worker_group import start_local_ray
    from common.worker_group import ResourcePool, WorkerGroup

    args = tyro.cli(Args)
    path = random_model(args.model_path) if args.model_path in RANDOM_MODELS else resolve(args.model_path)
    start_local_ray(num_cpus=args.ranks)
    pool = ResourcePool(args.ranks, use_gpu=False)
    group = WorkerGroup(StartupPeak, pool, "loading", model_path=path, generates=False)
    peaks = group.broadcast("peak_gb")
    print(f"{args.model_path}, {args.ranks} rank(s): start-up peak per rank (GB): {', '.join(f'{p:.2f}' for p in peaks)}")
    group.shutdown()
    pool.shutdown()
