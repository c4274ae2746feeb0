"""Fused lm_head + log-prob (+ entropy) in Triton: logits = (hidden @ weight^T + bias) / T, never stored.

Cost model (N tokens, H hidden, V vocabulary; one GEMM = 2*N*H*V flops):
- forward, 1 GEMM: each program computes [BLOCK_M, BLOCK_N] logits tiles with tl.dot (fp32
  accumulation) and folds them into running softmax statistics (softmax_stats.py); the
  statistics of the vocabulary splits are merged afterwards. Saved: lse and entropy, [N] fp32.
- backward, 3 GEMMs over vocabulary chunks of width C: (1) the logits tiles are recomputed and
  their epilogue forms d_logits in registers, written in the input dtype into an [N, C] buffer;
  (2) d_weight[chunk] = d_logits^T @ hidden (cuBLAS), written once, never accumulated;
  (3) d_hidden += d_logits @ weight[chunk] into an fp32 accumulator (cuBLAS where torch can write
  fp32 from 16-bit inputs, else a Triton kernel).
  Four GEMMs in all: d_weight depends on the upstream gradient, which only the backward knows,
  and nothing [N, V] fits the memory budget, so the logits are computed twice.
- extra memory: fp32 d_hidden (4*N*H bytes), one d_logits chunk (chunk_bytes, default 64 MiB),
  the forward's split statistics (stats_bytes at most) and O(N) vectors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from verl_fast.kernels.autograd import Impl, LinearLogprobsFunction
from verl_fast.kernels.softmax_stats import Stats

LOG2E = tl.constexpr(1.4426950408889634)
# The token count changes from one micro-batch to the next, and Triton would compile a kernel again
# whenever it crossed a specialization class (divisible by 16 or not): ~1-2 s inside an update step.
# It only bounds masks, so the kernels take it unspecialized and compile once.
TOKEN_COUNTS = ("N",)
NEG_BIG = tl.constexpr(-1.0e30)  # finite start for running maxima (see logprobs.py)


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program id -> (row block, column block), GROUP_M row blocks at a time: neighbouring programs
    share the column operand's tiles while they sit in L2."""
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # only under TRITON_INTERPRET, whose tl.dot multiplies bf16 bit patterns as integers
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _mma_loop(a_ptrs, b_ptrs, acc, K, stride_ak, stride_bk, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc += A[:, :K] @ B[:K, :], from a_ptrs [M, BLOCK_K] and b_ptrs [BLOCK_K, N] pointing at k = 0."""
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _dot(a, b, acc, PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _mma_loop_tma(a_desc, b_desc, acc, m0, n0, K, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    """acc += A[m0:, :K] @ B[n0:, :K]^T through TMA descriptors (out-of-range elements read as 0)."""
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([m0, k * BLOCK_K])
        b = b_desc.load([n0, k * BLOCK_K])
        acc = _dot(a, b.T, acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, m0, n0, N, V, H, stride_hm, stride_hk, stride_wv, stride_wk, inv_t,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 tile at (m0, n0) of (hidden @ weight^T + bias) / T. Rows and columns
    past N and V hold finite values (wrapped reads, or zeros through TMA); callers mask them. With
    TMA, h_ptr and w_ptr are descriptors of hidden and weight with [BLOCK_M | BLOCK_N, BLOCK_K] blocks."""
    cols = ((n0 + tl.arange(0, BLOCK_N)) % V).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        acc = _mma_loop_tma(h_ptr, w_ptr, acc, m0, n0, H, BLOCK_K, PRECISION, UPCAST)
    else:
        rows = ((m0 + tl.arange(0, BLOCK_M)) % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :] * stride_hk
        b_ptrs = w_ptr + cols[None, :] * stride_wv + offs_k[:, None] * stride_wk
        acc = _mma_loop(a_ptrs, b_ptrs, acc, H, stride_hk, stride_wk, EVEN_K, BLOCK_K, PRECISION, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    return acc * inv_t


@triton.jit(do_not_specialize=TOKEN_COUNTS)
def _linear_fwd_kernel(h_ptr, w_ptr, b_ptr, labels_ptr, m_ptr, s_ptr, t_ptr, zl_ptr, N, V, H, stride_hm, stride_hk,
                       stride_wv, stride_wk, inv_t, vocab_start, num_splits, tiles_per_split,
                       HAS_BIAS: tl.constexpr, WITH_ENT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, TMA: tl.constexpr):
    pid_m, split = _swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_M), num_splits, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    labels = tl.load(labels_ptr + offs_m, mask=offs_m < N, other=-1) - vocab_start
    labels = tl.where((labels >= 0) & (labels < V), labels, -1)  # another rank's label must not hit padding
    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    t = tl.zeros([BLOCK_M], tl.float32)
    zl = tl.zeros([BLOCK_M], tl.float32)
    first = split * tiles_per_split
    for tile in range(first, tl.minimum(first + tiles_per_split, tl.cdiv(V, BLOCK_N))):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        z = _logits_tile(h_ptr, w_ptr, b_ptr, pid_m * BLOCK_M, tile * BLOCK_N, N, V, H, stride_hm, stride_hk,
                         stride_wv, stride_wk, inv_t, HAS_BIAS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                         TMA)
        z = tl.where((offs_n < V)[None, :], z, float("-inf"))
        zl += tl.sum(tl.where(offs_n[None, :] == labels[:, None], z, 0.0), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp2((m - m_new) * LOG2E)
        y = z - m_new[:, None]
        e = tl.exp2(y * LOG2E)
        if WITH_ENT:  # masked columns: 0 * -1e30 = 0
            t = alpha * (t + (m - m_new) * s) + tl.sum(e * tl.maximum(y, NEG_BIG), 1)
        s = alpha * s + tl.sum(e, 1)
        m = m_new
    ok = offs_m < N
    out = split * N + offs_m
    tl.store(m_ptr + out, m, mask=ok)
    tl.store(s_ptr + out, s, mask=ok)
    tl.store(zl_ptr + out, zl, mask=ok)
    if WITH_ENT:
        tl.store(t_ptr + out, t, mask=ok)


@triton.jit(do_not_specialize=TOKEN_COUNTS)
def _linear_dlogits_kernel(h_ptr, w_ptr, b_ptr, labels_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, d_ptr, db_ptr,
                           N, V, H, v_begin, v_end, stride_hm, stride_hk, stride_wv, stride_wk, stride_dm, inv_t,
                           vocab_start, HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
                           NEED_DB: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                           UPCAST: tl.constexpr, TMA: tl.constexpr):
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(v_end - v_begin, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = v_begin + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    z = _logits_tile(h_ptr, w_ptr, b_ptr, pid_m * BLOCK_M, v_begin + pid_n * BLOCK_N, N, V, H, stride_hm, stride_hk,
                     stride_wv, stride_wk, inv_t, HAS_BIAS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST, TMA)
    rows = offs_m % N
    lse = tl.load(lse_ptr + rows)
    p = tl.exp2((z - lse[:, None]) * LOG2E)
    dz = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if HAS_GLP:  # d logp / dz = onehot(label) - p
        g = tl.load(glp_ptr + rows)
        labels = tl.load(labels_ptr + rows) - vocab_start
        dz = tl.where(offs_n[None, :] == labels[:, None], g[:, None], 0.0) - p * g[:, None]
    if HAS_GENT:  # d H / dz = -p (z - lse + H)
        g_ent = tl.load(gent_ptr + rows)
        shift = lse - tl.load(ent_ptr + rows)
        dz -= p * (g_ent[:, None] * (z - shift[:, None]))
    ok = (offs_m < N)[:, None] & (offs_n < v_end)[None, :]
    dz = tl.where(ok, dz * inv_t, 0.0)
    d_ptrs = d_ptr + offs_m.to(tl.int64)[:, None] * stride_dm + (offs_n - v_begin)[None, :]
    tl.store(d_ptrs, dz.to(d_ptr.dtype.element_ty), mask=ok)
    if NEED_DB:
        tl.atomic_add(db_ptr + offs_n, tl.sum(dz, 0), mask=offs_n < v_end)


@triton.jit(do_not_specialize=("M",))  # M: the token count
def _matmul_acc_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                       stride_cn, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr):
    """c[M, N] (fp32) += a[M, K] @ b[K, N]."""
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + (offs_n % N).to(tl.int64)[None, :] * stride_bn
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    acc = tl.load(c_ptrs, mask=ok, other=0.0)  # loaded up front: no second tile of registers at the end
    acc = _mma_loop(a_ptrs, b_ptrs, acc, K, stride_ak, stride_bk, EVEN_K, BLOCK_K, PRECISION, UPCAST)
    tl.store(c_ptrs, acc, mask=ok)


# ----------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Tiles:
    """One GEMM's tiling: block_m x block_n output tiles, block_k deep, GROUP_M swizzle, launch options."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # load hidden / weight tiles through TMA descriptors where they allow it (logits GEMMs)

    def smem_bytes(self, elsize: int) -> int:
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * elsize


@dataclass(frozen=True)
class LinearConfig:
    forward: Tiles  # tokens x vocabulary tiles, hidden deep
    dlogits: Tiles  # the backward's recompute: tokens x vocabulary, hidden deep
    dhidden: Tiles  # d_hidden += d_logits @ weight: tokens x hidden, vocabulary deep
    chunk_bytes: int = 64 << 20  # one [N, chunk] block of d_logits (input dtype) in the backward
    stats_bytes: int = 64 << 20  # the forward's per-split statistics (16 bytes per token and split)
    # d_hidden += d_logits @ weight by cuBLAS (addmm into the fp32 accumulator) instead of the Triton
    # kernel; None: cuBLAS on CUDA where torch supports 16-bit inputs into an fp32 output.
    dhidden_cublas: Optional[bool] = None
    # Keep the [N, V] logits (input dtype, one GEMM) from the forward and turn them into d_logits in
    # place in the backward: 3 GEMMs instead of 4, N*V elements more memory between the passes, and
    # the logits rounded to the input dtype before the softmax, as a plain matmul + log_softmax
    # rounds them (in bf16 ~|z| * 2^-9 on each logit). Off by default.
    store_logits: bool = False


_DEFAULTS = {  # by device: (forward, dlogits, dhidden)
    # 128x256 tiles fill an H100/H200 SM's registers (255 per thread, no spills); GROUP_M 16 keeps a
    # wave's weight tiles and hidden rows (~15 MB each at H=3584) inside the 50 MB L2.
    # TMA loads for the two logits GEMMs: faster than plain loads there (docs/benchmarks.md).
    "sm90": (Tiles(128, 256, 64, 16, 8, 3, tma=True), Tiles(128, 256, 64, 16, 8, 3, tma=True),
             Tiles(128, 256, 64, 16, 8, 3)),
    "sm80": (Tiles(128, 128, 32, 8, 4, 4), Tiles(128, 128, 32, 8, 4, 4), Tiles(128, 128, 32, 8, 4, 4)),
    # fp32 inputs take exact (non-TF32) dots, which run on CUDA cores: small tiles keep them in registers.
    "fp32": (Tiles(64, 64, 32, 8, 4, 3), Tiles(64, 64, 32, 8, 4, 3), Tiles(64, 64, 32, 8, 4, 3)),
    # The interpreter runs each program in numpy: a few large tiles are fastest.
    "cpu": (Tiles(32, 64, 32, 4, 4, 1), Tiles(32, 64, 32, 4, 4, 1), Tiles(32, 64, 32, 4, 4, 1)),
}


def _pow2(x: int) -> bool:
    return x > 0 and not x & (x - 1)


def _fit(tiles: Tiles, name: str, m: int, n: int, k: int, elsize: int, smem: Optional[int], explicit: bool) -> Tiles:
    """Shrinks tiles to tiny problems (and, for defaults, to the device's shared memory); validates."""
    for field in ("block_m", "block_n", "block_k"):
        size = getattr(tiles, field)
        if not _pow2(size) or not 16 <= size <= 512:
            raise ValueError(f"linear_logprobs: {name}.{field}={size} must be a power of two in [16, 512]")
    if not _pow2(tiles.num_warps) or tiles.num_warps > 32 or tiles.num_stages < 1 or tiles.group_m < 1:
        raise ValueError(f"linear_logprobs: {name} has invalid launch options {tiles}")
    fit = lambda b, size: min(b, max(16, triton.next_power_of_2(size)))  # noqa: E731
    tiles = replace(tiles, block_m=fit(tiles.block_m, m), block_n=fit(tiles.block_n, n), block_k=fit(tiles.block_k, k))
    while smem is not None and tiles.smem_bytes(elsize) > smem and not explicit:
        if tiles.num_stages > 2:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif tiles.block_k > 16:
            tiles = replace(tiles, block_k=tiles.block_k // 2)
        else:
            break
    if smem is not None and tiles.smem_bytes(elsize) > smem:
        raise ValueError(f"linear_logprobs: {name} tiles {tiles} need {tiles.smem_bytes(elsize)} bytes of shared "
                         f"memory for {elsize}-byte inputs; the device has {smem}: use smaller blocks or fewer stages")
    return tiles


def _device_limits(device: torch.device) -> Tuple[str, Optional[int]]:
    """(key into _DEFAULTS, shared memory per block in bytes or None for the interpreter)."""
    if device.type != "cuda":
        return "cpu", None
    props = torch.cuda.get_device_properties(device)
    return ("sm90" if props.major >= 9 else "sm80"), getattr(props, "shared_memory_per_block_optin", 101376)


def linear_config(n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device, *,
                  forward: Optional[Tiles] = None, dlogits: Optional[Tiles] = None, dhidden: Optional[Tiles] = None,
                  chunk_bytes: Optional[int] = None, stats_bytes: Optional[int] = None,
                  dhidden_cublas: Optional[bool] = None, store_logits: bool = False) -> LinearConfig:
    """The one place block sizes come from. Raises ValueError naming a size it cannot handle."""
    if not 1 <= vocab < 2**31:
        raise ValueError(f"linear_logprobs: vocabulary size V={vocab} is outside [1, 2^31)")
    if not 1 <= hidden < 2**31 or not 0 <= n_tokens < 2**31:
        raise ValueError(f"linear_logprobs: sizes N={n_tokens}, H={hidden} must lie in [0, 2^31) and [1, 2^31)")
    kind, smem = _device_limits(torch.device(device))
    defaults = _DEFAULTS["fp32" if dtype == torch.float32 and kind != "cpu" else kind]
    elsize = torch.empty((), dtype=dtype).element_size()
    m = max(n_tokens, 1)
    return LinearConfig(
        forward=_fit(forward or defaults[0], "forward", m, vocab, hidden, elsize, smem, forward is not None),
        dlogits=_fit(dlogits or defaults[1], "dlogits", m, vocab, hidden, elsize, smem, dlogits is not None),
        dhidden=_fit(dhidden or defaults[2], "dhidden", m, hidden, vocab, elsize, smem, dhidden is not None),
        chunk_bytes=chunk_bytes or LinearConfig.chunk_bytes,
        stats_bytes=stats_bytes or LinearConfig.stats_bytes,
        dhidden_cublas=dhidden_cublas,
        store_logits=bool(store_logits),
    )


@functools.lru_cache(maxsize=None)
def cublas_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether torch.addmm takes bf16 inputs into an fp32 output here (torch >= 2.8 on CUDA); checked once."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(32, 32, dtype=torch.bfloat16, device=device)
        c = torch.full((32, 32), 0.5, device=device)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return bool((c == 32.5).all())
    except (RuntimeError, TypeError):
        return False


def _use_cublas_for_dhidden(cfg: LinearConfig, x: torch.Tensor) -> bool:
    if cfg.dhidden_cublas is not None:
        return cfg.dhidden_cublas
    return x.device.type == "cuda" and (x.dtype == torch.float32 or cublas_accumulates_in_fp32(x.device))


def accumulate_dhidden(d_hidden, d_logits, weight_chunk, cfg: LinearConfig, cublas: bool) -> None:
    """d_hidden (fp32) += d_logits @ weight_chunk."""
    if not cublas:
        _accumulate_matmul(d_logits, weight_chunk, d_hidden, cfg.dhidden)
    elif d_logits.dtype == torch.float32:
        d_hidden.addmm_(d_logits, weight_chunk)
    else:
        torch.addmm(d_hidden, d_logits, weight_chunk, out_dtype=torch.float32, out=d_hidden)


def _dot_options(x: torch.Tensor) -> dict:
    # fp32 inputs stay exact (no TF32); 16-bit inputs ignore the precision. CPU tensors run only
    # under the interpreter, whose bf16 tl.dot needs the upcast.
    return dict(PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16)


def _launch(tiles: Tiles) -> dict:
    return dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _logits_operands(hidden: torch.Tensor, weight: torch.Tensor, tiles: Tiles):
    """(hidden, weight, TMA) as the logits kernels take them: TMA descriptors when the tiles ask for
    them and the tensors allow it (contiguous rows, 16-byte aligned base and row stride), else the tensors."""
    def addressable(t):
        return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0

    if not (tiles.tma and addressable(hidden) and addressable(weight)):
        return hidden, weight, False
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton >= 3.4

    return (TensorDescriptor.from_tensor(hidden, [tiles.block_m, tiles.block_k]),
            TensorDescriptor.from_tensor(weight, [tiles.block_n, tiles.block_k]), True)


# ----------------------------------------------------------------------------------- launchers


def linear_logprobs_forward(hidden, weight, bias, labels, inv_t: float, vocab_start: int, with_entropy: bool, *,
                            config: Optional[LinearConfig] = None) -> Stats:
    """Split statistics ``[S, N]`` of hidden [N, H] @ weight[V, H]^T for labels [N] (global ids)."""
    N, H = hidden.shape
    V = weight.shape[0]
    cfg = config or linear_config(N, H, V, hidden.dtype, hidden.device)
    f = cfg.forward
    v_tiles = triton.cdiv(V, f.block_n)
    splits = max(1, min(v_tiles, cfg.stats_bytes // (16 * max(N, 1))))
    per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, per_split)
    out = torch.empty((4, splits, N), dtype=torch.float32, device=hidden.device)
    if N:
        grid = (triton.cdiv(N, f.block_m) * splits,)
        h_arg, w_arg, tma = _logits_operands(hidden, weight, f)
        _linear_fwd_kernel[grid](h_arg, w_arg, bias, labels, out[0], out[1], out[2], out[3], N, V, H,
                                 hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), inv_t,
                                 vocab_start, splits, per_split, HAS_BIAS=bias is not None, WITH_ENT=with_entropy,
                                 EVEN_K=H % f.block_k == 0, TMA=tma, **_dot_options(hidden), **_launch(f))
    return Stats(out[0], out[1], out[2] if with_entropy else None, out[3])


def chunk_width(cfg: LinearConfig, n_tokens: int, vocab: int, elsize: int) -> int:
    """The vocabulary columns one chunk of the backward's logits spans: ``cfg.chunk_bytes`` over
    ``n_tokens`` rows, in whole dlogits blocks, at least one block and at most the vocabulary's."""
    block = cfg.dlogits.block_n
    width = cfg.chunk_bytes // (max(n_tokens, 1) * elsize) // block * block
    return max(block, min(width, triton.cdiv(vocab, block) * block))


def linear_logprobs_backward(hidden, weight, bias, labels, lse, entropy, g_logp, g_entropy, inv_t: float,
                             vocab_start: int, needs, *, config: Optional[LinearConfig] = None):
    """(d_hidden [N, H] fp32 or None, d_weight [V, H] or None, d_bias [V] or None)."""
    N, H = hidden.shape
    V = weight.shape[0]
    cfg = config or linear_config(N, H, V, hidden.dtype, hidden.device)
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    dev = hidden.device
    d_hidden = torch.zeros((N, H), dtype=torch.float32, device=dev) if need_h else None
    d_weight = (torch.empty if N else torch.zeros)((V, H), dtype=weight.dtype, device=dev) if need_w else None
    d_bias = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None
    if N:
        g_logp = None if g_logp is None else g_logp.float().contiguous()
        g_entropy = None if g_entropy is None else g_entropy.float().contiguous()
        width = chunk_width(cfg, N, V, hidden.element_size())
        buf = torch.empty((N, width), dtype=hidden.dtype, device=dev)
        cublas = need_h and _use_cublas_for_dhidden(cfg, hidden)
        operands = _logits_operands(hidden, weight, cfg.dlogits)
        for v0 in range(0, V, width):
            v1 = min(V, v0 + width)
            d_logits = _dlogits_chunk(hidden, weight, operands, bias, labels, lse, entropy, g_logp, g_entropy,
                                      inv_t, vocab_start, v0, v1, buf, d_bias, cfg.dlogits)
            if need_w:
                torch.mm(d_logits.t(), hidden, out=d_weight[v0:v1])
            if need_h:
                accumulate_dhidden(d_hidden, d_logits, weight[v0:v1], cfg, cublas)
        del buf
    return d_hidden, d_weight, None if d_bias is None else d_bias.to(bias.dtype)


def _dlogits_chunk(hidden, weight, operands, bias, labels, lse, entropy, g_logp, g_entropy, inv_t, vocab_start, v0,
                   v1, buf, d_bias, tiles: Tiles) -> torch.Tensor:
    N, H = hidden.shape
    h_arg, w_arg, tma = operands
    grid = (triton.cdiv(N, tiles.block_m) * triton.cdiv(v1 - v0, tiles.block_n),)
    _linear_dlogits_kernel[grid](h_arg, w_arg, bias, labels, lse, entropy, g_logp, g_entropy, buf, d_bias, N,
                                 weight.shape[0], H, v0, v1, hidden.stride(0), hidden.stride(1), weight.stride(0),
                                 weight.stride(1), buf.stride(0), inv_t, vocab_start, HAS_BIAS=bias is not None,
                                 HAS_GLP=g_logp is not None, HAS_GENT=g_entropy is not None,
                                 NEED_DB=d_bias is not None, EVEN_K=H % tiles.block_k == 0, TMA=tma,
                                 **_dot_options(hidden), **_launch(tiles))
    return buf[:, : v1 - v0]


def _accumulate_matmul(a, b, c, tiles: Tiles) -> None:
    M, K = a.shape
    N = b.shape[1]
    grid = (triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n),)
    _matmul_acc_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                             c.stride(1), EVEN_K=K % tiles.block_k == 0, **_dot_options(a),
                             **_launch(tiles))


def _local_labels(labels: torch.Tensor, vocab_start: int, V: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(labels as this shard's column or -1, whether each falls in the shard)."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < V)
    return torch.where(inside, local, -1), inside


def stored_logits_forward(hidden, weight, bias, labels, inv_t: float, vocab_start: int, with_entropy: bool, *,
                          store: dict) -> Stats:
    """``store_logits``: the logits by one cuBLAS GEMM, kept in ``store`` for the backward; their
    statistics by the logits kernel's single read (as one split: m = lse, s = 1, t = -entropy)."""
    from verl_fast.kernels.logprobs_from_logits import logprobs_forward

    N, V = hidden.shape[0], weight.shape[0]
    z = torch.mm(hidden, weight.t()) if bias is None else torch.addmm(bias, hidden, weight.t())
    local, inside = _local_labels(labels, vocab_start, V)
    logp, entropy, lse = logprobs_forward(z.view(1, N, V), local, inv_t, with_entropy)
    store["logits"] = z
    zl = torch.where(inside, logp + lse, 0.0)  # a label on another rank: NaN here, 0 in the summary
    return Stats(lse[None], torch.ones_like(lse)[None], None if entropy is None else -entropy[None], zl[None])


def stored_logits_backward(hidden, weight, bias, labels, lse, entropy, g_logp, g_entropy, inv_t: float,
                           vocab_start: int, needs, *, config: LinearConfig, store: dict):
    """``store_logits``: d_logits written over the kept logits (one read and write), then the two
    gradient GEMMs over the whole vocabulary (d_hidden accumulated in fp32 by cuBLAS, written once)."""
    from verl_fast.kernels.logprobs_from_logits import logprobs_backward

    z = store.pop("logits", None)
    if z is None:
        raise RuntimeError("linear_logprobs with store_logits=True: its backward ran twice, but the first one turned "
                           "the kept logits into d_logits; retain_graph needs store_logits=False")
    N, H = hidden.shape
    V = weight.shape[0]
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    local, _ = _local_labels(labels, vocab_start, V)
    d_logits = logprobs_backward(z.view(1, N, V), local, lse, entropy, g_logp, g_entropy, inv_t,
                                 out=z.view(1, N, V)).view(N, V)
    d_hidden = d_weight = d_bias = None
    if need_w:
        d_weight = torch.mm(d_logits.t(), hidden)
    if need_h:
        d_hidden = torch.zeros((N, H), dtype=torch.float32, device=hidden.device)
        accumulate_dhidden(d_hidden, d_logits, weight, config, _use_cublas_for_dhidden(config, hidden))
    if need_b:
        d_bias = d_logits.sum(0, dtype=torch.float32).to(bias.dtype)
    return d_hidden, d_weight, d_bias


def linear_logprobs_triton(hidden, weight, bias, labels, inv_t: float, with_entropy: bool, tp_group=None,
                           config: Optional[LinearConfig] = None):
    """Autograd entry: hidden [N, H], weight [V, H], bias [V] or None, labels [N] (validated by the caller)."""
    if config is not None and config.store_logits:
        store: dict = {}  # this call's logits, from its forward to its backward
        impl = Impl(functools.partial(stored_logits_forward, store=store),
                    functools.partial(stored_logits_backward, config=config, store=store))
        return LinearLogprobsFunction.apply(hidden, weight, bias, labels, inv_t, with_entropy, tp_group, impl)
    impl = Impl(functools.partial(linear_logprobs_forward, config=config),
                functools.partial(linear_logprobs_backward, config=config))
    return LinearLogprobsFunction.apply(hidden, weight, bias, labels, inv_t, with_entropy, tp_group, impl)
