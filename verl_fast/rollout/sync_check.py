"""Which of an engine's weights differ from the actor's, by parameter group: what the sync guardrail
(``trainer/guardrails.py``) names when the engine's log-probs disagree with the actor's.

Each tensor is compared with the actor's of the same HF name: it differs when its largest error exceeds
what the engine's storage dtype can explain, ``2 * rtol(dtype) * max |actor|`` (a skipped tensor, a
transposed or permuted layout, another model's weights all exceed it by far; rounding to the engine's
dtype stays well inside). A group is a module (the name without ``.weight`` / ``.bias``)."""

from __future__ import annotations

from typing import Dict, List, Mapping

import torch

# the relative rounding error of a value stored in the dtype (half its unit in the last place, rounded up)
RTOL: Dict[torch.dtype, float] = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 2 ** -8,
                                  torch.float16: 2 ** -11, torch.float8_e4m3fn: 2 ** -4}


def group_of(name: str) -> str:
    """The module a parameter belongs to."""
    head, _, last = name.rpartition(".")
    return head if last in ("weight", "bias") and head else name


def differs(engine: torch.Tensor, actor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``engine`` (the engine's copy, dequantised where it is stored quantised; ``dtype``: how it
    is stored) is not ``actor`` rounded to ``dtype``."""
    if engine.shape != actor.shape:
        return True
    a = actor.detach().to(torch.float32)
    e = engine.detach().to(device=a.device, dtype=torch.float32)
    if not a.numel():
        return False
    bound = 2 * RTOL.get(dtype, 2 ** -8) * float(a.abs().max()) + 1e-30
    return bool(((e - a).abs().max() > bound).item()) or not bool(torch.isfinite(e).all())


def differing_groups(engine: Mapping[str, torch.Tensor], actor: Mapping[str, torch.Tensor],
                     dtype: Mapping[str, torch.dtype]) -> List[str]:
    """The groups, in the actor's order, with a tensor the engine lacks or holds different (``differs``);
    ``dtype[name]``: how the engine stores it."""
    out: List[str] = []
    for name, a in actor.items():
        e = engine.get(name)
        if e is None or differs(e, a, dtype.get(name, e.dtype)):
            group = group_of(name)
            if group not in out:
                out.append(group)
    return out
