"""Timing and peak memory of one callable: warm-up, many runs, median and spread.

- Time: CUDA events on a GPU (the device's time between two points on the stream), else
  ``time.perf_counter`` around the call.
- Spread: the 10th and 90th percentiles and the minimum of the runs, next to the median.
- Inputs rotated beyond the cache: ``measure(fn, inputs=[...])`` calls ``fn(inputs[i % n])``; build
  the list with ``rotating(make, nbytes)`` so that together the inputs outgrow the last-level cache
  and no run finds the previous run's data there.
- Peak memory: on CUDA the allocator's peak beyond what was live before; on the CPU the process's
  peak resident set (VmHWM, reset through /proc/self/clear_refs) beyond the resident set before.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

CPU_CACHE_BYTES = 256 << 20  # larger than the last-level cache of the machines we run on
GPU_CACHE_BYTES = 256 << 20  # H200 L2 is 60 MiB


@dataclass
class Stats:
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    runs: int

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))


def _percentile(sorted_values: List[float], q: float) -> float:
    k = (len(sorted_values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize(times_ms: Sequence[float]) -> Stats:
    if not times_ms:
        raise ValueError("summarize: no timed runs")
    t = sorted(times_ms)
    return Stats(statistics.median(t), _percentile(t, 0.1), _percentile(t, 0.9), t[0], len(t))


def measure(fn: Callable[..., Any], device: str = "cpu", *, warmup: int = 3, rep: int = 20,
            max_seconds: float = 20.0, inputs: Optional[Sequence[Any]] = None,
            before: Optional[Callable[[], Any]] = None) -> Stats:
    """Times ``fn()`` (or ``fn(inputs[i % len(inputs)])``) ``rep`` times after ``warmup`` calls,
    stopping early after ``max_seconds``. ``before`` runs untimed before each timed call."""
    if rep < 1 or warmup < 0:
        raise ValueError(f"measure: rep must be >= 1 and warmup >= 0, got rep={rep}, warmup={warmup}")
    if inputs is not None and len(inputs) == 0:
        raise ValueError("measure: inputs is empty")
    call = (lambda i: fn()) if inputs is None else (lambda i: fn(inputs[i % len(inputs)]))
    for i in range(warmup):
        call(i)
    sync(device)
    cuda = str(device).startswith("cuda")
    if cuda:
        import torch
    times: List[float] = []
    deadline = time.perf_counter() + max_seconds
    for i in range(rep):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(warmup + i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call(warmup + i)
            times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() > deadline:
            break
    return summarize(times)


def rotating(make: Callable[[int], Any], nbytes: int, device: str = "cpu", at_least: int = 2) -> List[Any]:
    """Enough inputs from ``make(i)`` (each about ``nbytes``) that together they exceed the cache."""
    cache = GPU_CACHE_BYTES if str(device).startswith("cuda") else CPU_CACHE_BYTES
    count = max(at_least, -(-cache // max(int(nbytes), 1)) + 1)
    return [make(i) for i in range(count)]


def _rss_field(name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def peak_memory(fn: Callable[[], Any], device: str = "cpu") -> Optional[int]:
    """Bytes ``fn`` held at its peak beyond what was held before it (None where unmeasurable)."""
    if str(device).startswith("cuda"):
        import torch

        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    if not _reset_cpu_peak():
        return None
    before = _rss_field("VmRSS")
    fn()
    peak = _rss_field("VmHWM")
    return None if before is None or peak is None else max(0, peak - before)


def cpu_load() -> Optional[float]:
    """The 1-minute load average (what else ran beside the benchmark)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
