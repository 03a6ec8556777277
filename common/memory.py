"""Peak memory per worker method: measured where it runs, reported by the worker (Worker.phase_peak_memory), logged by
the run as `perf/peak_memory_gb/<group>/<method>`."""

from __future__ import annotations

import functools
import os
import resource

import torch


def measured(method):
    """A worker method whose peak memory is kept under its name until phase_peak_memory reads it: from its own
    start on a GPU and on Linux, where the high-water mark can be reset (on the CPU the resident set then holds what
    the C allocator kept of the last phase's freed tensors, to reuse: it counts); elsewhere the process's peak so far."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        reset_peak_memory(self.device)
        try:
            return method(self, *args, **kwargs)
        finally:
            self.phase_peaks[method.__name__] = max(self.phase_peaks.get(method.__name__, 0.0), peak_memory_gb(self.device))

    return call


def record_peak_memory(metrics: dict, group: str, ranks: list[dict[str, float]]) -> None:
    """Put the peaks that `group`'s ranks returned from phase_peak_memory in `metrics`, as
    `perf/peak_memory_gb/<group>/<method>`: the largest over the ranks and over what `metrics` already holds."""
    for rank in ranks:
        for method, peak in rank.items():
            key = f"perf/peak_memory_gb/{group}/{method}"
            metrics[key] = max(metrics.get(key, 0.0), peak)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets the resident set's high-water mark (VmHWM)


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory on a GPU, peak resident memory of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as status:
            [kilobytes] = [line.split()[1] for line in status if line.startswith("VmHWM:")]
        return int(kilobytes) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30  # bytes on macOS
