"""Fused log-prob (and entropy) of labels under softmax(logits / T), in Triton.

Forward: one program per token reads its row of logits once, in the input dtype, summing per lane
in fp32 against a fixed reference (the row's first block's max), so the loop has no cross-lane
reduction; rows whose later logits exceed that reference too far for fp32 are read again with a
running max (no fp32 copy of the logits, no [N, V] temporary). It writes the log-prob, the entropy,
and the per-token ``lse`` that the backward needs. Backward: one program
per (token, vocabulary block) recomputes p from the logits and ``lse`` and writes d_logits directly.

Layout: logits are viewed as [B, T, V] with arbitrary strides (so ``logits[:, -L-1:-1]`` of a
model's [B, S, V] output needs no copy); row n is (n // T, n % T).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import triton
import triton.language as tl

from verl_fast.kernels.autograd import Impl, LogprobsFunction

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Running maxima start at a finite value, so the rescale (m_old - m_new) * s_old is 0 * finite = 0
# on the first block instead of -inf * 0 = NaN.
NEG_BIG = tl.constexpr(-1.0e30)
# T (positions per row) changes with every batch and only splits a row index in two; unspecialized,
# a new length never compiles the kernels again (the strides keep their specialization: it decides
# the vector width of the loads).
ROW_COUNTS = ("T",)
# Per-row vectors (one element read or written per program): their addresses' alignment decides no
# vector width, and views into one buffer (logp / entropy / lse) move with the row count.
FWD_ROW_VECTORS = ("labels_ptr", "logp_ptr", "ent_ptr", "lse_ptr")
BWD_ROW_VECTORS = ("labels_ptr", "lse_ptr", "ent_ptr", "glp_ptr", "gent_ptr")


@triton.jit
def _row_start(x_ptr, n, T, stride_b, stride_t):
    return x_ptr + (n // T).to(tl.int64) * stride_b + (n % T).to(tl.int64) * stride_t


# Spread (in log2 units) between the first block's max and the row's max up to which one fixed
# reference keeps every sum finite: terms 2^(y - m) <= 2^64, fewer than 2^31 of them, < 2^128.
MAX_SPREAD = tl.constexpr(64.0)


@triton.jit
def _load_block(row, offs, stride_v, V, scale):
    return tl.load(row + offs * stride_v, mask=offs < V, other=float("-inf")).to(tl.float32) * scale


@triton.jit
def _fixed_reference_pass(row, stride_v, V, scale, WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
                          NUM_STAGES: tl.constexpr):
    """Per-lane sums of 2^(y - m) (and 2^(y - m) * (y - m)) against m = the first block's max, with no
    reduction in the loop; also the row's max, to tell whether m was close enough to it."""
    offs = tl.arange(0, BLOCK_V)
    y = _load_block(row, offs, stride_v, V, scale)
    m = tl.maximum(tl.max(y, 0), NEG_BIG)
    hi = y
    d = y - m
    s = tl.exp2(d)
    t = s * tl.maximum(d, NEG_BIG)  # masked lanes: 0 * -1e30 = 0
    for v0 in tl.range(BLOCK_V, V, BLOCK_V, num_stages=NUM_STAGES):  # stages > 1: the next blocks load meanwhile
        y = _load_block(row, v0 + offs, stride_v, V, scale)
        hi = tl.maximum(hi, y)
        d = y - m
        e = tl.exp2(d)
        s += e
        if WITH_ENT:
            t += e * tl.maximum(d, NEG_BIG)
    return m, tl.max(hi, 0), s, t


@triton.jit
def _running_max_pass(row, stride_v, V, scale, WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    """The same sums against a running max, rescaled whenever it grows: one max-reduction per block."""
    m = tl.full([], NEG_BIG, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    t = tl.zeros([BLOCK_V], tl.float32)
    for v0 in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
        y = _load_block(row, v0 + tl.arange(0, BLOCK_V), stride_v, V, scale)
        m_new = tl.maximum(m, tl.max(y, 0))
        alpha = tl.exp2(m - m_new)
        d = y - m_new
        e = tl.exp2(d)
        if WITH_ENT:
            t = alpha * (t + (m - m_new) * s) + e * tl.maximum(d, NEG_BIG)
        s = alpha * s + e
        m = m_new
    return m, s, t


@triton.jit(do_not_specialize=ROW_COUNTS, do_not_specialize_on_alignment=FWD_ROW_VECTORS)
def _logprobs_fwd_kernel(x_ptr, labels_ptr, logp_ptr, ent_ptr, lse_ptr, bad_ptr, T, stride_b, stride_t, stride_v, V,
                         inv_t, WITH_ENT: tl.constexpr, CHECK: tl.constexpr, BLOCK_V: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    n = tl.program_id(0)
    row = _row_start(x_ptr, n, T, stride_b, stride_t)
    scale = inv_t * LOG2E  # base 2 throughout (y = z * log2 e): exp2/log2 are the hardware instructions
    # One streaming pass without a reduction per block; a row whose largest logit exceeds its first
    # block's by more than MAX_SPREAD (a gap of 44 nats at T = 1: rare) is read again with a running max.
    m, top, s, t = _fixed_reference_pass(row, stride_v, V, scale, WITH_ENT, BLOCK_V, NUM_STAGES)
    if top - m > MAX_SPREAD:
        m, s, t = _running_max_pass(row, stride_v, V, scale, WITH_ENT, BLOCK_V, NUM_STAGES)
    total = tl.sum(s, 0)
    log2_s = tl.log2(total)
    lse = (m + log2_s) * LN2
    label = tl.load(labels_ptr + n)
    in_range = (label >= 0) & (label < V)
    if CHECK:  # counted here rather than by a min/max pass over the labels before the launch
        tl.atomic_add(bad_ptr, 1, mask=(label < 0) | (label >= V))
    # A label outside [0, V) reads nothing and gives NaN.
    z_label = tl.load(row + label * stride_v, mask=in_range, other=float("nan"))
    tl.store(logp_ptr + n, z_label.to(tl.float32) * inv_t - lse)
    tl.store(lse_ptr + n, lse)
    if WITH_ENT:
        tl.store(ent_ptr + n, (log2_s - tl.sum(t, 0) / total) * LN2)


@triton.jit(do_not_specialize=ROW_COUNTS, do_not_specialize_on_alignment=BWD_ROW_VECTORS)
def _logprobs_bwd_kernel(x_ptr, dx_ptr, labels_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, T, stride_b, stride_t,
                         stride_v, V, inv_t, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_V: tl.constexpr):
    n = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    row = _row_start(x_ptr, n, T, stride_b, stride_t)
    z = tl.load(row + offs * stride_v, mask=mask, other=0.0).to(tl.float32) * inv_t
    lse = tl.load(lse_ptr + n)
    p = tl.exp2(tl.minimum(z - lse, 0.0) * LOG2E)  # p <= 1; masked lanes (z = 0) would overflow
    if HAS_GLP:
        g_logp = tl.load(glp_ptr + n)
        coef = g_logp
    else:
        coef = 0.0
    if HAS_GENT:
        coef = coef + tl.load(gent_ptr + n) * (z - lse + tl.load(ent_ptr + n))
    dz = tl.where(p > 0.0, -p * coef, 0.0)  # p = 0 (a logit of -inf): coef may be -inf, the product NaN
    if HAS_GLP:
        dz = tl.where(offs == tl.load(labels_ptr + n), dz + g_logp, dz)
    tl.store(dx_ptr + n.to(tl.int64) * V + offs, (dz * inv_t).to(dx_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LogprobsConfig:
    block_v: int  # vocabulary elements per loop step (forward) / per program (backward)
    num_warps: int
    num_stages: int = 3  # forward: blocks of a row in flight (software pipelining through shared memory)


@functools.lru_cache(maxsize=64)
def logprobs_config(vocab: int, block_v: Optional[int] = None, num_warps: Optional[int] = None,
                    num_stages: int = 3) -> LogprobsConfig:
    """Block size and warps for a vocabulary of ``vocab``; raises ValueError naming a size it cannot handle."""
    if vocab < 1 or vocab >= 2**31:
        raise ValueError(f"logprobs_from_logits: vocabulary size V={vocab} is outside [1, 2^31)")
    block_v = block_v or max(16, min(2048, triton.next_power_of_2(vocab)))
    if block_v & (block_v - 1) or not 16 <= block_v <= 65536:
        raise ValueError(f"logprobs_from_logits: block_v={block_v} must be a power of two in [16, 65536]")
    if triton.cdiv(vocab, block_v) > 65535:
        raise ValueError(f"logprobs_from_logits: V={vocab} needs more than 65535 blocks of {block_v}; raise block_v")
    num_warps = num_warps or 4  # H200 sweep (V=151936, bf16): 4 warps, 3 stages, block 2048 was fastest
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"logprobs_from_logits: num_warps={num_warps} must be a power of two up to 32")
    if not 1 <= num_stages <= 8:
        raise ValueError(f"logprobs_from_logits: num_stages={num_stages} must be in [1, 8]")
    return LogprobsConfig(block_v, num_warps, num_stages)


def logprobs_forward(logits, labels, inv_t: float, with_entropy: bool, *, config: Optional[LogprobsConfig] = None,
                     bad_labels: Optional[torch.Tensor] = None):
    """logits [B, T, V] -> (logp, entropy or None, lse), each [B*T] fp32. ``bad_labels``: a zeroed
    int32 [1] tensor to which the kernel adds the number of labels outside [0, V)."""
    B, T, V = logits.shape
    cfg = config or logprobs_config(V)
    out = torch.empty((3, B * T), dtype=torch.float32, device=logits.device)
    logp, entropy, lse = out[0], out[1], out[2]
    if B * T:
        _logprobs_fwd_kernel[(B * T,)](logits, labels, logp, entropy, lse, bad_labels, T, logits.stride(0),
                                       logits.stride(1), logits.stride(2), V, inv_t, WITH_ENT=with_entropy,
                                       CHECK=bad_labels is not None, BLOCK_V=cfg.block_v,
                                       NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return logp, (entropy if with_entropy else None), lse


def logprobs_backward(logits, labels, lse, entropy, g_logp, g_entropy, inv_t: float, *,
                      config: Optional[LogprobsConfig] = None, out: Optional[torch.Tensor] = None):
    """d_logits [B, T, V] (contiguous, logits' dtype) for upstream gradients of logp and entropy;
    written into ``out`` when given (``logits`` itself may be it: each program reads its block of a
    row before it writes the same block)."""
    B, T, V = logits.shape
    cfg = config or logprobs_config(V)
    d_logits = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device) if out is None else out
    if B * T:
        g_logp = None if g_logp is None else g_logp.float().contiguous()
        g_entropy = None if g_entropy is None else g_entropy.float().contiguous()
        grid = (B * T, triton.cdiv(V, cfg.block_v))
        _logprobs_bwd_kernel[grid](logits, d_logits, labels, lse, entropy, g_logp, g_entropy, T, logits.stride(0),
                                   logits.stride(1), logits.stride(2), V, inv_t, HAS_GLP=g_logp is not None,
                                   HAS_GENT=g_entropy is not None, BLOCK_V=cfg.block_v, num_warps=cfg.num_warps)
    return d_logits


def logprobs_from_logits_triton(logits, labels, inv_t: float, with_entropy: bool,
                                config: Optional[LogprobsConfig] = None, bad_labels: Optional[torch.Tensor] = None):
    """Autograd entry: logits [B, T, V], labels [B*T] -> (logp, entropy or None); the forward adds the
    number of labels outside [0, V) to ``bad_labels`` when given (the caller reads it)."""
    impl = Impl(partial(logprobs_forward, config=config, bad_labels=bad_labels),
                partial(logprobs_backward, config=config))
    return LogprobsFunction.apply(logits, labels, inv_t, with_entropy, impl)
