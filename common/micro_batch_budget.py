"""Micro-batches sized to the memory (--micro-batch-tokens auto, --max-memory-share).

A worker that trains is given a memory limit (keep_memory_within): a share of its GPU's memory, or on CPUs of its
host's, split among the worker processes that share it. It measures what its update holds at two token counts and
takes as its micro-batch token budget the largest that the line through them keeps within the limit
(fit_micro_batch_tokens, MemoryBudget.fit). A mini-batch that still runs out of memory is done again, once, at half the
budget, which stays (MemoryBudget.within).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from common.dataproto import DataProto
from common.memory import machine_memory_bytes, peak_memory_gb, restart_peak_memory

GRANULE = 64  # a fitted budget is a whole number of this many tokens
# The memory per token counted higher than measured: an update's micro-batches, one after another, held 1.2 to 1.65
# times what one probe measured per token on the CPU (the allocator's fragmentation; the script's loss holds tensors
# of its own per token, which the probe's plain sum of the outputs does not).
PER_TOKEN_MARGIN = 2.0


def memory_limit_bytes(device: torch.device, share: float, processes: int) -> int:
    """`share` of a GPU's memory, or of the host's on a CPU, split evenly among the `processes` that share it."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else machine_memory_bytes()
    return int(share * total / processes)


def token_budget(probes: list[tuple[int, float]], available: float) -> tuple[float, float, float]:
    """The tokens a micro-batch may hold for its forward and backward to peak at `available` bytes, by the line
    through `probes` (two passes' tokens and peak bytes), its slope raised by PER_TOKEN_MARGIN; and the line's fixed
    part and slope."""
    (short, short_peak), (long, long_peak) = probes
    per_token = (long_peak - short_peak) / (long - short)
    if per_token <= 0:  # activations too small to show beside the resident set's noise: all of the peak counts as theirs
        per_token = long_peak / long
    fixed = long_peak - per_token * long
    return (available - fixed) / (per_token * PER_TOKEN_MARGIN), fixed, per_token


def made_up_sequence(vocab_size: int, prompt_length: int, response_length: int) -> DataProto:
    """One sequence of random tokens, `prompt_length` of prompt and `response_length` of response, none of them padding."""
    length = prompt_length + response_length
    input_ids = torch.randint(vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(length)[None],
            "responses": input_ids[:, prompt_length:],
        }
    )


class MemoryBudget:
    """A worker's micro-batch token budget and the memory its updates keep within: the state and its rules. The worker
    (FSDPWorker) runs the passes: it measures two of them for `fit`, and hands each mini-batch's gradients to `within`.
    `largest_over_ranks(value)`: the largest of the ranks' values, in one collective; `name`: the worker's kind, as its
    messages name it."""

    def __init__(self, tokens: int, device: torch.device, largest_over_ranks, name: str):
        self.tokens = tokens  # a micro-batch's tokens at most; 0: sequences are counted (micro_batch_size)
        self.limit: int | None = None  # bytes; None: no limit kept (a budget given as a number, or sequences counted)
        self.retries = 0  # mini-batches done again at half the budget since the last report
        self.device, self.largest_over_ranks, self.name = device, largest_over_ranks, name

    def keep_within(self, share: float, colocated: int, world_size: int) -> int:
        """From now on, keep updates within `share` of the GPU's memory, or on CPUs of the host's, split evenly among
        the worker processes that share it: the ranks of the `colocated` worker groups on this GPU, or on this host
        (this group's `world_size` ranks there, found by host name, times `colocated`). Returns the limit in bytes."""
        hosts = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname())
        processes = colocated * (1 if self.device.type == "cuda" else hosts.count(socket.gethostname()))
        self.limit = memory_limit_bytes(self.device, share, processes)
        return self.limit

    def fit(self, probes: list[tuple[int, float]], optimizer_bytes: float, longest: int) -> dict[str, float]:
        """Set the budget to the most tokens, in GRANULEs, that the line through `probes` (two passes' tokens and peak
        bytes) keeps within the limit beside `optimizer_bytes`, the smallest over the ranks, and at least one `longest`
        sequence. Returns it with the limit and the line, in tokens and bytes."""
        tokens, fixed, per_token = token_budget(probes, self.limit - optimizer_bytes)
        tokens = -self.largest_over_ranks(-tokens)
        if tokens < longest:
            needs = (fixed + optimizer_bytes + per_token * PER_TOKEN_MARGIN * longest) / 2**30
            raise ValueError(self.does_not_fit(longest, f"needs about {needs:.2f} GB"))
        self.tokens = max(longest, int(tokens) // GRANULE * GRANULE)
        measured = dict(fixed_bytes=fixed, per_token_bytes=per_token, optimizer_bytes=optimizer_bytes)
        return dict(tokens=self.tokens, limit_bytes=self.limit, **measured)

    def does_not_fit(self, longest: int, what: str) -> str:
        return (
            f"--micro-batch-tokens auto: an update of one sequence of --max-prompt-length + --max-response-length = "
            f"{longest} tokens {what}, more than the {self.limit / 2**30:.2f} GB a worker may use: raise "
            "--max-memory-share, lower those lengths, or pass --gradient-checkpointing"
        )

    def within(self, accumulate, drop_gradients, speaks: bool) -> dict:
        """`accumulate()`: a mini-batch's gradients accumulated over its micro-batches, and its loss shares. Where a
        limit is kept and a rank runs out (see _attempt), every rank drops its gradients (`drop_gradients()`) and
        accumulates the mini-batch again, once, at half the token budget, which stays from then on; running out again
        raises. The rank that `speaks` says so.

        The ranks agree in one collective after the mini-batch: they must fail together. On the CPU they do; on GPUs
        a rank that runs out inside a forward leaves the others waiting in that forward's collectives, unless it was
        alone (one GPU)."""
        if self.limit is None:
            return accumulate()
        shares, error = self._attempt(accumulate)
        if not self.largest_over_ranks(float(error is not None)):
            return shares
        drop_gradients()
        budget, self.tokens = self.tokens, max(1, self.tokens // 2)
        self.retries += 1
        if speaks:
            print(
                f"{self.name}: out of memory with micro-batches of {budget} tokens ({error or 'on another rank'}); "
                f"the mini-batch again at {self.tokens} tokens, the budget from now on",
                flush=True,
            )
        shares, error = self._attempt(accumulate, again=True)
        if self.largest_over_ranks(float(error is not None)):
            raise error or torch.OutOfMemoryError(f"another rank ran out of memory at {self.tokens} tokens too")
        return shares

    def _attempt(self, accumulate, again: bool = False) -> tuple[dict | None, torch.OutOfMemoryError | None]:
        """`accumulate()`'s result, or why it ran out of memory: on a GPU the allocator's error. On the CPU nothing
        fails at a limit: the host runs out for every process at once, and its out-of-memory killer ends one without
        an error to catch. So the worker holds itself to its share: a resident set that peaked over it ran out. That
        set holds what the C allocator kept of freed tensors for reuse, which counts, as it is this process's; but
        `again`, or where those pages alone are over the limit, they are given back first (see restart_peak_memory):
        what the mini-batch holds is measured, not what came before it."""
        restart_peak_memory(self.device, live_only=again)
        if peak_memory_gb(self.device) * 2**30 > self.limit:  # the resident set as it starts
            restart_peak_memory(self.device, live_only=True)
        try:
            shares = accumulate()
        except torch.OutOfMemoryError as error:
            return None, error.with_traceback(None)  # its frames hold the micro-batches' activations
        peak = peak_memory_gb(self.device) * 2**30
        if self.device.type == "cpu" and peak > self.limit:
            limit = self.limit / 2**30
            over = f"the resident set peaked at {peak / 2**30:.2f} GB, over the {limit:.2f} GB a worker may use"
            return None, torch.OutOfMemoryError(over)
        return shares, None

    def metrics(self) -> dict[str, float]:
        """The token budget now and the mini-batches done again since the last call, where a limit is kept."""
        if self.limit is None:
            return {}
        retries, self.retries = self.retries, 0
        return {"micro_batch_tokens": float(self.tokens), "memory_retries": float(retries)}
