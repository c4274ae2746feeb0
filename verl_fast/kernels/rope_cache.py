"""One decode step's rotary embedding and KV-cache write in one Triton kernel: from the merged q/k/v
product of one new token per sequence, the query heads rotated (returned for the attention), the key
heads rotated and the value heads as they are written into the static cache at the step's column.

The torch form runs the query's rotation, the key's rotation and each cache write (an ``index_copy_``
into the keys and one into the values) as separate passes, each a launch of its own inside the
compiled step. Here one program takes one sequence: every head of its q/k/v row, each element paired
with its partner half a head away (``rotate_half``: x * cos + (-x2, x1) * sin, in float32), stored
where it goes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, col_ptr, H, KVH, D,
                       s_qkv, s_cos, s_sin, sqb, sqh, skb, skh, skn, svb, svh, svn,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    col = tl.load(col_ptr)
    r = tl.arange(0, BLOCK_R)[:, None]  # head rows of the product: H query heads, KVH keys, KVH values
    d = tl.arange(0, BLOCK_D)[None, :]
    half = D // 2
    d_ok = d < D
    ok = (r < H + 2 * KVH) & d_ok
    rotated = r < H + KVH
    partner = tl.where(d < half, d + half, d - half)
    row = qkv_ptr + b * s_qkv + r * D
    x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=ok & rotated, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + b * s_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * s_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    rot = x * cos + tl.where(d < half, -xp, xp) * sin
    tl.store(q_ptr + b * sqb + r * sqh + d, rot.to(q_ptr.dtype.element_ty), mask=ok & (r < H))
    kr = tl.maximum(r - H, 0)
    tl.store(k_ptr + b * skb + kr * skh + col * skn + d, rot.to(k_ptr.dtype.element_ty), mask=ok & (r >= H) & rotated)
    vr = tl.maximum(r - H - KVH, 0)
    tl.store(v_ptr + b * svb + vr * svh + col * svn + d, x.to(v_ptr.dtype.element_ty), mask=ok & (r >= H + KVH))


def rope_cache_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, col: torch.Tensor, heads: int) -> torch.Tensor:
    """The rotated queries [B, heads, 1, D], in the dtype ``qkv * cos`` has; the rotated keys and the
    values written into ``keys`` / ``values`` [B, kv_heads, L, D] at column ``col`` (each in its own dtype).

    ``qkv``: [B, 1, (heads + 2 kv_heads) * D], one token's merged product (query heads, then key heads,
    then value heads, D each); ``cos`` / ``sin``: [B, 1, D], the token's rotary table (the two halves of
    a head rotated as pairs, as transformers' ``rotate_half``); ``col``: [1] int64, a cache column.
    Raises ValueError naming the argument that does not fit."""
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"rope_cache_write: keys and values must be one [B, kv_heads, L, D] shape, got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    B, kv_heads, L, D = keys.shape
    width = (heads + 2 * kv_heads) * D
    if qkv.shape != (B, 1, width) or qkv.stride(-1) != 1:
        raise ValueError(f"rope_cache_write: qkv must be [B={B}, 1, (heads + 2 kv_heads) * D = {width}], contiguous "
                         f"in its last dimension, got {tuple(qkv.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (B, 1, D) or table.stride(-1) != 1:
            raise ValueError(f"rope_cache_write: {name} must be [B={B}, 1, D={D}] contiguous in D, got "
                             f"{tuple(table.shape)}")
    if D % 2 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError(f"rope_cache_write: the cache's head dimension must be even and contiguous, got D={D}")
    if col.shape != (1,) or col.dtype != torch.int64:
        raise ValueError(f"rope_cache_write: col must be a [1] int64 tensor, got {tuple(col.shape)} {col.dtype}")
    if len({t.device for t in (qkv, cos, sin, keys, values, col)}) != 1:
        raise ValueError("rope_cache_write: qkv, cos, sin, keys, values and col must be on one device")
    q = torch.empty((B, heads, 1, D), dtype=torch.promote_types(qkv.dtype, cos.dtype), device=qkv.device)
    if B == 0:
        return q
    _rope_cache_kernel[(B,)](qkv, cos, sin, q, keys, values, col, heads, kv_heads, D, qkv.stride(0), cos.stride(0),
                             sin.stride(0), q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
                             values.stride(0), values.stride(1), values.stride(2),
                             BLOCK_R=triton.next_power_of_2(heads + 2 * kv_heads), BLOCK_D=triton.next_power_of_2(D),
                             num_warps=NUM_WARPS)
    return q
