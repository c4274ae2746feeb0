"""FP8 e4m3 quantisation with block scales (csrc/reshard/fp8.h, verl_fast/ops/reshard/fp8.py) against a
float64 reference written here: scale = amax / 448 per block (1 for an all-zero block), round to nearest
even on e4m3's grid, saturation at 448; every stride class the reshard tests use (contiguous, transposed,
row and column slices, views into a fused destination), odd sizes, partial edge blocks, per-channel
scales; and the CUDA kernel against the CPU one, byte for byte."""

import math

import pytest
import torch

from verl_fast.ops.reshard import fp8

E4M3_MAX = 448.0


def e4m3_round(v):
    """float64 -> the nearest e4m3fn value (ties to even), saturated: the reference, value by value."""
    out = []
    for x in v.flatten().tolist():
        a = abs(x)
        if a >= E4M3_MAX:
            q = E4M3_MAX
        else:
            # the grid spacing: 2^(e - 3) for a normal value of exponent e >= -6; 2^-9 below 2^-6
            quantum = 2.0 ** (max(math.floor(math.log2(a)), -6) - 3) if a > 0 else 2.0 ** -9
            q = round(a / quantum) * quantum  # Python's round: ties to even
            q = min(q, E4M3_MAX)
        out.append(math.copysign(q, x))
    return torch.tensor(out, dtype=torch.float64).reshape(v.shape)


def reference(x, block):
    """(q as float64 values, scales float32) of the quantisation fp8.h describes, in float64."""
    rows, cols = x.shape
    br, bc = (1, cols) if block == "channel" else block
    xs = x.double()
    q = torch.empty_like(xs)
    scales = torch.empty(-(-rows // br), -(-cols // bc), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = xs[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = float(part.abs().max()) if part.numel() else 0.0
            # the scale as stored: float32 of amax / 448 (float32 division, exact in float64 then rounded)
            scale = torch.tensor(amax, dtype=torch.float32) / torch.tensor(E4M3_MAX, dtype=torch.float32) \
                if amax > 0 else torch.tensor(1.0)
            scales[i, j] = scale
            # x / scale rounded to float32 (IEEE division), then to e4m3
            v = (part.float() / scale.float()).double()
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = e4m3_round(v)
    return q, scales


def check(x, block, **kwargs):
    q, s = fp8.quantize(x, block, **kwargs)
    rq, rs = reference(x, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s.cpu(), rs), (s, rs)
    assert torch.equal(q.cpu().double(), rq), (q.double() - rq).abs().max()
    return q, s


SHAPES = [(1, 1), (3, 5), (128, 128), (130, 257), (256, 64), (37, 300)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [(128, 128), "channel", (16, 32)])
def test_matches_the_float64_reference(shape, dtype, block):
    g = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1]).clamp(max=60)).to(dtype)
    check(x, block)


@pytest.mark.parametrize("kind", ["transposed", "row_slice", "col_slice", "stepped"])
def test_every_stride_class(kind):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(300, 260, generator=g).to(torch.bfloat16)
    x = {"transposed": base.t(), "row_slice": base[7:200], "col_slice": base[:, 3:250],
         "stepped": base[::2, ::3]}[kind]
    assert not x.is_contiguous() or x.storage_offset()  # a row slice: contiguous rows at an offset
    check(x, (128, 128))


def test_writes_in_place_into_a_fused_destination():
    """q, k and v each quantised into their rows of one fused weight and its scale rows, as the sync does."""
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(r, 192, generator=g).to(torch.bfloat16) for r in (256, 128, 128)]
    fused = torch.full((512, 192), float("nan")).to(fp8.FP8)
    scales = torch.full((4, 2), -1.0)
    row = 0
    for p in parts:
        fp8.quantize(p, (128, 128), out=fused[row:row + p.shape[0]], scale_out=scales[row // 128:(row + p.shape[0]) // 128])
        row += p.shape[0]
    q, s = reference(torch.cat(parts), (128, 128))  # block rows never straddle two parts here
    assert torch.equal(fused.double(), q) and torch.equal(scales, s)


def test_zero_blocks_saturation_ties_and_subnormals():
    x = torch.zeros(4, 256)
    x[1, 128:] = 1.0                                    # a block of equal values: each exactly 448
    x[2, 128], x[2, 129:135] = 1.0, torch.tensor([3e-5, -1e-5, 2e-6, 1e-4, 5e-7, 3.4877e-5])  # e4m3 subnormals
    x[3, 0], x[3, 1:4] = 448.0, torch.tensor([1.0625, 1.1875, 17.0])
    q, s = check(x, (2, 128))
    assert s[0, 0] == 1.0 and torch.equal(q[:2, :128].float(), torch.zeros(2, 128))  # the all-zero block
    assert torch.equal(q[1, 128:].float(), torch.full((128,), 448.0))
    codes = q[2, 129:135].view(torch.uint8) & 0x7F  # subnormal codes: exponent bits 0, mantissa not
    assert ((codes > 0) & (codes < 0x08)).sum() >= 2 and codes[-1] == 0x08  # the last rounds up to 2^-6
    # 1.0625 (between 1 and 1.125) ties to 1; 1.1875 ties to 1.25 (the even code); 17 to 16
    assert q[3, 1].float() == 1.0 and q[3, 2].float() == 1.25 and q[3, 3].float() == 16.0


def test_rounding_of_every_float32_neighbourhood_of_the_grid():
    """Every e4m3 value, its midpoints to its neighbours and one float32 step either side of each midpoint,
    through a block whose scale is 1 (its amax 448)."""
    grid = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    values = torch.cat([values, -values, torch.tensor([448.0, 460.0, 470.0])])
    x = values.reshape(1, -1)
    check(x, (1, x.shape[1]))


def test_dequantised_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 384, generator=g)
    q, s = fp8.quantize(x, (128, 128))
    back = fp8.dequantize(q, s, (128, 128))
    bound = x.abs() * 2 ** -4 + fp8.dequantize(torch.ones_like(q), s, (128, 128)) * 2 ** -10
    assert ((back - x).abs() <= bound + 1e-12).all()


def test_bad_arguments_are_named():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        fp8.quantize(torch.randn(4), (128, 128))
    with pytest.raises(ValueError, match="block must be 'channel' or"):
        fp8.quantize(x, (0, 128))
    with pytest.raises(ValueError, match=r"scale must be a 2-D tensor \(one float32 scale per block\) of shape \[1, 1\]"):
        fp8.quantize(x, (128, 128), scale_out=torch.empty(2, 1))
    with pytest.raises(ValueError, match=r"dst must be a 2-D tensor .* of shape \[4, 4\]"):
        fp8.quantize(x, (128, 128), out=torch.empty(4, 5, dtype=fp8.FP8))
    with pytest.raises(TypeError, match="src must be float32, float64, bfloat16 or float16, got int64"):
        fp8.quantize(torch.ones(4, 4, dtype=torch.long), (128, 128))


def many_sources(device="cpu"):
    """40 tensors (more than one CUDA launch's 32), dtypes changing along the list, contiguous ones (the
    vectorised path), transposed / stepped / unaligned ones (element by element), rows of one, odd widths."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(40):
        rows, cols = [(130, 256), (1, 72), (64, 40), (200, 130), (3, 5)][i % 5]
        dtype = [torch.bfloat16, torch.float32, torch.float16, torch.float64][(i // 7) % 4]
        base = (torch.randn(rows + 2, cols + 8, generator=g) * 2.0 ** (i % 9 - 4)).to(dtype)
        x = [base[:rows, :cols], base[1:rows + 1, 8:cols + 8], base.t().contiguous().t()[:rows, :cols],
             base[:rows, 1:cols + 1]][i % 4]
        out.append(x.to(device))
    return out


@pytest.mark.parametrize("block", [(128, 128), "channel", (16, 32)])
def test_quantize_many_matches_the_float64_reference(block):
    """One call quantises every tensor of a list into views of a fused destination, each as quantize would."""
    sources = many_sources()
    rows = sum(x.shape[0] for x in sources)
    cols = max(x.shape[1] for x in sources)
    fused = torch.zeros(rows, cols + 3, dtype=fp8.FP8)  # row stride not a multiple of 16
    outs, scales, at = [], [], 0
    for x in sources:
        outs.append(fused[at:at + x.shape[0], : x.shape[1]])
        scales.append(torch.full(fp8.scale_shape(tuple(x.shape), block), -1.0))
        at += x.shape[0]
    fp8.quantize_many(sources, outs, scales, block)
    for x, q, s in zip(sources, outs, scales):
        rq, rs = reference(x, block)
        assert torch.equal(s, rs) and torch.equal(q.double(), rq)


def test_quantize_many_names_the_bad_tensor():
    x = torch.randn(4, 4)
    ok = (fp8.quantize(x)[0], torch.empty(1, 1))
    with pytest.raises(ValueError, match="must be as long"):
        fp8.quantize_many([x, x], [ok[0]], [ok[1]])
    with pytest.raises(ValueError, match=r"scale\[1\] must be a 2-D tensor"):
        fp8.quantize_many([x, x], [ok[0], ok[0].clone()], [ok[1], torch.empty(2, 2)])
    with pytest.raises(TypeError, match=r"outs\[0\] must be float8_e4m3fn"):
        fp8.quantize_many([x], [torch.empty(4, 4)], [ok[1]])
    fp8.quantize_many([], [], [])  # nothing to do


def test_nan_keeps_its_sign_and_inf_saturates():
    x = torch.tensor([[float("nan"), -float("nan"), 1.0, -3.0, 1e30, -1e30]])
    q, s = fp8.quantize(x, "channel")
    codes = q.view(torch.uint8).tolist()[0]
    assert codes[:2] == [0x7F, 0xFF] and codes[4:] == [0x7E, 0xFE] and s.item() == pytest.approx(1e30 / 448)


def extreme_sources():
    """16-bit blocks whose scale sits at and beyond fp8_divide's range (fp8_reciprocal_ok: 2^-60 .. 2^60; the
    kernel divides outside it), with signed zeros and subnormal quotients inside each block."""
    g = torch.Generator().manual_seed(6)
    out = []
    for dtype, exps in [(torch.bfloat16, [-100, -70, -51, -52, 0, 68, 69, 120]), (torch.float16, [-20, -14, 0, 12])]:
        for e in exps:
            x = torch.randn(64, 128, generator=g) * 2.0 ** e
            x[0, :4] = torch.tensor([0.0, -0.0, 2.0 ** (e - 40), -(2.0 ** (e - 40))])
            out.append(x.to(dtype))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), "channel", (16, 32)])
def test_cuda_quantize_many_matches_cpu_byte_for_byte(block):
    sources = many_sources() + extreme_sources()
    def run(device):
        outs = [torch.empty(x.shape, dtype=fp8.FP8, device=device) for x in sources]
        scales = [torch.empty(fp8.scale_shape(tuple(x.shape), block), device=device) for x in sources]
        fp8.quantize_many([x.to(device) for x in sources], outs, scales, block)
        return [o.cpu().view(torch.uint8) for o in outs], [s.cpu() for s in scales]
    (q, s), (qc, sc) = run("cpu"), run("cuda")
    assert all(torch.equal(a, b) for a, b in zip(q, qc)) and all(torch.equal(a, b) for a, b in zip(s, sc))


@pytest.mark.gpu
def test_cuda_nan_and_inf_match_cpu():
    x = torch.randn(4, 256)
    x[0, :8] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30])
    x[1, 3] = float("nan")
    for block in [(2, 128), "channel"]:
        q, s = fp8.quantize(x, block)
        qc, sc = fp8.quantize(x.cuda(), block)
        # a NaN's sign means nothing: the hardware conversion (sm_89+) writes the one canonical NaN code
        nan = lambda codes: torch.where((codes & 0x7F) == 0x7F, 0x7F, codes)  # noqa: E731
        assert torch.equal(nan(qc.cpu().view(torch.uint8)), nan(q.view(torch.uint8)))
        torch.testing.assert_close(sc.cpu(), s, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu_byte_for_byte(block, dtype):
    g = torch.Generator().manual_seed(4)
    for shape in SHAPES + [(3584, 3584), (18944, 3584)]:
        base = (torch.randn(shape, generator=g) * 3).to(dtype)
        for x in (base, base.t(), base[1:, 2:]):
            q, s = fp8.quantize(x, block)
            qc, sc = fp8.quantize(x.cuda(), block)
            assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(sc.cpu(), s)
