"""The decode step's fused rotary embedding + KV-cache write (kernels/rope_cache.py, Triton; on CPU
tensors under TRITON_INTERPRET) against a float64 reference written here and against the torch form
it replaces (transformers' ``apply_rotary_pos_emb`` and ``static_kv.StaticKV.update``): grouped and
plain heads, head sizes that are no power of two, bf16 products into bf16 / float32 caches, a strided
product, only the step's column written, bad input."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1", allow_module_level=True)

from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb  # noqa: E402

from verl_fast.kernels.rope_cache import rope_cache_write  # noqa: E402
from verl_fast.rollout import static_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tables(b, d, g):
    """A rotary table [B, 1, D] as the models build it: the two halves the same angles."""
    pos = torch.randint(0, 4000, (b, 1), generator=g).double()
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    angles = torch.cat([pos[..., None] * inv] * 2, -1)  # [B, 1, D]
    return angles.cos().float(), angles.sin().float()


def inputs(b, heads, kv_heads, d, length, qkv_dtype, cache_dtype, seed=0, stride_pad=0):
    g = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(b, 1, width + stride_pad, generator=g).to(qkv_dtype)[..., :width]
    cos, sin = tables(b, d, g)
    keys = torch.randn(b, kv_heads, length, d, generator=g).to(cache_dtype)
    values = torch.randn(b, kv_heads, length, d, generator=g).to(cache_dtype)
    return [t.to(DEVICE) for t in (qkv, cos, sin, keys, values)]


def reference(qkv, cos, sin, heads, d):
    """float64: rotated queries [B, heads, D], rotated keys and values [B, kv_heads, D]."""
    x = qkv.double().reshape(qkv.shape[0], -1, d)
    c, s = cos.double(), sin.double()  # [B, 1, D]: broadcast over heads
    rot = x * c + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * s
    kv = (x.shape[1] - heads) // 2
    return rot[:, :heads], rot[:, heads: heads + kv], x[:, heads + kv:]


CASES = [  # b, heads, kv_heads, d, length, col
    (3, 14, 2, 64, 40, 17),   # the 0.5B shape's heads
    (2, 4, 4, 8, 5, 0),       # no grouping, the first column
    (1, 6, 3, 24, 9, 8),      # a head size that is no power of two, the last column
    (4, 28, 4, 128, 3, 1),    # the 7B shape's heads
]
DTYPES = [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 1e-2),
          (torch.bfloat16, torch.float32, 1e-5)]


@pytest.mark.parametrize("dtypes", DTYPES, ids=["fp32", "bf16", "bf16_into_fp32"])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_reference(case, dtypes):
    b, heads, kv_heads, d, length, col = case
    qkv_dtype, cache_dtype, tol = dtypes
    qkv, cos, sin, keys, values = inputs(b, heads, kv_heads, d, length, qkv_dtype, cache_dtype, stride_pad=b)
    before_k, before_v = keys.clone(), values.clone()
    q = rope_cache_write(qkv, cos, sin, keys, values, torch.tensor([col], device=DEVICE), heads)
    want_q, want_k, want_v = reference(qkv.cpu(), cos.cpu(), sin.cpu(), heads, d)
    assert q.shape == (b, heads, 1, d) and q.dtype == torch.float32  # a bf16 product times the float32 table
    torch.testing.assert_close(q[:, :, 0].cpu().double(), want_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(keys[:, :, col].cpu().double(), want_k, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(values[:, :, col].cpu().double(), want_v, atol=0, rtol=0)  # a cast, exact
    others = [c for c in range(length) if c != col]
    assert torch.equal(keys[:, :, others], before_k[:, :, others])
    assert torch.equal(values[:, :, others], before_v[:, :, others])


@pytest.mark.parametrize("dtypes", DTYPES, ids=["fp32", "bf16", "bf16_into_fp32"])
def test_matches_the_torch_form(dtypes):
    """The queries and the cache the unfused step leaves: transformers' rotation, then the cache's update."""
    qkv_dtype, cache_dtype, _ = dtypes
    b, heads, kv_heads, d, length, col = 3, 14, 2, 64, 20, 11
    qkv, cos, sin, keys, values = inputs(b, heads, kv_heads, d, length, qkv_dtype, cache_dtype, seed=3)
    cache = static_kv.StaticKV(1, length)
    cache.keys[0], cache.values[0] = keys.clone(), values.clone()
    cache.cols = torch.tensor([col], device=DEVICE)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k, v = (x.reshape(b, 1, -1, d).transpose(1, 2) for x in (q, k, v))
    want_q, k = apply_rotary_pos_emb(q, k, cos, sin)
    want_k, want_v = cache.update(k, v, 0)
    got_q = rope_cache_write(qkv, cos, sin, keys, values, cache.cols, heads)
    assert got_q.dtype == want_q.dtype
    # one rounding apart at most: the fused multiply-add against a product rounded before its sum
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(keys, want_k, atol=1e-5, rtol=1e-2 if cache_dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(values, want_v)


def test_the_cache_hook_applies_to_decode_steps_only():
    b, heads, kv_heads, d = 2, 4, 2, 8
    qkv, cos, sin, keys, values = inputs(b, heads, kv_heads, d, 6, torch.float32, torch.float32)
    cache = static_kv.StaticKV(1, 6, fused=True)
    cache.cols = torch.tensor([2], device=DEVICE)
    assert cache.write_rotated(0, qkv, cos, sin, heads) is None  # the prefill: no cache yet
    cache.keys[0], cache.values[0] = keys, values
    assert cache.write_rotated(0, qkv.expand(b, 3, -1), cos, sin, heads) is None  # several columns
    assert cache.write_rotated(0, qkv, cos[..., :4], sin[..., :4], heads) is None  # a partial rotary table
    assert cache.write_rotated(0, qkv, cos, sin, heads).shape == (b, heads, 1, d)
    assert static_kv.StaticKV(1, 6).write_rotated(0, qkv, cos, sin, heads) is None  # not fused


@pytest.mark.parametrize("bad,match", [("cache", "keys and values"), ("qkv", "qkv must be"), ("cos", "cos must be"),
                                       ("col", "col must be"), ("odd", "even")])
def test_bad_input_names_the_argument(bad, match):
    qkv, cos, sin, keys, values = inputs(2, 4, 2, 8, 5, torch.float32, torch.float32)
    col, heads = torch.tensor([1], device=DEVICE), 4
    if bad == "cache":
        values = values[:, :1]
    elif bad == "qkv":
        heads = 6
    elif bad == "cos":
        cos = cos[:1]
    elif bad == "col":
        col = col.int()
    else:
        qkv, cos, sin, keys, values = inputs(2, 4, 2, 7, 5, torch.float32, torch.float32)
        cos, sin = cos[..., :7].contiguous(), sin[..., :7].contiguous()  # a table of 7 angles
    with pytest.raises(ValueError, match=match):
        rope_cache_write(qkv, cos, sin, keys, values, col, heads)
