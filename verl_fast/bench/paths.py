"""Where the benchmark scripts and their results live: the source checkout's benchmarks/ folder
(the wheel ships the library only)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

MISSING = ("verl-fast bench runs the benchmark scripts of a source checkout (benchmarks/bench_*.py), and none "
           "is beside this install or in the current folder: run it from a clone of the repository")


def benchmarks_dir(start: Optional[Path] = None) -> Path:
    """The bench_*.py scripts: the benchmarks/ folder beside the package (an editable install of a
    checkout), else the one in ``start`` (default: the current folder). Raises SystemExit with one
    line when neither holds them."""
    for root in (Path(__file__).resolve().parents[2], Path(start or Path.cwd()).resolve()):
        if (root / "benchmarks" / "_common.py").is_file():
            return root / "benchmarks"
    raise SystemExit(MISSING)


def default_out_dir() -> Path:
    return benchmarks_dir() / "results"
