"""bf16 parameters for an unsharded actor's passes, fp32 master weights in between:
``actor.mixed_precision: bfloat16`` with ``actor.strategy: none`` (what FSDP's mixed precision does
for a sharded model).

The module's parameters stay the fp32 master weights: AdamW steps them, checkpoints and exports
read them, the rollout copies them. Around the log-prob and training passes (``active``) each
parameter's data is a bf16 copy made from its master, so the forward runs in bf16 end to end: the
residual stream, the norms' outputs and every tensor saved for the backward are half the bytes of
fp32 parameters under autocast, and no per-pass weight casts are launched. The backward leaves bf16
gradients, which ``active`` turns into fp32 ones on the masters when the passes end (gradient
accumulation over micro-batches happens in bf16 inside one ``active``; the trainer's updates open
one ``active`` per optimizer step). Measured on one H200 (benchmarks/NOTES.md, eighth run): bf16
parameters took the 0.5B update 0.29 -> 0.24 s and its peak 44.1 -> 35.0 GiB, the 1.5B update
0.69 -> 0.60 s and 99.8 -> 77.1 GiB.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

DTYPE = torch.bfloat16


class BF16Compute:
    """The bf16 copies of ``model``'s fp32 floating-point parameters, swapped in by ``active``."""

    def __init__(self, model: torch.nn.Module):
        self.params: List[torch.nn.Parameter] = [p for p in model.parameters() if p.dtype == torch.float32]
        self.copies = [torch.empty_like(p, dtype=DTYPE) for p in self.params]
        self.depth = 0  # nested actives (the old-log-prob pass inside a step) swap once

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """While active, the parameters' data are their bf16 copies, refreshed from the masters on
        entry; on exit the masters are back and any bf16 gradient becomes an fp32 one (added to an
        fp32 gradient already there)."""
        if self.depth:
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        masters = [p.data for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(self.copies, masters)
        held = [p.grad for p in self.params]  # fp32 gradients from before (None in the trainer's steps)
        for p, c in zip(self.params, self.copies):
            p.grad = None
            p.data = c
        self.depth = 1
        try:
            yield
        finally:
            self.depth = 0
            for p, master, before in zip(self.params, masters, held):
                grad = p.grad
                p.grad = None
                p.data = master
                if grad is not None:
                    grad = grad.float()
                    p.grad = grad if before is None else before.add_(grad)
                else:
                    p.grad = before
