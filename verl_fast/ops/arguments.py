"""Argument checks shared by the op wrappers, and by any room that takes sizes and flags as they do.
Messages name the argument and what was expected."""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np
import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
MASK_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def flag(x, name: str) -> bool:
    """A real bool (numpy's too): a truthy string such as 'no' must not read as True."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {x!r}")
    return bool(x)


def finite(x, name: str) -> float:
    """A finite real number (not a bool)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {x!r}")
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return float(x)


def in_range(x, name: str, low: float, high: float) -> float:
    """A finite real number in [low, high] (a discount, a mixing weight)."""
    value = finite(x, name)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {x!r}")
    return value


def positive(x, name: str) -> float:
    """A finite real number > 0 (a divisor's epsilon, a temperature)."""
    value = finite(x, name)
    if not value > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    return value


_INT64_MAX = 2**63 - 1


def size(x, name: str, minimum: int = 0) -> int:
    """An integer (numpy's too) >= ``minimum`` that fits int64; never a bool (True is not 1 here) or
    a float (2.9 is not 2)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {x!r} ({type(x).__name__})")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    if x > _INT64_MAX:
        raise ValueError(f"{name} must fit in int64 (<= 2**63 - 1), got {x}")
    return int(x)


def tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def float_2d(x, name: str) -> torch.Tensor:
    tensor(x, name)
    if x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [B, T], got shape {_shape(x.shape)}")
    float_dtype(x, name)
    return x


def float_dtype(x: torch.Tensor, name: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")


def same_shape(x, name: str, like: torch.Tensor, like_name: str) -> torch.Tensor:
    tensor(x, name)
    if tuple(x.shape) != tuple(like.shape):
        raise ValueError(
            f"{name} must have the shape of {like_name} {_shape(like.shape)}, got {_shape(x.shape)}"
        )
    if x.device != like.device:
        raise ValueError(f"{name} must be on {like_name}'s device {like.device}, got {x.device}")
    return x


def mask(x, name: str, like: torch.Tensor, like_name: str) -> torch.Tensor:
    same_shape(x, name, like, like_name)
    if x.dtype not in MASK_DTYPES:
        if x.dtype in FLOAT_DTYPES:
            return x != 0
        raise TypeError(f"{name} must be bool or an integer/float 0/1 tensor, got {x.dtype}")
    return x


def device_supported(x: torch.Tensor, name: str) -> None:
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be on the CPU or a CUDA device, got {x.device}")
