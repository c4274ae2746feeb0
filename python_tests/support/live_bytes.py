"""What a pass allocates, counted as a GPU allocator would see it, on the CPU (whose allocator reports
no peak): ``LiveBytes``, a TorchDispatchMode that registers the storage of every tensor an op returns
(each storage once, by its Python object, which torch keeps for the storage's whole life) and drops
it when the storage is freed (a finalizer on that object), keeping the high-water mark; and
``FlashLikeAttention``, the varlen flash kernel's memory behaviour on the CPU: it keeps exactly what
the CUDA kernel keeps for its backward (queries, keys, values, the output and a float32 log-sum-exp
per head and token) and allocates what it returns (the output; the backward's query, key and value
gradients), its values computed through the per-sequence reference outside the count (the reference's
[tokens, tokens] scores are the CPU's, which the flash kernel never holds).

    with LiveBytes() as live:
        loss = model(...).sum()
        loss.backward()
    live.peak  # bytes above what existed before the ``with``

``layer_saves``: the bytes one layer saves for its backward, beyond the model's weights and the rotary
cos / sin that every layer shares (what ``memory_plan.layer_bytes`` counts).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of storages created inside the mode and still alive; ``peak``: their most at any op."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = weakref.WeakSet()

    def _dropped(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage not in self._seen:
                    self._seen.add(storage)
                    nbytes = storage.nbytes()
                    self.live += nbytes
                    weakref.finalize(storage, self._dropped, nbytes)
        self.peak = max(self.peak, self.live)
        return out


class FlashLikeAttention(torch.autograd.Function):
    """``packed._flash``'s stand-in: the reference attention's values, the flash kernel's saved tensors."""

    @staticmethod
    def forward(ctx, q, k, v, lay, scale):
        from verl_fast.models import packed

        with torch.no_grad(), _disable_current_modes():
            out = packed._reference(q, k, v, lay, scale)
        out = out.clone()  # the kernel's output, allocated inside the count
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)  # [heads, tokens], as flash's
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lay, ctx.scale = lay, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        from verl_fast.models import packed

        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad(), _disable_current_modes():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = packed._reference(q, k, v, ctx.lay, ctx.scale)
            grads = torch.autograd.grad(out, (q, k, v), grad)
        return (*(g.clone() for g in grads), None, None)  # allocated inside the count, as the kernel's


def flash_like(q, k, v, lay, scale):
    return FlashLikeAttention.apply(q, k, v, lay, scale)


@contextlib.contextmanager
def layer_saves(model: torch.nn.Module, layer: torch.nn.Module) -> Iterator[Dict[int, int]]:
    """While active, ``layer``'s forwards record each storage they save for the backward (its bytes, by its
    address) in the dict yielded, bar ``model``'s parameters and the shared rotary cos / sin."""
    static = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights: the plan's static bytes
    saved: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in static:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def forward(self, *args, **kwargs):
        # the rotary cos / sin are the model's, computed once and shared by every layer
        static.update(t.untyped_storage().data_ptr() for t in kwargs["position_embeddings"])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return type(self).forward(self, *args, **kwargs)

    layer.forward = forward.__get__(layer)
    try:
        yield saved
    finally:
        del layer.forward
