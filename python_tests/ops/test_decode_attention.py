"""The decode step's attention kernel (kernels/decode_attention.py, Triton; on CPU tensors under
TRITON_INTERPRET) against a float64 reference written here and against the matmul form the CPU runs
(``static_kv.grouped_attention``): grouped query heads, masks with holes, columns past the newest key
left unread, splits over the cache's columns, bad input."""

import math
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1", allow_module_level=True)

from verl_fast.kernels.decode_attention import BLOCK_N, decode_attention, splits_for  # noqa: E402
from verl_fast.rollout import static_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(query, key, value, keep, scale):
    """float64, head by head, over the kept columns only: [B, 1, heads, D]; a sequence with no kept
    column gives zeros."""
    b, heads, _, d = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(b, 1, heads, d, dtype=torch.float64)
    for i in range(b):
        if not keep[i].any():
            continue
        kept = keep[i]
        for h in range(heads):
            s = (key[i, h // group][kept].double() @ query[i, h, 0].double()) * scale
            out[i, 0, h] = torch.softmax(s, 0) @ value[i, h // group][kept].double()
    return out


def inputs(b, heads, kv_heads, length, d, dtype, filled, seed=0):
    """A cache whose columns from ``filled`` on hold no key (NaN there: a kernel that reads them fails),
    keys before it kept at random (left padding, finished rows), the newest column always kept."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, 1, heads, d, generator=g).to(dtype).transpose(1, 2)  # as models pass it: a view
    key = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    value = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    keep = torch.rand(b, length, generator=g) > 0.3
    keep[:, filled:] = False
    keep[:, filled - 1] = True
    nan = (~keep)[:, None, :, None].expand_as(key)
    key, value = key.masked_fill(nan, math.nan), value.masked_fill(nan, math.nan)
    return [t.to(DEVICE) for t in (query, key, value, keep)]


CASES = [  # b, heads, kv_heads, length, d, filled
    (3, 14, 2, 100, 64, 70),    # the 0.5B shape's grouping, a cache longer than its keys
    (2, 28, 4, 200, 128, 200),  # the 7B shape's, full
    (4, 12, 2, 65, 128, 1),     # one key: the newest column only
    (1, 4, 4, 300, 32, 130),    # no grouping, a block boundary inside the keys
    (2, 6, 3, 37, 80, 20),      # a head_dim that is no power of two
    (5, 16, 1, 64, 16, 64),     # all heads on one KV head, exactly one block
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_reference_and_the_matmul_form(case, dtype):
    b, heads, kv_heads, length, d, filled = case
    query, key, value, keep = inputs(b, heads, kv_heads, length, d, dtype, filled)
    scale = d ** -0.5
    out = decode_attention(query, key, value, keep, scale)
    assert out.shape == (b, 1, heads, d) and out.dtype == dtype and torch.isfinite(out).all()
    want = reference(query.cpu(), key.cpu(), value.cpu(), keep.cpu(), scale)
    # bf16: the output's rounding (values ~1, 8 mantissa bits) and the query's cast to the keys' dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=0)
    zeroed = [t.nan_to_num(0.0) for t in (key, value)]  # the matmul form multiplies every column
    matmul, _ = static_kv.grouped_attention(None, query, *zeroed, keep[:, None, None, :], scaling=scale)
    torch.testing.assert_close(out.double(), matmul.double(), atol=tol, rtol=0)


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_splitting_the_columns_over_programs_changes_nothing(splits):
    query, key, value, keep = inputs(3, 8, 2, 7 * BLOCK_N - 5, 64, torch.float32, 5 * BLOCK_N + 3, seed=1)
    want = reference(query.cpu(), key.cpu(), value.cpu(), keep.cpu(), 0.2)
    out = decode_attention(query, key, value, keep, 0.2, splits=splits)
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-5, rtol=0)


def test_a_sequence_with_no_key_gets_zeros_and_large_scores_stay_finite():
    query, key, value, keep = inputs(3, 4, 2, 90, 32, torch.float32, 90, seed=2)
    keep[1] = False
    query = query * 40  # scores ~ +-300: the running max keeps exp2 finite
    out = decode_attention(query, key, value, keep, 1.0, splits=2)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
    torch.testing.assert_close(out.cpu().double(), reference(query.cpu(), key.cpu(), value.cpu(), keep.cpu(), 1.0),
                               atol=1e-5, rtol=0)


def test_splits_fill_the_processors_twice_within_the_columns():
    assert splits_for(programs=512, length=320, device=torch.device("cpu")) == 1
    assert splits_for(programs=1, length=1000, device=torch.device("cpu")) == 2
    assert splits_for(programs=1, length=10, device=torch.device("cpu")) == 1


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, m: (q[:, :, :0], k, v, m), r"query must be \[B, heads, 1, D\]"),
    (lambda q, k, v, m: (q, k[:, :, :-1], v, m), "key and value must be"),
    (lambda q, k, v, m: (q[:, :3], k, v, m), "3 query heads do not divide over 2 KV heads"),
    (lambda q, k, v, m: (q, k, v, m.long()), "keep must be a"),
    (lambda q, k, v, m: (q, k, v, m[:, :-1]), "keep must be a"),
])
def test_bad_input_names_the_argument(bad, match):
    args = bad(*inputs(2, 4, 2, 16, 16, torch.float32, 16))
    with pytest.raises(ValueError, match=match):
        decode_attention(*args, 1.0)
    with pytest.raises(ValueError, match="splits must be a positive int, got 0"):
        decode_attention(*inputs(2, 4, 2, 16, 16, torch.float32, 16), 1.0, splits=0)


@pytest.mark.gpu
def test_the_gpu_kernel_matches_the_cpu_path():
    """The same inputs through the CUDA kernel and the CPU's matmul form."""
    query, key, value, keep = inputs(16, 28, 4, 320, 128, torch.bfloat16, 200, seed=3)
    out = decode_attention(query, key, value, keep, 128 ** -0.5)
    cpu = [t.cpu().nan_to_num(0.0) if t.is_floating_point() else t.cpu() for t in (query, key, value, keep)]
    matmul, _ = static_kv.grouped_attention(None, *cpu[:3], cpu[3][:, None, None, :], scaling=128 ** -0.5)
    torch.testing.assert_close(out.cpu().double(), matmul.double(), atol=2e-2, rtol=0)
