"""A LoRA-adapted linear layer's forward and backward as GEMMs only, for the training passes.

peft's forward is ``base(x) + lora_B(lora_A(x)) * s``: besides the three products it writes the
adapter's [T, out] output, reads and writes it again for the scale, and reads both outputs and writes
their sum; its backward repeats the scale over the gradient and adds the two input gradients in a pass
of their own. With ``u = s * x A^T`` ([T, r], r the rank) the same function is

    y = x W^T + (u B^T + bias)                      one ``addmm``: the adapter's output enters the base
                                                     product as its accumulator (the epilogue reads it)
    dx = g W + (s * g B) A                          one ``addmm`` again
    dA = (s * g B)^T x,   dB = g^T u                two products over the rank

so the [T, out] and [T, in] tensors are written once each and read inside the GEMMs that need them
(the base products are compute-bound: the extra read hides under them). Per adapted layer and token
that is ~8 x out bytes less traffic each way (at the Qwen2.5-7B shape ~11 MB a token over its 196
layers, forward). ``fused(model)`` installs this forward on every peft ``lora.Linear`` of ``model``
for the duration; a layer it does not cover (merged, adapters off, more than one active adapter, a
LoRA variant such as DoRA, dropout, ``fan_in_fan_out``, a lora bias, extra arguments) runs peft's own.
``FUSED`` switches it on for the trainer's passes: on, the faster at the Qwen2.5-7B shape with r 64
(docs/benchmarks.md; ``bench_e2e.py --lora-peft`` runs peft's).
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator, Optional

import torch

FUSED = True


class _LoraLinear(torch.autograd.Function):
    """``x W^T + bias + s (x A^T) B^T`` and its gradients (module docstring); every input in one dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scale: float):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        u = (x2 @ a.t()).mul_(scale)
        low = u @ b.t() if bias is None else torch.addmm(bias, u, b.t())
        y = torch.addmm(low, x2, weight.t())
        ctx.save_for_backward(x2, u, weight, a, b)
        ctx.scale, ctx.shape = scale, shape
        return y.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x2, u, weight, a, b = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        need_x, need_w, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        gb = (g2 @ b).mul_(ctx.scale) if need_x or need_a else None
        dx = torch.addmm(gb @ a, g2, weight).reshape(ctx.shape) if need_x else None
        dw = g2.t() @ x2 if need_w else None  # a frozen base (LoRA's) asks for none
        dbias = g2.sum(0) if need_bias else None
        da = gb.t() @ x2 if need_a else None
        db = g2.t() @ u if need_b else None
        return dx, dw, dbias, da, db, None


def _adapter(layer) -> Optional[str]:
    """The one active adapter of peft ``lora.Linear`` ``layer`` that the fused forward computes exactly
    as peft does, or None (peft's own forward then)."""
    if layer.merged or layer.disable_adapters or getattr(layer, "fan_in_fan_out", False):
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if (name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name)
            or getattr(layer, "lora_bias", {}).get(name)
            or not isinstance(layer.lora_dropout[name], torch.nn.Identity)):
        return None
    if not isinstance(layer.base_layer, torch.nn.Linear):
        return None
    return name


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft ``lora.Linear.forward`` through ``_LoraLinear`` where ``_adapter`` allows (bound per layer)."""
    name = None if args or kwargs else _adapter(self)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base, a, b = self.base_layer, self.lora_A[name].weight, self.lora_B[name].weight
    device = x.device.type
    # the dtype autocast would give the products; the inputs cast to it here, then autocast left out of
    # the Function, whose backward must see the same dtypes
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    cast = [t if t is None or t.dtype == dtype else t.to(dtype) for t in (x, base.weight, base.bias, a, b)]
    with torch.autocast(device, enabled=False):
        return _LoraLinear.apply(*cast, float(self.scaling[name]))


@contextlib.contextmanager
def fused(model: torch.nn.Module, on: bool = True) -> Iterator[None]:
    """Within the block, every peft ``lora.Linear`` of ``model`` runs the fused forward (module
    docstring); ``on=False`` changes nothing."""
    layers = []
    if on:
        try:
            from peft.tuners.lora import Linear as LoraLinear
        except ImportError:  # no peft: no adapters to fuse
            LoraLinear = ()
        layers = [m for m in model.modules() if isinstance(m, LoraLinear) and "forward" not in vars(m)]
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
