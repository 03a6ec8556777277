"""Peak memory and seconds of a packed row's passes through SDPA with a dense mask, against FlexAttention's block mask.

A micro-batch of W tokens in one row ("one row", common/layouts.py): 8 sequences of W/8 tokens each, a 64-token prompt
shared by all 8 ("shared prompts" packs it as one segment) or each with its own ("rows" of one row: --layout). The
built-in demo's tiny model (2 layers, 64 wide, 2 heads: attention is most of its work), in fp32, one process. For
each width and kernel, a fresh process runs the log-prob pass (no gradients) twice and the update's forward and
backward twice, and reports the second of each: the first includes FlexAttention's compile (torch.compile of its
kernel, per shape), reported apart as its warm-up. Peak memory: the most a pass adds to what the process held at its
start, on a GPU by the allocator's count, on the CPU by the resident set's high-water mark (common/memory.py). On the
CPU torch has no FlexAttention backward: the update takes the dense mask with both kernels there (runs_flex in
common/attention.py), and its row says so. With `--sequence-parallel N`, N processes split the row's tokens (Ulysses
over gloo, common/sequence_parallel.py) and each attends over the whole row for its share of the heads, through the
same two masks; the figures are the slowest rank's seconds and the largest rank's peak.

    python benchmarks/bench_attention.py --widths 4096 16384 32768
    python benchmarks/bench_attention.py --widths 4096 16384 32768 --sequence-parallel 2
    python benchmarks/bench_attention.py --device cuda --widths 4096 16384 32768
"""

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.attention import register, runs_flex  # noqa: E402
from common.dataproto import DataProto  # noqa: E402
from common.layouts import response_outputs  # noqa: E402
from common.log_probs import response_log_probs  # noqa: E402
from common.memory import peak_memory_gb, reset_peak_memory  # noqa: E402
from common.sequence_parallel import register as register_sequence_parallel  # noqa: E402

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


def measure(model_path: str, width: int, kernel: str, layout: str, device: torch.device, group=None) -> dict:
    """Seconds and peak memory (GiB) of each pass, the first and the second time, in this process (with `group`, this
    rank's share of the row)."""
    from transformers import AutoModelForCausalLM

    attention = register() if group is None else register_sequence_parallel()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=attention).to(device)
    batch = packed_row(width, model.config.vocab_size, layout == "shared prompts").to(device)
    packing = "one row" if layout == "rows" else layout
    flex_from = 0 if kernel == "flex" else None
    responses = batch["responses"].flatten()

    def log_probs():
        with torch.no_grad():
            return response_outputs(model.eval(), batch, packing, True, None, group, flex_from)

    def update():
        logits = response_outputs(model.train(), batch, packing, True, None, group, flex_from)
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
    parser.add_argument("--sequence-parallel", type=int, default=1, help="processes that split the row's tokens")
    parser.add_argument("--one", nargs=2, metavar=("WIDTH", "KERNEL"), help=argparse.SUPPRESS)  # a child's measurement
    parser.add_argument("--rank", nargs=2, type=int, metavar=("RANK", "PORT"), help=argparse.SUPPRESS)  # a child's place
    args = parser.parse_args()
    if args.model_path is None:
        from common import demo

        args.model_path = demo.prepare()[0]
    if args.one:
        group = None
        if args.sequence_parallel > 1:
            (rank, port), world_size = args.rank, args.sequence_parallel
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
            group = dist.group.WORLD
        figures = measure(args.model_path, int(args.one[0]), args.one[1], args.layout, torch.device(args.device), group)
        print(json.dumps(figures))
        return
    name = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    print(f"{args.layout}, {args.device}: {name}, sequence parallel: {args.sequence_parallel}")
    print("width  kernel  log-prob s  warm-up s  peak GiB  | update s  warm-up s  peak GiB  (update's kernel)")
    for width in args.widths:
        for kernel in args.kernels:
            f = run_ranks(args, width, kernel)
            if isinstance(f, str):
                print(f"{width:5d}  {kernel:6s}  failed: {f}", flush=True)
                continue
            warm_log_prob = f["log_prob_first_s"] - f["log_prob_second_s"]
            warm_update = f["update_first_s"] - f["update_second_s"]
            print(
                f"{width:5d}  {kernel:6s}  {f['log_prob_second_s']:10.3f}  {warm_log_prob:9.1f}  {f['log_prob_peak_gb']:8.2f}"
                f"  | {f['update_second_s']:8.3f}  {warm_update:9.1f}  {f['update_peak_gb']:8.2f}  ({f['update_kernel']})",
                flush=True,
            )


def run_ranks(args, width: int, kernel: str) -> dict | str:
    """One measurement in fresh processes, one per rank: the slowest rank's seconds and the largest rank's peaks (or
    why it failed)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    ranks = []
    for rank in range(args.sequence_parallel):
        command = [sys.executable, __file__, "--one", str(width), kernel, "--layout", args.layout, "--device", args.device]
        command += ["--model-path", args.model_path, "--sequence-parallel", str(args.sequence_parallel)]
        command += ["--rank", str(rank), str(port)]
        ranks.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    figures = []
    for rank in ranks:
        out, err = rank.communicate()
        if rank.returncode:
            for other in ranks:  # the others would wait for the failed rank in a collective until gloo's timeout
                other.kill()
                other.wait()
            return err.strip().splitlines()[-1] if err.strip() else f"exit {rank.returncode}"
        figures.append(json.loads(out.strip().splitlines()[-1]))
    return {name: value if isinstance(value, str) else max(f[name] for f in figures) for name, value in figures[0].items()}


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "CPU")


if __name__ == "__main__":
    main()
