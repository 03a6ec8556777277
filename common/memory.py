"""Peak memory per worker method: measured where it runs, reported by the worker (Worker.phase_peak_memory), logged by
the run as `perf/peak_memory_gb/<group>/<method>`; and the peak of a part of a method (restart_peak_memory), which a
worker keeps within its memory limit (common/micro_batch_budget.py)."""

from __future__ import annotations

import ctypes
import functools
import os
import resource

import torch


def machine_memory_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
            peak = max(self.phase_peaks.get(method.__name__, 0.0), peak_memory_gb(self.device), _peak_before_restart_gb)
            self.phase_peaks[method.__name__] = peak

    return call


def record_peak_memory(metrics: dict, group: str, ranks: list[dict[str, float]]) -> None:
    """Put the peaks that `group`'s ranks returned from phase_peak_memory in `metrics`, as
    `perf/peak_memory_gb/<group>/<method>`: the largest over the ranks and over what `metrics` already holds."""
    for rank in ranks:
        for method, peak in rank.items():
            key = f"perf/peak_memory_gb/{group}/{method}"
            metrics[key] = max(metrics.get(key, 0.0), peak)


_peak_before_restart_gb = 0.0  # the peak of the method under way before restart_peak_memory: still its peak


def reset_peak_memory(device: torch.device) -> None:
    global _peak_before_restart_gb
    _peak_before_restart_gb = 0.0
    _reset_peak(device)


def restart_peak_memory(device: torch.device, live_only: bool = False) -> None:
    """Measure the peak of what comes next alone (peak_memory_gb), while the peak so far still counts as the method's
    (measured). With `live_only`, on the CPU the C allocator first gives back the pages it kept of freed tensors, so
    that the resident set holds live memory only; it costs the next pass page faults on memory touched anew (see
    docs/performance.md), so only where what came before must not count."""
    global _peak_before_restart_gb
    _peak_before_restart_gb = max(_peak_before_restart_gb, peak_memory_gb(device))
    if live_only and device.type == "cpu":
        _release_freed_memory()
    _reset_peak(device)


def _release_freed_memory() -> None:
    """Give back to the system the memory that glibc's allocator holds of freed tensors (malloc_trim); elsewhere
    nothing to do."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _reset_peak(device: torch.device) -> None:
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
