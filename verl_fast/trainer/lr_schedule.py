"""Learning-rate schedules (``actor`` / ``critic``: ``lr_scheduler``, ``warmup_steps`` or
``warmup_ratio``, ``min_lr_ratio``), as a pure function of the training step.

The rate of step ``s`` (0-based, of ``total`` steps) is ``lr * factor(s)``:

- warm-up, ``s < W``: ``(s + 1) / W``, linear up to the full rate (the first step already learns,
  at ``lr / W``, rather than spending a rollout at rate 0);
- then, with ``p = (s - W) / (total - W)`` in [0, 1): ``constant`` 1; ``linear``
  ``1 - (1 - m) p``; ``cosine`` ``m + (1 - m) (1 + cos(pi p)) / 2``, where ``m = min_lr_ratio``
  (the rate tends to ``m * lr`` at the end, as Hugging Face's schedules tend to theirs).

``W`` is ``warmup_steps``, else ``ceil(warmup_ratio * total)``. The trainer sets each optimizer's
rate before every step from the step number alone, so a resumed run continues the schedule exactly
(nothing of it lives in the checkpoint); one training step is one point of the schedule, however
many optimiser steps (mini-batches, epochs) it takes.
"""

from __future__ import annotations

import math

import torch
from typing import Any, Optional

SCHEDULES = ("constant", "linear", "cosine")


def warmup_of(s: Any, total: int) -> int:
    """The warm-up steps of schedule settings ``s`` (an actor / critic section) over ``total`` steps."""
    return s.warmup_steps if s.warmup_steps is not None else math.ceil(s.warmup_ratio * total)


def factor(step: int, total: Optional[int], s: Any) -> float:
    """The rate of training step ``step`` (0-based) as a fraction of the section's ``lr``."""
    if s.lr_scheduler not in SCHEDULES:
        raise ValueError(f"lr_scheduler must be one of {list(SCHEDULES)}, got {s.lr_scheduler!r}")
    if total is None:
        if s.lr_scheduler == "constant" and not s.warmup_steps and not s.warmup_ratio:
            return 1.0
        raise ValueError(f"lr_scheduler={s.lr_scheduler} with warm-up or decay needs the run's length: "
                         "call fit(), or set trainer.total_steps")
    warmup = warmup_of(s, total)
    if step < warmup:
        return (step + 1) / warmup
    if s.lr_scheduler == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    m = s.min_lr_ratio
    if s.lr_scheduler == "linear":
        return 1.0 - (1.0 - m) * progress
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_rate(optimizer: Any, lr: float) -> None:
    """Every parameter group of ``optimizer`` (torch's, torchao's, or megatron-core's) at rate ``lr``;
    a rate held as a tensor (torchao's, after its first step: its compiled step reads it) is filled in place."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
