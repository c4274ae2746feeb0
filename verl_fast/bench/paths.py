"""Where the benchmark scripts and their results live."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def benchmarks_dir() -> Path:
    """The bench_*.py scripts: shipped in the wheel as verl_fast/benchmarks, or the repository's
    benchmarks/ folder beside the package (an editable install)."""
    spec = importlib.util.find_spec("verl_fast.benchmarks")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if Path(folder, "_common.py").is_file():
            return Path(folder)
    repo = Path(__file__).resolve().parents[2] / "benchmarks"
    if (repo / "_common.py").is_file():
        return repo
    raise FileNotFoundError("the benchmark scripts are missing: neither verl_fast/benchmarks (wheel) nor the "
                            f"repository's benchmarks/ ({repo}) holds _common.py")


def default_out_dir() -> Path:
    return benchmarks_dir() / "results"
