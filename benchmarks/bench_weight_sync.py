"""Seconds per billion parameters of a full weight sync to a rollout worker apart (split placement, --rollout-workers).

The policy's ranks gather every weight from FSDP2 and its rank 0 sends them over the weight group to one vLLM engine
in a process of its own, which reloads them in place: PolicyWorker.send_weights and RolloutWorker.receive_weights, as
a run calls them. Timed from the call to both until the engine holds the weights, less the probe the engine scores
after each sync (timed apart). Prints the median of `--repeats` syncs after one to warm up.

    python benchmarks/bench_weight_sync.py --model 38.9m --rollout-dtype bfloat16

`--model`: demo (the demo's tiny model), 38.9m (bench_rollout.py's), smollm2 (SmolLM2-135M, packaged), or
qwen2.5-1.5b (Qwen2.5-1.5B's shape with random weights, built once here).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engines import EngineSettings  # noqa: E402
from common.worker_group import start_local_ray  # noqa: E402
from common.worker_group import ResourcePool, WorkerGroup, wait_all  # noqa: E402
from common.workers import PolicyWorker  # noqa: E402
from common.workers import RolloutWorker  # noqa: E402

PROBE = [2, 3]  # the probe scored after each sync: as short as it gets, since it is not what is timed


def model_path(name: str) -> str:
    if name == "smollm2":
        from common import pretrained

        return pretrained.prepare("smollm2")
    path = tempfile.mkdtemp(prefix="bench_weight_sync_")
    if name == "demo":
        from common.demo import build_tiny_model

        build_tiny_model(path)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_rollout import build_model

        if name == "38.9m":
            build_model(path)
        else:  # Qwen2.5-1.5B's configuration: 28 layers, hidden 1536, tied embeddings, 151,936 words
            qwen_1_5b = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
            build_model(path, torch.bfloat16, num_attention_heads=12, **qwen_1_5b)
    return path


def parameters_sent(path: str) -> int:
    """The elements of every weight the engine receives: a tied weight under each of its names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["demo", "38.9m", "smollm2", "qwen2.5-1.5b"], default="38.9m")
    parser.add_argument("--rollout-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-workers", type=int, default=2, help="the policy's ranks")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    path = model_path(args.model)
    sent = parameters_sent(path)
    start_local_ray(num_cpus=args.num_workers + 1)
    policy_pool, engine_pool = ResourcePool(args.num_workers, use_gpu=False), ResourcePool(1, use_gpu=False)
    policy = WorkerGroup(PolicyWorker, policy_pool, "policy", model_path=path, generates=False, use_reference=False)
    settings = EngineSettings(name="vllm", dtype=args.rollout_dtype, max_model_len=64)
    engine = WorkerGroup(RolloutWorker, engine_pool, "engine", model_path=path, engine=settings)
    address = policy.broadcast("master_address")[0]
    wait_all(policy.submit("join_weight_group", address, 2), engine.submit("join_weight_group", address, 2))
    seconds = []
    for version in range(1, args.repeats + 2):
        start = time.perf_counter()
        wait_all(policy.submit("send_weights", False), engine.submit("receive_weights", version, PROBE, 1))
        synced = time.perf_counter()
        engine.broadcast("probe_log_probs", PROBE, 1)
        seconds.append((synced - start) - (time.perf_counter() - synced))
    median = statistics.median(seconds[1:])
    print(
        f"{args.model}, vLLM {args.rollout_dtype}, {args.num_workers} policy ranks: {median:.3f} s per sync of "
        f"{sent / 1e6:.1f}M parameters, {median / sent * 1e9:.2f} s per billion "
        f"(syncs: {', '.join(f'{s:.3f}' for s in seconds)})"
    )
    engine.shutdown()
    policy.shutdown()


if __name__ == "__main__":
    main()
