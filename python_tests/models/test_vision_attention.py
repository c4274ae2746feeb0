"""The vision tower's batched segment attention (models/vision_attention.py): the tiny Qwen2-VL / Qwen2.5-VL
towers give, in float64, the outputs and gradients of transformers' own per-segment sdpa loop over
pictures of several grids (Qwen2.5-VL's edge windows of other lengths included), in one attention call
per distinct segment length and block where sdpa makes one per segment; the switch restores the tower's
implementation and leaves the language model's alone."""

import collections

import pytest
import torch

pytest.importorskip("PIL")

from tiny_vlm import VLM_FAMILIES, build_vlm  # noqa: E402
from verl_fast.models import vision_attention  # noqa: E402

# (t, h, w) patch grids: a 448 x 448 picture (16 windows of 64 patches), grids the 8 x 8 window does not
# divide (edge windows of other lengths), a small one
GRIDS = [[[1, 32, 32]], [[1, 32, 32], [1, 12, 20], [1, 6, 10], [1, 4, 4]], [[1, 10, 14], [1, 10, 14]]]


def tower_inputs(tower, grids, seed):
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids)
    c = tower.config
    width = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
    return torch.randn(int(grid.prod(-1).sum()), width, generator=g, dtype=torch.float64), grid


def counted_sdpa(monkeypatch):
    """Counts the calls of torch's scaled_dot_product_attention (and the segments each took)."""
    calls = collections.Counter()
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, *args, **kwargs):
        calls["calls"] += 1
        calls["segments"] += q.shape[0]
        return original(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    return calls


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm64(request):
    model, _ = build_vlm(request.param)
    return model.double()


@pytest.mark.parametrize("grids", GRIDS)
def test_outputs_and_gradients_equal_the_per_segment_loop(vlm64, grids, monkeypatch):
    tower = vlm64.model.visual
    pixels, grid = tower_inputs(tower, grids, seed=len(grids))
    cotangent = torch.randn(int(grid.prod(-1).sum()) // 4, vlm64.config.text_config.hidden_size,
                            generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run():
        tower.zero_grad(set_to_none=True)
        x = pixels.clone().requires_grad_(True)
        out = tower(x, grid_thw=grid).pooler_output
        (out * cotangent).sum().backward()
        return out.detach(), x.grad, {n: p.grad.clone() for n, p in tower.named_parameters()}

    calls = counted_sdpa(monkeypatch)
    want, want_dx, want_dw = run()
    looped = dict(calls)
    calls.clear()
    with vision_attention.batched(vlm64):
        got, got_dx, got_dw = run()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(got_dx, want_dx, atol=1e-10, rtol=0)
    for name, grad in want_dw.items():
        torch.testing.assert_close(got_dw[name], grad, atol=1e-10, rtol=0, msg=name)
    assert calls["segments"] == looped["segments"] == looped["calls"]  # the same segments, one call each before
    blocks = len(tower.blocks)
    # a grid's segments have at most 4 lengths (whole windows, the right / bottom edge's, the corner's)
    assert calls["calls"] <= blocks * 4 * len({tuple(g) for g in grids})
    if vlm64.config.model_type == "qwen2_5_vl":  # windows: many segments of one length
        assert calls["calls"] < looped["calls"]
    if grids == GRIDS[0] and vlm64.config.model_type == "qwen2_5_vl":  # one 448 x 448 picture: 16 windows
        assert calls["calls"] == blocks and looped["calls"] > 8 * blocks
    if grids == GRIDS[2] and vlm64.config.model_type == "qwen2_vl":  # two pictures of one size, no windows
        assert calls["calls"] == blocks and looped["calls"] == 2 * blocks  # one call a block, not one a picture


def test_the_switch_restores_the_tower_and_leaves_the_language_model(vlm64):
    vision, text = vlm64.config.vision_config, vlm64.config.get_text_config()
    before = text._attn_implementation
    with vision_attention.batched(vlm64):
        assert vision._attn_implementation == vision_attention.ATTENTION
        assert text._attn_implementation == before
    assert vision._attn_implementation == "sdpa"
    vision._attn_implementation = "eager"  # another implementation: left as it is
    try:
        with vision_attention.batched(vlm64):
            assert vision._attn_implementation == "eager"
    finally:
        vision._attn_implementation = "sdpa"


def test_a_query_without_segments_is_refused():
    q = torch.zeros(2, 4, 8, 16)
    with pytest.raises(ValueError, match=r"query \[1, heads, T, D\] with cu_seq_lens_q; got query \[2, 4, 8, 16\]"):
        vision_attention.segment_attention(None, q, q, q)
