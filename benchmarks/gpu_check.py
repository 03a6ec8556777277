"""The GPU path on one device, checked and measured in one command: `pytest tests/gpu`, then, on a model of Qwen3-0.6B's
shape with random weights (configs/qwen3-0.6b.json, and the demo's tokenizer: nothing is downloaded), in this one
process and without Ray:

- the update's throughput, trained tokens a second and model-FLOPs utilisation against the GPU's bf16 peak, at 4k and
  16k tokens per micro-batch (one sequence each, GRPO's loss), with LoRA r16 and with every weight trained;
- the same at prime-rl's shape: micro-batches of 16k tokens packed from sequences of 256 to 4,096 tokens (mixed
  lengths, as an RL batch has them), with and without activation checkpointing (prime-rl recomputes activations);
- the hf engine's generation throughput, generated tokens a second, at 8, 64 and 256 sequences;
- the peak GPU memory of each (common/memory.measured, the runs' perf/peak_memory_gb);

then the quick start as typed, `python algos/grpo_hybrid.py`, under Ray on the one GPU for a few steps (where Ray is
installed); as one table, with the GPU's name, torch's version, the attention kernel and the micro-batches' layout.
docs/gpu-check.md says how to run it on a GPU machine, online or offline.

    python benchmarks/gpu_check.py        # one CUDA GPU: at most 8 minutes
    python benchmarks/gpu_check.py --cpu  # the same code at tiny sizes on the CPU, in seconds (CI runs it)

Model FLOPs of a trained token: 6 per weight of the matrix products, the output layer's included (forward 2, backward
4: the activations' gradients and the weights'), 4 with LoRA, whose frozen weights get no gradient; plus causal
attention's 6 x layers x sequence length x query width. The bar (prime-rl, one H100, 16k-token sequences): 11.9k
trained tokens a second for Qwen3-0.6B in full, 13.3k with LoRA r16.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "algos"))

import grpo_hybrid  # noqa: E402
from common.dataproto import DataProto  # noqa: E402
from common.workers import PolicyWorker  # noqa: E402

QWEN3_06B = ROOT / "benchmarks" / "configs" / "qwen3-0.6b.json"
# Dense bf16 tensor-core peaks (TFLOP/s) from the datasheets, by a part of the name torch reports; the first match wins.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756, "H100": 989, "H200": 989, "A100": 312}
SIZES = {
    "cuda": dict(
        shape={},
        micro_batch_tokens=(4096, 16384),
        tokens_per_update=65536,
        prompt=256,
        sequences=(8, 64, 256),
        response=256,
        packed_lengths=(256, 4096),
    ),
    # the same code, each number small enough for a CPU in seconds
    "cpu": dict(
        shape=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
        micro_batch_tokens=(32, 64),
        tokens_per_update=128,
        prompt=8,
        sequences=(2, 4, 8),
        response=8,
        packed_lengths=(8, 32),
    ),
}
LORA_RANK = 16
TIMED_UPDATES = 3  # after one that warms up
QUICK_START_STEPS = 3


def random_model(config_file: Path, folder: Path, tokenizer_path: str, **shape) -> str:
    """A model of `config_file`'s shape (with `shape`'s changes) and random weights, saved in `folder` with the
    tokenizer of `tokenizer_path`, whose token ids it shares: its own lie beyond the tokenizer's and decode to nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    settings = json.loads(config_file.read_text()) | shape
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings, **ids)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_BF16_TFLOPS.items() if part in name), None)


def flops_per_token(config, sequence_length: int, lora: bool) -> float:
    """Model FLOPs of one trained token (see the module's docstring)."""
    layer = config.hidden_size * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    layer += (
        config.num_attention_heads * config.head_dim * config.hidden_size + 3 * config.hidden_size * config.intermediate_size
    )
    weights = config.num_hidden_layers * layer + config.hidden_size * config.vocab_size
    attention = 6 * config.num_hidden_layers * sequence_length * config.num_attention_heads * config.head_dim
    return (4 if lora else 6) * weights + attention


def policy_on(device: torch.device, model_path: str, lora_rank: int = 0, checkpointing: bool = False) -> PolicyWorker:
    """The policy worker as --in-process makes it, on `device`: bf16 compute over fp32 master weights on a GPU."""
    worker = PolicyWorker(0, 1, use_gpu=device.type == "cuda")
    lora = dict(lora_rank=lora_rank, lora_alpha=2 * lora_rank, gradient_checkpointing=checkpointing)
    settings = dict(use_reference=False, compute_dtype="auto", log_prob_chunk_tokens=1024)  # RunArgs' chunks
    worker.setup(worker.master_address(), model_path=model_path, **settings, **lora)
    return worker


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def update_batch(vocab_size: int, sequences: int, length: int, prompt: int, lengths: list[int] | None = None) -> DataProto:
    """`sequences` rows of `length` random tokens, `prompt` of them the prompt, with GRPO's update inputs; with
    `lengths`, row i holds that many tokens, its response right-padded."""
    input_ids = torch.randint(3, vocab_size, (sequences, length))
    lengths = torch.tensor(lengths or [length] * sequences)
    attention_mask = (torch.arange(length)[None] < lengths[:, None]).long()
    responses = (input_ids * attention_mask)[:, prompt:]
    return DataProto.from_dict(
        {
            "input_ids": input_ids * attention_mask,
            "attention_mask": attention_mask,
            "position_ids": torch.arange(length).expand(sequences, length),
            "responses": responses,
            "response_mask": attention_mask[:, prompt:],
            "advantages": torch.randn(sequences, 1).expand_as(responses).contiguous(),
            "rollout_log_probs": torch.zeros(responses.shape),
        }
    )


def mixed_lengths(shortest: int, longest: int, tokens: int) -> list[int]:
    """Sequence lengths drawn evenly between `shortest` and `longest` (a fixed draw) until they hold `tokens`."""
    generator, lengths = torch.Generator().manual_seed(0), []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(shortest, longest + 1, (1,), generator=generator)))
    return lengths


def measure_update(
    worker: PolicyWorker, micro_batch_tokens: int, tokens_per_update: int, prompt: int, lora: bool, lengths=None
) -> dict:
    """Trained tokens a second over TIMED_UPDATES updates of one sequence per micro-batch (or with `lengths`, the two
    lengths between which those of sequences packed into micro-batches are drawn), its MFU, and the peak."""
    worker.budget.tokens = micro_batch_tokens
    config = worker.model.config
    if lengths is None:
        batch = update_batch(config.vocab_size, max(1, tokens_per_update // micro_batch_tokens), micro_batch_tokens, prompt)
        attended = micro_batch_tokens
    else:
        drawn = mixed_lengths(*lengths, tokens_per_update)
        batch = update_batch(config.vocab_size, len(drawn), lengths[1], prompt, drawn)
        attended = sum(length**2 for length in drawn) / sum(drawn)  # a token's sequence length, averaged over tokens
    loss = partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0))
    worker.update(batch, loss)
    worker.phase_peak_memory()
    synchronize(worker.device)
    start = time.perf_counter()
    for _ in range(TIMED_UPDATES):
        worker.update(batch, loss)
    synchronize(worker.device)
    tokens_per_s = TIMED_UPDATES * batch["attention_mask"].sum().item() / (time.perf_counter() - start)
    peak = peak_tflops(worker.device)
    mfu = tokens_per_s * flops_per_token(config, attended, lora) / (peak * 1e12) if peak else None
    return dict(tokens_per_s=tokens_per_s, mfu=mfu, peak_gb=worker.phase_peak_memory()["update"])


def measure_generation(worker: PolicyWorker, sequences: int, prompt: int, response: int) -> dict:
    """Generated tokens a second of the hf engine, `sequences` random prompts of `prompt` tokens at once, sampling up
    to `response` tokens each (random weights seldom sample EOS), after a warm-up of one call; and its peak."""
    prompts = torch.randint(3, worker.model.config.vocab_size, (sequences, prompt))
    data = DataProto.from_dict({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})
    worker.generate(data[:1], max_response_length=4)
    worker.phase_peak_memory()
    synchronize(worker.device)
    start = time.perf_counter()
    generated = worker.generate(data, max_response_length=response)
    synchronize(worker.device)
    tokens_per_s = generated["response_mask"].sum().item() / (time.perf_counter() - start)
    return dict(tokens_per_s=tokens_per_s, mfu=None, peak_gb=worker.phase_peak_memory()["generate"])


def run_quick_start() -> str:
    """`python algos/grpo_hybrid.py` as typed, under Ray, for QUICK_START_STEPS steps of the demo, in a scratch folder;
    its whole output goes to this one's."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, str(ROOT / "algos" / "grpo_hybrid.py"), "--total-steps", str(QUICK_START_STEPS)]
        result = subprocess.run([*command, "--test-freq", str(QUICK_START_STEPS)], cwd=scratch)
    outcome = "passed" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
    return f"quick start under Ray ({QUICK_START_STEPS} steps): {outcome} in {time.perf_counter() - start:.0f} s"


def run_tests() -> str:
    """`pytest tests/gpu`'s summary line; its whole output goes to this one's."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"], cwd=ROOT)
    outcome = "passed" if result.returncode == 0 else f"FAILED (exit {result.returncode})"
    return f"pytest tests/gpu: {outcome} in {time.perf_counter() - start:.0f} s"


def attempt(measurement, worker: PolicyWorker, *args) -> dict:
    """`measurement`'s row, or one that says the GPU ran out of memory, so that the rows after it still run."""
    try:
        return measurement(worker, *args)
    except torch.OutOfMemoryError:
        worker.optimizer.zero_grad(set_to_none=True)
        peak_gb = torch.cuda.max_memory_allocated(worker.device) / 2**30
        torch.cuda.empty_cache()
        return dict(tokens_per_s=None, mfu=None, peak_gb=peak_gb)


def measure(device: torch.device, model_path: str) -> tuple[list[tuple[str, dict]], str]:
    """Each row of the table (the update's at each micro-batch size and packed at prime-rl's shape, LoRA then full, then
    generation's, then the packed update's with activations recomputed), and the attention kernel with the layout."""
    import torch.distributed as dist

    sizes, rows = SIZES[device.type], []
    packed, widest = sizes["packed_lengths"], sizes["micro_batch_tokens"][-1]
    for lora_rank, checkpointing in ((LORA_RANK, False), (0, False), (LORA_RANK, True), (0, True)):
        worker = policy_on(device, model_path, lora_rank, checkpointing)
        name = f"update, LoRA r{lora_rank}" if lora_rank else "update, full"
        name += ", recomputed" if checkpointing else ""
        one_each = [(f"{tokens} tokens/micro-batch", tokens, None) for tokens in sizes["micro_batch_tokens"]]
        one_each = [] if checkpointing else one_each  # prime-rl's shape only: the recomputation's cost
        for label, tokens, lengths in [*one_each, (f"{widest} packed of {packed[0]}-{packed[1]}", widest, packed)]:
            update = (tokens, sizes["tokens_per_update"], sizes["prompt"], lora_rank > 0, lengths)
            result = attempt(measure_update, worker, *update)
            rows.append((f"{name}, {label}", result))
            print(rows[-1], flush=True)
        if not lora_rank and not checkpointing:
            for sequences in sizes["sequences"]:
                result = attempt(measure_generation, worker, sequences, sizes["prompt"], sizes["response"])
                rows.append((f"generate (hf), {sequences} x {sizes['prompt']}+{sizes['response']} tokens", result))
                print(rows[-1], flush=True)
        attention = f"{worker.attention_kernel}, micro-batches: {worker.layout}, compute: {worker.compute_dtype}"
        del worker
        dist.destroy_process_group()  # the next worker starts its own, as a new process would
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, attention


def table(device: torch.device, rows: list[tuple[str, dict]], attention: str, checks: list[str]) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_tflops(device)
    lines = [
        f"device: {name} (bf16 peak {f'{peak} TFLOP/s' if peak else 'unknown'}), torch {torch.__version__}",
        f"attention: {attention}",
        *checks,
        "",
        f"| {'measurement':<56} | {'tokens/s':>9} | {'MFU':>6} | {'peak GB':>7} |",
        f"|{'-' * 58}|{'-' * 10}:|{'-' * 7}:|{'-' * 8}:|",
    ]
    for label, result in rows:
        mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "-"
        tokens_per_s = "OOM" if result["tokens_per_s"] is None else f"{result['tokens_per_s']:.0f}"
        lines.append(f"| {label:<56} | {tokens_per_s:>9} | {mfu:>6} | {result['peak_gb']:>7.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="a dry run at tiny sizes on the CPU, without the tests")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run on a machine with one, or pass --cpu for the dry run")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    checks = ["pytest tests/gpu: not run (--cpu; CI runs it)" if args.cpu else run_tests()]
    if args.cpu or importlib.util.find_spec("ray") is None:
        checks.append("quick start under Ray: not run (" + ("--cpu; CI runs the scripts)" if args.cpu else "no Ray here)"))
    else:
        checks.append(run_quick_start())
    from common.demo import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        build_tiny_model(f"{scratch}/tiny")  # for its tokenizer
        model_path = random_model(QWEN3_06B, Path(scratch, "model"), f"{scratch}/tiny", **SIZES[device.type]["shape"])
        rows, attention = measure(device, model_path)
    print(table(device, rows, attention, checks))


if __name__ == "__main__":
    main()
