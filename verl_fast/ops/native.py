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


# torch.cuda.Stream objects by (device index, raw handle): torch.cuda.current_stream() builds a new
# object each call (microseconds of Python); the raw handle is one C call. An entry is only ever
# used for the very handle it wraps, so a handle reused by another stream stays correct.
_STREAMS: dict = {}
_MAX_STREAMS = 256


def cuda_stream(tensor):
    """torch's current CUDA stream of ``tensor``'s device (None on the CPU). _C takes streams only
    as torch.cuda.Stream objects, never as bare integer handles."""
    if not tensor.is_cuda:
        return None
    import torch

    index = tensor.get_device()
    key = (index, stream_handle(index))
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= _MAX_STREAMS:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(tensor.device)
    return stream


def stream_handle(index: int) -> int:
    """The raw handle of torch's current CUDA stream on device ``index`` (for keys, never for _C)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # a torch without it: the public call
        return torch.cuda.current_stream(index).cuda_stream
    return raw(index)
