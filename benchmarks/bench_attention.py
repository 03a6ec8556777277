"""Peak memory and seconds of a packed row's passes through SDPA with a dense mask, against FlexAttention's block mask.

A micro-batch of W tokens in one row ("one row", common/layouts.py): 8 sequences of W/8 tokens each, a 64-token prompt
shared by all 8 ("shared prompts" packs it as one segment) or each with its own ("rows" of one row: --layout). The
built-in demo's tiny model (2 layers, 64 wide, 2 heads: attention is most of its work), in fp32, one process. For
each width and kernel, a fresh process runs the log-prob pass (no gradients) twice and the update's forward and
backward twice, and reports the second of each: the first includes FlexAttention's compile (torch.compile of its
kernel, per shape), reported apart as its warm-up. Peak memory: the most a pass adds to what the process held at its
start, on a GPU by the allocator's count, on the CPU by the resident set's high-water mark (common/memory.py). On the
CPU torch has no FlexAttention backward: the update takes the dense mask with both kernels there (runs_flex in
common/attention.py), and its row says so.

    python benchmarks/bench_attention.py --widths 4096 16384 32768
    python benchmarks/bench_attention.py --device cuda --widths 4096 16384 32768
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.attention import register, runs_flex  # noqa: E402
from common.dataproto import DataProto  # noqa: E402
from common.layouts import response_log_probs, response_outputs  # noqa: E402
from common.memory import peak_memory_gb, reset_peak_memory  # noqa: E402

PROMPT = 64
SEQUENCES = 8


def packed_row(width: int, vocab_size: int, shared: bool) -> DataProto:
    """8 sequences of width / 8 tokens: a 64-token prompt (the same for all with `shared`) and its response."""
    response = width // SEQUENCES - PROMPT
    ids = torch.randint(3, vocab_size, (SEQUENCES, PROMPT + response), generator=torch.Generator().manual_seed(0))
    if shared:
        ids[:, :PROMPT] = ids[0, :PROMPT]
    mask = torch.ones_like(ids)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1, "responses": ids[:, PROMPT:]}
    )


def measure(model_path: str, width: int, kernel: str, layout: str, device: torch.device) -> dict:
    """Seconds and peak memory (GiB) of each pass, the first and the second time, in this process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=register()).to(device)
    batch = packed_row(width, model.config.vocab_size, layout == "shared prompts").to(device)
    packing = "one row" if layout == "rows" else layout
    flex_from = 0 if kernel == "flex" else None
    responses = batch["responses"].flatten()

    def log_probs():
        with torch.no_grad():
            return response_outputs(model.eval(), batch, packing, True, flex_from=flex_from)

    def update():
        logits = response_outputs(model.train(), batch, packing, True, flex_from=flex_from)
        response_log_probs(logits, responses, 1.0, with_entropy=False)[0].mean().backward()

    figures = {}
    for name, run in (("log_prob", log_probs), ("update", update)):
        for attempt in ("first", "second"):
            if device.type == "cuda":
                torch.cuda.synchronize()
            reset_peak_memory(device)
            start, held = time.perf_counter(), peak_memory_gb(device)  # just after the reset: what the process holds
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            figures[f"{name}_{attempt}_s"] = time.perf_counter() - start
            figures[f"{name}_peak_gb"] = peak_memory_gb(device) - held
    with torch.enable_grad():
        figures["update_kernel"] = kernel if runs_flex(width, device, flex_from) else "sdpa"
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--kernels", nargs="+", default=["sdpa", "flex"], choices=["sdpa", "flex"])
    parser.add_argument("--layout", default="rows", choices=["rows", "shared prompts"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-path", default=None, help="default: the built-in demo's model")
    parser.add_argument("--one", nargs=2, metavar=("WIDTH", "KERNEL"), help=argparse.SUPPRESS)  # a child's measurement
    args = parser.parse_args()
    if args.model_path is None:
        from common import demo

        args.model_path = demo.prepare()[0]
    if args.one:
        figures = measure(args.model_path, int(args.one[0]), args.one[1], args.layout, torch.device(args.device))
        print(json.dumps(figures))
        return
    print(f"{args.layout}, {args.device}: {torch.cuda.get_device_name() if args.device == 'cuda' else cpu_name()}")
    print("width  kernel  log-prob s  warm-up s  peak GiB  | update s  warm-up s  peak GiB  (update's kernel)")
    for width in args.widths:
        for kernel in args.kernels:
            command = [sys.executable, __file__, "--one", str(width), kernel, "--layout", args.layout]
            command += ["--device", args.device, "--model-path", args.model_path]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                print(f"{width:5d}  {kernel:6s}  failed: {done.stderr.strip().splitlines()[-1]}", flush=True)
                continue
            f = json.loads(done.stdout.strip().splitlines()[-1])
            warm_log_prob = f["log_prob_first_s"] - f["log_prob_second_s"]
            warm_update = f["update_first_s"] - f["update_second_s"]
            print(
                f"{width:5d}  {kernel:6s}  {f['log_prob_second_s']:10.3f}  {warm_log_prob:9.1f}  {f['log_prob_peak_gb']:8.2f}"
                f"  | {f['update_second_s']:8.3f}  {warm_update:9.1f}  {f['update_peak_gb']:8.2f}  ({f['update_kernel']})",
                flush=True,
            )


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "CPU")


if __name__ == "__main__":
    main()
