"""One decode step's attention over a static KV cache, in Triton: each program takes one sequence's
KV head and the query heads that share it, reads the cached keys and values once, and loads no
cache column the mask leaves empty.

The cache is allocated for the longest sequence (prompt width + new tokens) and a graph-captured
decode step cannot change shapes, so the matmul form (``static_kv.grouped_attention``) attends every
column of it at every token: on average twice the columns that hold keys, and each step also writes
the [B, kv_heads, group, L] float32 scores, reads them back for the softmax and writes the
probabilities (three more passes over the cache's width). Here the scores stay in registers
(an online softmax, in base 2), and the loads are masked by the mask: the columns past the newest
token are never read.

Long caches over few sequences split their columns over several programs (``splits``); each writes
its running max, sum and unnormalised output in float32, and a second kernel combines them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from verl_fast.kernels.linear_logprobs import _dot

LOG2E = 1.4426950408889634
# Running maxima start finite, so the first rescale is exp2(-1e30 - m) = 0, never exp2(-inf + inf) = NaN.
NEG_BIG = tl.constexpr(-1.0e30)
BLOCK_N = 64  # cache columns a loop step reads
NUM_STAGES = 2  # loop steps whose loads are in flight at once
NUM_WARPS = 4


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                             KVH, L, G, D, cols_per_split, scale_log2,
                             sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, sml, sob, soh, sod,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                             NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)  # sequence b, KV head h: b * KVH + h
    split = tl.program_id(1)
    scale = tl.full((), scale_log2, tl.float32)  # Inductor passes a Python float as an fp64 scalar
    b = (pid // KVH).to(tl.int64)
    h = (pid % KVH).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < G
    d_ok = d < D
    heads = h * G + g  # the query heads reading KV head h, as repeat_kv pairs them
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + d[None, :] * sqd, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_row = k_ptr + b * skb + h * skh
    v_row = v_ptr + b * svb + h * svh
    m_i = tl.full((BLOCK_G,), NEG_BIG, tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    lo = split * cols_per_split
    hi = tl.minimum(lo + cols_per_split, L)
    # the loads of the next blocks issue while this one computes (num_stages); a column the mask leaves
    # empty is never loaded (its lanes predicated off), so a block past the newest key costs its 64
    # mask bytes and two products of zeros
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        cols = start + n
        keep = tl.load(mask_ptr + b * smb + cols.to(tl.int64) * sml, mask=cols < hi, other=0) != 0
        both = keep[:, None] & d_ok[None, :]
        k = tl.load(k_row + cols[:, None].to(tl.int64) * skn + d[None, :] * skd, mask=both, other=0.0)
        v = tl.load(v_row + cols[:, None].to(tl.int64) * svn + d[None, :] * svd, mask=both, other=0.0)
        s = _dot(q.to(k.dtype), tl.trans(k), tl.zeros((BLOCK_G, BLOCK_N), tl.float32), PRECISION, UPCAST)
        s = tl.where(keep[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # stays finite (NEG_BIG) over a block with no key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    if SPLIT:
        part = (pid * tl.num_programs(1) + split).to(tl.int64) * BLOCK_G
        tl.store(part_m_ptr + part + g, m_i)
        tl.store(part_l_ptr + part + g, l_i)
        tl.store(part_acc_ptr + (part + g[:, None]) * BLOCK_D + d[None, :], acc)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no key at all: zeros
        tl.store(out_ptr + b * sob + heads[:, None] * soh + d[None, :] * sod, out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, KVH, G, D, S, sob, soh, sod,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // KVH).to(tl.int64)
    h = (pid % KVH).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    m = tl.full((BLOCK_G,), NEG_BIG, tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for s in range(0, S):
        part = (pid * S + s).to(tl.int64) * BLOCK_G
        m_s = tl.load(part_m_ptr + part + g)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        total = total * alpha + tl.load(part_l_ptr + part + g) * beta
        acc = acc * alpha[:, None] + tl.load(part_acc_ptr + (part + g[:, None]) * BLOCK_D + d[None, :]) * beta[:, None]
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + b * sob + (h * G + g)[:, None] * soh + d[None, :] * sod, out.to(out_ptr.dtype.element_ty),
             mask=(g < G)[:, None] & (d < D)[None, :])


def splits_for(programs: int, length: int, device: torch.device) -> int:
    """How many programs share one sequence's KV head: enough that the grid fills the GPU's SMs twice,
    never more than the cache has column blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(length, BLOCK_N), triton.cdiv(2 * sms, programs)))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
                     scale: float, splits: Optional[int] = None) -> torch.Tensor:
    """softmax(q k^T * scale over the kept columns) v for one new token per sequence.

    ``query``: [B, heads, 1, D]; ``key`` / ``value``: [B, kv_heads, L, D] (the cache; query head i reads
    KV head i // (heads / kv_heads)); ``keep``: [B, L] boolean, True where a column holds a key the
    sequence attends to. The query is cast to the keys' dtype (as autocast's matmul does), scores and the
    softmax are float32. Returns [B, 1, heads, D] in the values' dtype; a sequence with no kept column
    gets zeros. ``splits``: programs per (sequence, KV head), by default ``splits_for``."""
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"decode_attention: query must be [B, heads, 1, D], got {tuple(query.shape)}")
    B, heads, _, D = query.shape
    if key.dim() != 4 or key.shape != value.shape or key.shape[0] != B or key.shape[3] != D:
        raise ValueError(f"decode_attention: key and value must be [B={B}, kv_heads, L, D={D}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    kv_heads, L = key.shape[1], key.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"decode_attention: {heads} query heads do not divide over {kv_heads} KV heads")
    if keep.shape != (B, L) or keep.dtype != torch.bool:
        raise ValueError(f"decode_attention: keep must be a [B={B}, L={L}] bool tensor, got "
                         f"{tuple(keep.shape)} {keep.dtype}")
    if len({t.device for t in (query, key, value, keep)}) != 1:
        raise ValueError("decode_attention: query, key, value and keep must be on one device")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"decode_attention: splits must be a positive int, got {splits!r}")
    G = heads // kv_heads
    programs = B * kv_heads
    splits = splits or splits_for(programs, L, query.device)
    cols_per_split = triton.cdiv(triton.cdiv(L, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(L, cols_per_split) if L else 1
    block_g, block_d = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    out = torch.empty((B, 1, heads, D), dtype=value.dtype, device=query.device)
    split = splits > 1
    parts = programs * splits * block_g if split else 0
    part_m = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_l = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_acc = torch.empty(parts * block_d, dtype=torch.float32, device=query.device)
    if programs == 0:
        return out
    fp32 = key.dtype == torch.float32
    upcast = query.device.type == "cpu" and key.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot
    _decode_attention_kernel[(programs, splits)](
        query, key, value, keep, out, part_m, part_l, part_acc, kv_heads, L, G, D, cols_per_split, scale * LOG2E,
        query.stride(0), query.stride(1), query.stride(3), *key.stride(), *value.stride(), keep.stride(0), keep.stride(1), out.stride(0), out.stride(2), out.stride(3),
        BLOCK_G=block_g, BLOCK_N=BLOCK_N, BLOCK_D=block_d, SPLIT=split, PRECISION="ieee" if fp32 else "tf32",
        UPCAST=upcast, NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS)
    if split:
        _combine_kernel[(programs,)](out, part_m, part_l, part_acc, kv_heads, G, D, splits, out.stride(0),
                                     out.stride(2), out.stride(3), BLOCK_G=block_g, BLOCK_D=block_d, num_warps=4)
    return out
