"""bf16 parameters for an unsharded actor's passes, fp32 master weights in between:
``actor.mixed_precision: bfloat16`` with ``actor.strategy: none`` (what FSDP's mixed precision does
for a sharded model).

The module's parameters stay the fp32 master weights: AdamW steps them, checkpoints and exports
read them, the rollout copies them. Around the log-prob and training passes (``active``) each
parameter's data is a bf16 copy made from its master, so the forward runs in bf16 end to end: the
residual stream, the norms and what they keep for the backward are bf16 where fp32 weights under
autocast leave them fp32, and no per-pass weight casts are launched. The backward leaves bf16
gradients, which ``accumulate`` (after each micro-batch) and the end of ``active`` add up in fp32 on
the masters. The update's time and peak memory against fp32 passes and against bf16 weights without
masters (the bound): docs/benchmarks.md, "Measurements behind the code's choices".

A LoRA actor's frozen base needs no master: nothing steps it, and its passes only ever use it as
autocast's bf16 casts. ``freeze_in_bf16`` keeps those weights in bf16 for good (half their memory, no
per-pass casts, a bf16 residual stream); the adapters stay fp32 and train under autocast.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

DTYPE = torch.bfloat16


def freeze_in_bf16(model: torch.nn.Module) -> None:
    """``model``'s frozen fp32 floating-point parameters cast to bf16 in place (LoRA's base). Their
    matrices' products are the ones autocast computed from them (it casts each to bf16 for the GEMM);
    the norms' and embeddings' values are rounded to bf16."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.dtype == torch.float32:
                p.data = p.data.to(DTYPE)


class BF16Compute:
    """The bf16 copies of ``model``'s fp32 floating-point parameters, swapped in by ``active``."""

    def __init__(self, model: torch.nn.Module):
        self.params: List[torch.nn.Parameter] = [p for p in model.parameters() if p.dtype == torch.float32]
        self.copies = [torch.empty_like(p, dtype=DTYPE) for p in self.params]
        self.sums: List = []  # while active: each parameter's fp32 gradient so far (or None)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """While active, the parameters' data are their bf16 copies, refreshed from the masters on
        entry; on exit the masters are back, their gradients the fp32 sums of the passes' (added to
        an fp32 gradient already there). A body that raises leaves the masters back and the passes'
        gradients unsummed (the caller drops them: an out-of-memory step, ``trainer/updates.py``)."""
        masters = [p.data for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(self.copies, masters)
        self.sums = [p.grad for p in self.params]  # fp32 gradients from before (None in the trainer's steps)
        for p, c in zip(self.params, self.copies):
            p.grad = None
            p.data = c
        failed = True
        try:
            yield
            failed = False
        finally:
            try:
                if not failed:  # summing allocates fp32 gradients: not while a failed pass still holds its memory
                    self.accumulate()
            finally:
                for p, master, total in zip(self.params, masters, self.sums):
                    p.data = master
                    p.grad = None if failed else total
                self.sums = []

    def accumulate(self) -> None:
        """Adds the bf16 gradients left by the backward passes so far to the fp32 sums: call it after
        each micro-batch's backward, so that micro-batches add up in fp32 as they do under autocast."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.sums[i] is None:
                self.sums[i] = p.grad.float()
            else:  # the bf16 gradient added into the fp32 sum as it is read: no fp32 temporary
                self.sums[i].add_(p.grad)
            p.grad = None
