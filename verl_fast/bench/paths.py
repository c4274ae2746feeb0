"""Where the benchmarks and their results live. The suite's modules ship in the package; the GPU
campaign scripts (benchmarks/bench_*.py) are in a source checkout only."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def benchmarks_dir(start: Optional[Path] = None) -> Optional[Path]:
    """The checkout's benchmarks/ folder: the one beside the package (an editable install of a
    checkout), else the one in ``start`` (default: the current folder); None when neither exists."""
    for root in (Path(__file__).resolve().parents[2], Path(start or Path.cwd()).resolve()):
        if (root / "benchmarks" / "_common.py").is_file():
            return root / "benchmarks"
    return None


def default_out_dir() -> Path:
    """The checkout's benchmarks/results when there is a checkout, else the current folder."""
    folder = benchmarks_dir()
    return folder / "results" if folder is not None else Path.cwd()
