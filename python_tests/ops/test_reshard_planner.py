"""The planner and the CPU executor on random layouts: random grid splits of random logical tensors,
stored at random offsets and pitches (with garbage between pieces) in source buffers, some held
twice; destinations tile random cells with zero padding. The reference fills each destination
element by element from the pieces' definition."""

import random
from collections import OrderedDict

import pytest
import torch

from verl_fast.ops.reshard import plan
from verl_fast.ops.reshard.layout import Layout, PhysTensor, Piece


def cells(rng, rows, cols):
    rcuts = sorted({0, rows, *rng.sample(range(1, rows), min(rows - 1, rng.randint(0, 2)))}) if rows > 1 else [0, rows]
    ccuts = sorted({0, cols, *rng.sample(range(1, cols), min(cols - 1, rng.randint(0, 2)))}) if cols > 1 else [0, cols]
    return [(r0, r1 - r0, c0, c1 - c0) for r0, r1 in zip(rcuts, rcuts[1:]) for c0, c1 in zip(ccuts, ccuts[1:])]


def pack(rng, name, parts, dtype, zero_gaps):
    """Lays (logical, r0, nr, c0, nc) parts into one flat tensor at random offsets and pitches."""
    pieces, pos = [], 0
    for logical, r0, nr, c0, nc in parts:
        gap = rng.randint(0, 3)
        if gap and zero_gaps:
            pieces.append(Piece(None, 0, 1, 0, gap, pos, gap))
        pos += gap
        pitch = nc + (rng.randint(0, 2) if nr > 1 else 0)
        pieces.append(Piece(logical, r0, nr, c0, nc, pos, pitch))
        if pitch > nc and zero_gaps:
            pieces.append(Piece(None, 0, nr, 0, pitch - nc, pos + nc, pitch))
        pos += (nr - 1) * pitch + nc if pitch > nc and not zero_gaps else nr * pitch
    return PhysTensor(name, 0, (pos,), dtype, pieces)


def materialise(t, values, fill):
    flat = torch.full((t.numel,), fill, dtype=torch.float64)
    for p in t.pieces:
        for i in range(p.nrows):
            row = values[p.logical][p.row0 + i, p.col0:p.col0 + p.ncols] if p.logical else 0.0
            flat[p.offset + i * p.pitch:p.offset + i * p.pitch + p.ncols] = row
    return flat


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts(seed):
    rng = random.Random(seed)
    logical = OrderedDict((f"w{i}", (rng.randint(1, 9), rng.randint(1, 9))) for i in range(rng.randint(1, 4)))
    values = {n: torch.randn(s, dtype=torch.float64) for n, s in logical.items()}
    src_parts = [(n, *c) for n, s in logical.items() for c in cells(rng, *s)]
    src_parts += [(n, 0, s[0], 0, s[1]) for n, s in logical.items() if rng.random() < 0.3]  # a second copy
    rng.shuffle(src_parts)
    k = rng.randint(1, len(src_parts))
    src = [pack(rng, "a", src_parts[:k], torch.float32, False), pack(rng, "b", src_parts[k:], torch.float32, False)]
    src = [t for t in src if t.pieces]
    dst_parts = [(n, *c) for n, s in logical.items() for c in cells(rng, *s)]
    rng.shuffle(dst_parts)
    k = rng.randint(1, len(dst_parts))
    out_dtype = rng.choice([torch.float32, torch.float64])
    dst = [pack(rng, "x", dst_parts[:k], out_dtype, True), pack(rng, "y", dst_parts[k:], torch.float32, True)]
    dst = [t for t in dst if t.numel]
    p = plan(Layout(logical, src, 1), Layout(logical, dst, 1), tile_bytes=rng.choice([16, 32, 48, 1 << 16]))
    sources = {t.name: materialise(t, values, float("nan")).to(t.dtype) for t in src}
    # values went through float32 in the sources; the reference reads those float32 values
    as32 = {n: v.to(torch.float32).to(torch.float64) for n, v in values.items()}
    out = p.execute(sources)
    for t in dst:
        want = materialise(t, as32, 0.0).to(t.dtype)
        assert torch.equal(out[t.name], want), (seed, t.name)
    assert p.stats()["received_bytes"] == 0
