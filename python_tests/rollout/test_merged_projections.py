"""The decode step's merged q/k/v and gate/up products (rollout/merged_projections.py): a model with
them installed computes what transformers' own modules compute, for every Llama-family architecture,
in float64 (prefill with sdpa and a cached decode step); what is installed is undone after; other
architectures are left alone."""

import pytest
import torch

from tiny_models import tiny_model
from verl_fast.rollout import hf_decode, static_kv
from verl_fast.rollout.merged_projections import Merged, kind


def forward_twice(model, ids, mask):
    """The prefill over ``ids`` then one decode step over a static cache: both steps' logits."""
    B, W = ids.shape
    cache = static_kv.StaticKV(model.config.num_hidden_layers, W + 1)
    cache.cols = torch.arange(W)
    causal = torch.ones(W, W, dtype=torch.bool).tril() & mask[:, None, :].bool()
    full = (causal | torch.eye(W, dtype=torch.bool))[:, None]  # the prefill attends to its own W columns
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    first = hf_decode.model_step(model, ids, full, positions, cache)
    cache.cols = torch.tensor([W])
    step_mask = torch.cat([mask.bool(), torch.ones(B, 1, dtype=torch.bool)], -1)[:, None, None, :]
    nxt = first.argmax(-1, keepdim=True)
    with static_kv.attention_set(model, static_kv.ATTENTION):
        second = hf_decode.model_step(model, nxt, step_mask, positions[:, -1:] + 1, cache)
    return first, second


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("mistral", {"sliding_window": None}),  # a windowed model decodes with generate (hf_decode.unsupported)
    ("qwen2", {}),  # q/k/v with biases, the MLP without
    ("qwen3", {}),  # per-head norms of q and k
])
def test_merged_forward_equals_the_modules(family, overrides):
    model = tiny_model(family, seed=3, dtype=torch.float64, **overrides)
    model.config._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    with torch.no_grad():
        want = forward_twice(model, ids, mask)
        merged, done = Merged(), []
        merged.install(model, None, done)
        kinds = sorted(kind(sub) for sub, _ in done)
        assert kinds == ["attention"] * 2 + ["mlp"] * 2  # both layers, both parts
        got = forward_twice(model, ids, mask)
        Merged.remove(done)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    attn = model.model.layers[0].self_attn
    assert "forward" not in attn.__dict__ and "merged_weight" not in attn._parameters
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    copy = merged.copies["model.layers.0.self_attn.merged_weight"]
    assert torch.equal(copy, torch.cat([q, k, v])) and copy.dtype == torch.float64


def test_merged_copies_in_the_given_dtype_and_kept():
    model = tiny_model("qwen2", seed=1)
    merged, done = Merged(), []
    merged.install(model, torch.bfloat16, done)
    Merged.remove(done)
    first = {k: v for k, v in merged.copies.items()}
    assert first["model.layers.1.mlp.merged_weight"].dtype == torch.bfloat16
    assert first["model.layers.1.mlp.merged_bias"] is None  # Qwen2's MLP has no bias; its q/k/v have one
    assert first["model.layers.1.self_attn.merged_bias"].shape == (64 + 2 * 32,)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.add_(1.0)
    merged.install(model, torch.bfloat16, done := [])
    Merged.remove(done)
    again = merged.copies["model.layers.1.mlp.merged_weight"]
    assert again is first["model.layers.1.mlp.merged_weight"]  # the same buffer, refreshed
    up = model.model.layers[1].mlp.up_proj.weight
    assert torch.equal(again[-up.shape[0]:], up.to(torch.bfloat16))


def test_other_architectures_are_left_alone():
    model = tiny_model("qwen2_moe", seed=0)
    merged, done = Merged(), []
    merged.install(model, None, done)
    assert done == [] and merged.copies == {}  # its attention and its experts keep their own forwards


def test_layers_that_compute_more_than_their_product_are_left_alone():
    class Adapted(torch.nn.Linear):  # as a LoRA or quantized layer: more than x @ weight.T + bias
        def forward(self, x):
            return super().forward(x) + 1.0

    model = tiny_model("llama", seed=0)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    old = attn.k_proj
    attn.k_proj = Adapted(old.in_features, old.out_features, bias=False)
    assert kind(attn) is None and kind(mlp) == "mlp"
