"""GRPO's whole step on one GPU, algos/grpo_hybrid.py against TRL's GRPOTrainer at equal work, in one command.

Both train a model of Qwen3-0.6B's shape with random weights (configs/qwen3-0.6b.json and the demo's tokenizer, made
as benchmarks/gpu_check.py makes it: nothing is downloaded) with a LoRA adapter of rank 16 (alpha 32, every linear
layer), bf16 compute over fp32 weights, at learning rate 2e-4: 16 prompts x 8 samples a step, prompts of 256 tokens,
responses of up to 256 at temperature 1, one optimiser step per generated batch in micro-batches of 32 sequences, KL
to the adapter-disabled reference (coefficient 0.001), the same reward. Random weights all but never sample EOS, so
both sides generate every token (the mean response lengths are printed). Both generate with transformers: hybridrl's
hf engine, in one process (`--in-process`), and TRL's model.generate. Printed: seconds per step (mean over the steps
after the first), each phase's seconds, generated tokens a second, and peak GPU memory.

TRL is never a dependency of hybridrl: this Python needs trl and datasets importable (docs/gpu-check.md says how to
bring them to a machine without internet access).

    python benchmarks/gpu_step_trl.py         # one CUDA GPU, about 4 minutes
    python benchmarks/gpu_step_trl.py --cpu   # the same code at tiny sizes on the CPU
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_trl import KL, LORA_ALPHA, LORA_RANK, LR, run_hybridrl, run_trl  # noqa: E402
from gpu_check import QWEN3_06B, SIZES, random_model  # noqa: E402

STEPS = 3  # the first is left out of the means
BATCH = {
    "cuda": dict(prompts=16, samples=8, prompt=256, response=256, micro_batch=32),
    "cpu": dict(prompts=2, samples=4, prompt=8, response=8, micro_batch=4),
}


def prepare(folder: Path, shape: dict, prompts: int, prompt: int) -> tuple[str, str]:
    """The random model (its tokenizer given a chat template that is the messages' text, so that both sides see the
    same prompt tokens) and a parquet file of `prompts` prompts of `prompt` characters, one token each."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from common.demo import build_tiny_model

    build_tiny_model(str(folder / "tiny"))  # for its tokenizer
    model_path = random_model(QWEN3_06B, folder / "model", str(folder / "tiny"), **shape)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    tokenizer.save_pretrained(model_path)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(prompts):
        text = "".join(str(int(digit)) for digit in torch.randint(0, 10, (prompt,), generator=generator))
        prompt_row = [{"role": "user", "content": text}]
        rows.append({"prompt": prompt_row, "data_source": "times_tables", "reward_model": {"ground_truth": "7"}})
    train_file = folder / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train_file)
    return model_path, str(train_file)


def hybridrl_flags(model_path: str, train_file: str, prompts: int, samples: int, prompt: int, response: int, micro_batch: int):
    sizes = ["--train-batch-size", prompts, "--n", samples, "--mini-batch-size", prompts, "--micro-batch-size", micro_batch]
    lengths = ["--max-prompt-length", prompt, "--max-response-length", response]
    lora = ["--lora-rank", LORA_RANK, "--lora-alpha", LORA_ALPHA, "--lr", LR, "--kl-loss-coef", KL]
    run = ["--in-process", "--total-steps", STEPS, "--no-val-before-train"]  # the last step validates and saves
    return [str(flag) for flag in ["--model-path", model_path, "--train-files", train_file, *sizes, *lengths, *lora, *run]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="a dry run at tiny sizes on the CPU")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run on a machine with one, or pass --cpu for the dry run")
    device = "cpu" if args.cpu else "cuda"
    batch = BATCH[device]
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as scratch:
        model_path, train_file = prepare(Path(scratch), SIZES[device]["shape"], batch["prompts"], batch["prompt"])
        results = {"hybridrl grpo_hybrid.py --in-process": run_hybridrl(hybridrl_flags(model_path, train_file, **batch), env)}
        print(results, flush=True)
        sizes = dict(
            prompts=batch["prompts"], samples=batch["samples"], new_tokens=batch["response"], micro_batch=batch["micro_batch"]
        )
        results["TRL GRPOTrainer"] = run_trl(sys.executable, STEPS, device == "cuda", model_path, train_file, sizes)
    sequences = batch["prompts"] * batch["samples"]
    print(
        f"\n{name}, torch {torch.__version__}: {batch['prompts']} prompts x {batch['samples']} samples, prompts of "
        f"{batch['prompt']} tokens, responses up to {batch['response']}, LoRA r{LORA_RANK}, steps 2-{STEPS}\n"
    )
    print(
        "| run | seconds per step | hybridrl's speed against it | generated tokens/s | mean response | phases (s) | memory |"
    )
    print("|---|---:|---:|---:|---:|---|---|")
    ours = results["hybridrl grpo_hybrid.py --in-process"]["step"]
    for label, result in results.items():
        phases = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in result["phases"].items())
        generated = sequences * result["response_length"] / result["phases"]["generate"]
        print(
            f"| {label} | {result['step']:.1f} | {result['step'] / ours:.2f}x | {generated:.0f} | "
            f"{result['response_length']:.0f} | {phases} | {result['memory']} |"
        )


if __name__ == "__main__":
    main()
