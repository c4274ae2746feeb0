"""Masked reductions over token tensors, as verl defines them (differentiable torch expressions:
they are used inside losses, so they stay in autograd)."""

from __future__ import annotations

from typing import Optional

import torch

from verl_fast.ops import arguments as V


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    # where() rather than values * mask: a NaN at a masked-out position must not leak into the sum.
    masked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() if axis is None else masked.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (over all positions, or along ``axis``)."""
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked positions; unbiased (n - 1) by default, which needs 2 or more of them."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if V.flag(unbiased, "unbiased"):
        n = mask.sum()
        if n < 2:
            raise ValueError(f"the unbiased masked variance needs at least 2 positions where mask is set, got {int(n)}")
        var = var * (n / (n - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) * rsqrt(var + 1e-8)`` with the masked mean and unbiased variance, applied at
    every position; ``shift_mean=False`` adds the mean back."""
    shift_mean = V.flag(shift_mean, "shift_mean")
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
