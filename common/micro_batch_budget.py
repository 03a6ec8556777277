"""Micro-batches sized to the memory (--micro-batch-tokens auto, --max-memory-share).

A worker that trains is given a memory limit (keep_memory_within): a share of its GPU's memory, or on CPUs of its
host's, split among the worker processes that share it. It measures what its update holds at two token counts and
takes as its micro-batch token budget the largest that the line through them keeps within the limit
(fit_micro_batch_tokens). A mini-batch that still runs out of memory is done again, once, at half the budget, which
stays (_within_memory).
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
    """What an FSDPWorker does to size its micro-batches to its memory and keep its updates within it. The worker's
    `_update_forward(micro_batch)` gives the outputs its update's loss takes."""

    memory_limit: int | None = None  # bytes; None: no limit kept (a budget given as a number, or sequences counted)
    memory_retries = 0  # mini-batches done again at half the budget since the last report

    def keep_memory_within(self, share: float, colocated: int) -> int:
        """From now on, keep updates within `share` of the GPU's memory, or on CPUs of the host's, split evenly among
        the worker processes that share it: the ranks of the `colocated` worker groups on this GPU, or on this host
        (this group's ranks there, found by host name, times `colocated`). Returns the limit in bytes."""
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        processes = colocated * (1 if self.device.type == "cuda" else hosts.count(socket.gethostname()))
        self.memory_limit = memory_limit_bytes(self.device, share, processes)
        return self.memory_limit

    def fit_micro_batch_tokens(self, max_prompt_length: int, max_response_length: int) -> dict[str, float]:
        """Set the micro-batch token budget to the most tokens, in GRANULEs, whose update keeps within the memory
        limit (keep_memory_within), and at least one sequence of the longest prompt and response. Measured from a
        forward and backward (the outputs' sum as the loss) over a made-up sequence half that long, then one that
        long: no optimiser step, and the gradients dropped after each. AdamW's state, made at its first step, and its
        step's temporaries count as three copies of the trainable weights. Every rank takes the smallest of the
        ranks' budgets; rank 0 prints it. Returns this rank's budget and measurements, in tokens and bytes."""
        longest = max_prompt_length + max_response_length
        # Rows as wide as the longest sequence, whatever setup was told; decided first, so that what the block masks'
        # check leaves in memory (FlexAttention's compiled kernels) is in the measurement
        self.set_up_block_masks(longest)
        vocab_size = self.model.config.vocab_size
        half = made_up_sequence(vocab_size, max(1, max_prompt_length // 2), max(1, max_response_length // 2))
        whole = made_up_sequence(vocab_size, max_prompt_length, max_response_length)
        try:
            self._probe_peak(half)  # what a first pass makes once (FSDP's buffers, autograd's threads) is no activation
            probes = [(half["input_ids"].shape[1], self._probe_peak(half)), (longest, self._probe_peak(whole))]
        except torch.OutOfMemoryError as error:
            raise ValueError(self._does_not_fit(longest, "ran out of the GPU's memory")) from error
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        weight_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in trainable)
        # AdamW's two moments once it has stepped, and its step's foreach temporaries, about one more copy.
        optimizer_bytes = (0 if self.optimizer.state else 2 * weight_bytes) + weight_bytes
        tokens, fixed, per_token = token_budget(probes, self.memory_limit - optimizer_bytes)
        tokens = -self._all_reduce_max(-tokens)
        if tokens < longest:
            needs = (fixed + optimizer_bytes + per_token * PER_TOKEN_MARGIN * longest) / 2**30
            raise ValueError(self._does_not_fit(longest, f"needs about {needs:.2f} GB"))
        self.micro_batch_tokens = max(longest, int(tokens) // GRANULE * GRANULE)
        if self.rank == 0:
            print(
                f"{type(self).__name__}: micro-batches of at most {self.micro_batch_tokens} tokens (--micro-batch-tokens "
                f"auto): an update measured {fixed / 2**30:.2f} GB + {per_token / 2**20:.3f} MB per token, with "
                f"{optimizer_bytes / 2**30:.2f} GB for the optimiser, within {self.memory_limit / 2**30:.2f} GB a worker; "
                f"attention: {self.attention_kernel}",
                flush=True,
            )
        measured = dict(fixed_bytes=fixed, per_token_bytes=per_token, optimizer_bytes=optimizer_bytes)
        return dict(tokens=self.micro_batch_tokens, limit_bytes=self.memory_limit, **measured)

    def _does_not_fit(self, longest: int, what: str) -> str:
        return (
            f"--micro-batch-tokens auto: an update of one sequence of --max-prompt-length + --max-response-length = "
            f"{longest} tokens {what}, more than the {self.memory_limit / 2**30:.2f} GB a worker may use: raise "
            "--max-memory-share, lower those lengths, or pass --gradient-checkpointing"
        )

    def _probe_peak(self, sequence: DataProto) -> float:
        """The peak bytes of one forward and backward of the update over `sequence`; its gradients are then dropped."""
        self.model.train()
        restart_peak_memory(self.device, live_only=True)
        outputs = self._update_forward(sequence.to(self.device))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        sum(output.float().sum() for output in outputs if output is not None).backward()
        peak = peak_memory_gb(self.device) * 2**30
        self.model.zero_grad(set_to_none=True)
        self.model.reshard()
        return peak

    def _within_memory(self, accumulate) -> dict:
        """`accumulate()`: a mini-batch's gradients accumulated over its micro-batches, and its loss shares. Where the
        worker keeps a memory limit and a rank runs out (see _attempt), every rank drops its gradients and accumulates
        the mini-batch again, once, at half the token budget, which stays from then on; running out again raises.

        The ranks agree in one collective after the mini-batch: they must fail together. On the CPU they do; on GPUs
        a rank that runs out inside a forward leaves the others waiting in that forward's collectives, unless it was
        alone (one GPU)."""
        if self.memory_limit is None:
            return accumulate()
        shares, error = self._attempt(accumulate)
        if not self._all_reduce_max(float(error is not None)):
            return shares
        from torch.distributed.fsdp import FSDPModule

        self.optimizer.zero_grad(set_to_none=True)
        for module in self.model.modules():  # a pass cut short leaves its units gathered
            if isinstance(module, FSDPModule):
                module.reshard()
        budget, self.micro_batch_tokens = self.micro_batch_tokens, max(1, self.micro_batch_tokens // 2)
        self.memory_retries += 1
        if self.rank == 0:
            print(
                f"{type(self).__name__}: out of memory with micro-batches of {budget} tokens ({error or 'on another rank'}); "
                f"the mini-batch again at {self.micro_batch_tokens} tokens, the budget from now on",
                flush=True,
            )
        shares, error = self._attempt(accumulate, again=True)
        if self._all_reduce_max(float(error is not None)):
            raise error or torch.OutOfMemoryError(f"another rank ran out of memory at {self.micro_batch_tokens} tokens too")
        return shares

    def _attempt(self, accumulate, again: bool = False) -> tuple[dict | None, torch.OutOfMemoryError | None]:
        """`accumulate()`'s result, or why it ran out of memory: on a GPU the allocator's error. On the CPU nothing
        fails at a limit: the host runs out for every process at once, and its out-of-memory killer ends one without
        an error to catch. So the worker holds itself to its share: a resident set that peaked over it ran out. That
        set holds what the C allocator kept of freed tensors for reuse, which counts, as it is this process's; but
        `again`, or where those pages alone are over the limit, they are given back first (see restart_peak_memory):
        what the mini-batch holds is measured, not what came before it."""
        restart_peak_memory(self.device, live_only=again)
        if peak_memory_gb(self.device) * 2**30 > self.memory_limit:  # the resident set as it starts
            restart_peak_memory(self.device, live_only=True)
        try:
            shares = accumulate()
        except torch.OutOfMemoryError as error:
            return None, error.with_traceback(None)  # its frames hold the micro-batches' activations
        peak = peak_memory_gb(self.device) * 2**30
        if self.device.type == "cpu" and peak > self.memory_limit:
            limit = self.memory_limit / 2**30
            over = f"the resident set peaked at {peak / 2**30:.2f} GB, over the {limit:.2f} GB a worker may use"
            return None, torch.OutOfMemoryError(over)
        return shares, None

    def _memory_metrics(self) -> dict[str, float]:
        """The token budget now and the mini-batches done again since the last call, where the worker keeps a limit."""
        if self.memory_limit is None:
            return {}
        retries, self.memory_retries = self.memory_retries, 0
        return {"micro_batch_tokens": float(self.micro_batch_tokens), "memory_retries": float(retries)}
