"""The two autograd Functions of the log-prob ops, shared by the Triton kernels and the chunked torch path.

Each Function takes an implementation (a pair of launchers) as a non-tensor argument, so the
bookkeeping -- what is saved, how partial statistics are merged across vocabulary splits and
tensor-parallel ranks, which gradients are asked for -- is written once. Only ``lse`` and the
entropy (fp32, one number per token) are saved besides the inputs: the backward recomputes what
it needs from the logits (or from hidden @ weight^T), so extra memory stays O(tokens).

Gradients, with z = logits / T, p = softmax(z), H = -sum p log p:
    d logp / dz_v = [v == label] - p_v
    d H    / dz_v = -p_v (z_v - lse + H)
and d/dlogits = (d/dz) / T.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from verl_fast.kernels.softmax_stats import finalize, merge, merge_across, vocab_shard


@contextlib.contextmanager
def _switched(x: torch.Tensor):
    with torch.autocast(device_type=x.device.type, enabled=False):
        if x.device.type == "cuda":
            with torch.cuda.device(x.device):
                yield
        else:
            yield


_UNCHANGED = contextlib.nullcontext()


def _as_implemented(x: torch.Tensor):
    """On x's device (Triton launches on the current CUDA device), without autocast: the
    implementations choose their own precisions (fp32 statistics, input-dtype GEMMs). Nothing to
    switch in the usual case (autocast off, x on the current device): no context entered."""
    device = x.device
    if torch.is_autocast_enabled(device.type) or (device.type == "cuda" and device.index != torch.cuda.current_device()):
        return _switched(x)
    return _UNCHANGED


class Impl(NamedTuple):
    forward: Callable
    backward: Callable


class LogprobsFunction(torch.autograd.Function):
    """logits [B, T, V] (any strides), labels [B*T] -> (logp [B*T], entropy [B*T] or None), fp32."""

    @staticmethod
    def forward(ctx, logits, labels, inv_t, with_entropy, impl):
        with _as_implemented(logits):
            logp, entropy, lse = impl.forward(logits, labels, inv_t, with_entropy)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.inv_t, ctx.impl = inv_t, impl
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        if g_logp is None and g_entropy is None or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        with _as_implemented(logits):
            d_logits = ctx.impl.backward(logits, labels, lse, entropy, g_logp, g_entropy, ctx.inv_t)
        return d_logits, None, None, None, None


class LinearLogprobsFunction(torch.autograd.Function):
    """hidden [N, H], weight [V, H] (this rank's vocabulary shard), bias [V] or None, labels [N]
    (global ids) -> (logp [N], entropy [N] or None), fp32; gradients to hidden, weight and bias."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, with_entropy, tp_group, impl):
        vocab_start, _ = vocab_shard(tp_group, weight.shape[0])
        with _as_implemented(hidden):
            stats = merge(impl.forward(hidden, weight, bias, labels, inv_t, vocab_start, with_entropy))
            if tp_group is not None:
                stats = merge_across(stats, tp_group)
            lse, logp, entropy = finalize(stats)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.inv_t, ctx.vocab_start, ctx.tp_group, ctx.impl = inv_t, vocab_start, tp_group, impl
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:3])
        if g_logp is None and g_entropy is None or not any(needs):
            return (None,) * 8
        with _as_implemented(hidden):
            d_hidden, d_weight, d_bias = ctx.impl.backward(
                hidden, weight, bias, labels, lse, entropy, g_logp, g_entropy, ctx.inv_t, ctx.vocab_start, needs)
        if d_hidden is not None:
            if ctx.tp_group is not None:  # hidden is replicated: its gradient sums every shard's part
                dist.all_reduce(d_hidden, group=ctx.tp_group)
            d_hidden = d_hidden.to(hidden.dtype)
        return d_hidden, d_weight, d_bias, None, None, None, None, None
