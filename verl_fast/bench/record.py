"""One benchmark's record: timing helpers, measured ceilings, its rows and floors, its table and JSON.

Every benchmark times its baselines and ours in the same process, puts the floor beside them, and
saves a JSON record (device, versions, shapes) in ``results_dir()``: ``$VF_BENCH_RESULTS`` (where
`verl-fast bench` collects each op's records) else the default results folder (paths.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from verl_fast.bench.paths import default_out_dir
from verl_fast.bench.report import device_name, environment as report_environment
from verl_fast.bench.timing import Stats, measure, peak_memory


def results_dir() -> Path:
    return Path(os.environ["VF_BENCH_RESULTS"]) if os.environ.get("VF_BENCH_RESULTS") else default_out_dir()


def environment(device: str) -> Dict[str, object]:
    """Device name, versions, load average and torch's thread count (saved with every report)."""
    return {**report_environment(device), "torch_threads": torch.get_num_threads()}


class Ms(float):
    """A median time in milliseconds that also carries the runs' spread (``.stats``)."""

    stats: Optional[Stats] = None


def time_ms(fn: Callable[[], object], device: str, *, warmup: int = 3, rep: int = 10,
            max_seconds: float = 20.0, busy_gpu: bool = False) -> Ms:
    """Median wall time of ``fn`` in milliseconds (CUDA events on a GPU), with its spread attached.

    ``busy_gpu``: before each timed call, queue a 1 GiB fill (longer than a small op's launch), so the GPU
    is busy while the host runs ``fn``'s Python and launches -- as in a training step, where the host
    runs ahead of the GPU -- and L2 holds none of the inputs (Triton's do_bench does the same). The
    time is then the call's GPU time plus whatever host time the fill did not cover (a host sync
    inside ``fn`` still shows)."""
    filler = torch.empty(256 << 20, dtype=torch.int32, device=device) if busy_gpu and device.startswith("cuda") else None
    stats = measure(fn, device, warmup=warmup, rep=rep, max_seconds=max_seconds,
                    before=(lambda: filler.fill_(0)) if filler is not None else None)
    ms = Ms(stats.median_ms)
    ms.stats = stats
    return ms


def peak_extra_bytes(fn: Callable[[], object], device: str) -> Optional[int]:
    """Peak device memory ``fn`` allocates beyond what was live before it (CUDA only)."""
    if not device.startswith("cuda"):
        return None
    return peak_memory(fn, device)


def hbm_bytes_per_s() -> float:
    """The current GPU's memory bandwidth as its maker states it (H100 SXM 3.35 TB/s, H200 4.8 TB/s)."""
    return 3.35e12 if "H100" in torch.cuda.get_device_name() else 4.8e12


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 30) -> float:
    """Measured device-memory bandwidth in GB/s, counting bytes read plus bytes written."""
    n = nbytes // 4 if device.startswith("cuda") else (64 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, rep=20)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


@dataclass
class Row:
    case: str
    impl: str
    ms: float
    extra_bytes: Optional[int] = None
    max_err: Optional[float] = None
    note: str = ""
    spread: Optional[Dict[str, float]] = None  # p10 / p90 / min / runs of the timed runs, when known


@dataclass
class Report:
    name: str
    device: str
    rows: List[Row] = field(default_factory=list)
    floors: Dict[str, float] = field(default_factory=dict)  # case -> floor ms
    meta: Dict[str, object] = field(default_factory=dict)

    def add(self, *args, **kwargs) -> Row:
        row = Row(*args, **kwargs)
        stats = getattr(row.ms, "stats", None)
        if row.spread is None and stats is not None:
            row.spread = stats.as_dict()
        row.ms = float(row.ms)
        self.rows.append(row)
        return row

    def table(self) -> str:
        lines = [f"{self.name} on {device_name(self.device)}",
                 f"{'case':<28} {'impl':<26} {'ms':>10} {'x ours':>9} {'/floor':>8} {'extra MiB':>10} {'max err':>9}"]
        ours = {r.case: r.ms for r in self.rows if r.impl.startswith("verl_fast")}
        for r in self.rows:
            speed = ours.get(r.case)
            ratio = f"{r.ms / speed:8.1f}x" if speed and not r.impl.startswith("verl_fast") else ""
            floor = self.floors.get(r.case)
            over = f"{r.ms / floor:7.2f}x" if floor else ""
            mem = f"{r.extra_bytes / 2**20:10.1f}" if r.extra_bytes is not None else ""
            err = f"{r.max_err:9.1e}" if r.max_err is not None else ""
            lines.append(f"{r.case:<28} {r.impl:<26} {r.ms:10.4f} {ratio:>9} {over:>8} {mem:>10} {err:>9}")
        for case, floor in self.floors.items():
            lines.append(f"{case:<28} {'floor':<26} {floor:10.4f}")
        return "\n".join(lines)

    def save(self, summary: bool = True) -> Path:
        """The JSON under results/ (written again on every call); ``summary``: the table added to
        gpu_run.sh's summary as well."""
        folder = results_dir()
        folder.mkdir(parents=True, exist_ok=True)
        tag = "cuda" if self.device.startswith("cuda") else "cpu"
        path = folder / f"{self.name}_{tag}.json"
        record = {"name": self.name, "environment": environment(self.device), "floors_ms": self.floors,
                  "meta": self.meta, "rows": [asdict(r) for r in self.rows],
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path.write_text(json.dumps(record, indent=2) + "\n")
        collected = os.environ.get("VF_BENCH_SUMMARY")  # gpu_run.sh collects every table here
        if summary and collected:
            with open(collected, "a") as f:
                f.write(self.table() + "\n\n")
        return path
