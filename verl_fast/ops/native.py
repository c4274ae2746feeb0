"""Loads the compiled core ``verl_fast._C`` once, with a message that says what to do if it is missing."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def ext():
    try:
        from verl_fast import _C
    except ImportError as e:  # pragma: no cover - depends on how the package was installed
        raise ImportError(
            "verl_fast._C (the compiled core) is not importable: install the package with "
            "`pip install .` (a C++17 compiler and CMake >= 3.18 are needed to build it). "
            f"Cause: {e}"
        ) from e
    return _C


def cuda_stream(tensor):
    """torch's current CUDA stream of ``tensor``'s device (None on the CPU). _C takes streams only
    as torch.cuda.Stream objects, never as bare integer handles."""
    if not tensor.is_cuda:
        return None
    import torch

    return torch.cuda.current_stream(tensor.device)
