"""HF -> vLLM resharding, single process, against a plain torch.cat / chunk reference written here.

Every family (dense, GQA, MoE with and without a shared expert), TP 1 / 2 / 4 (kv-head
replication when TP > num_kv_heads), vocab padding, tied embeddings, both HF namings, dtype
conversion, and bad input naming the parameter.
"""

import pytest
import torch

import verl_fast
from verl_fast.ops.reshard import ModelSpec, hf_layout, plan, vllm_layout, vllm_weights
from verl_fast.ops.reshard.layout import Layout, PhysTensor

from reshard_refs import assert_same, moe_checkpoint_names, ref_vllm
from tiny_models import FAMILIES, tiny_model

# (family, TP, config overrides): TP 4 and 8 replicate kv heads (2 kv heads); vocab 300 pads to 320.
CASES = [(f, tp, {}) for f in FAMILIES for tp in (1, 2)] + [
    ("qwen2", 4, {"vocab_size": 300}), ("qwen3_moe", 4, {}), ("llama", 8, {"num_attention_heads": 8, "vocab_size": 300}),
    ("llama", 2, {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1}),
    ("qwen2_moe", 2, {"mlp_only_layers": [1]}),  # a dense layer among the MoE ones
]


@pytest.mark.parametrize("family,tp,extra", CASES, ids=lambda x: str(x).replace(" ", ""))
def test_hf_to_vllm_matches_reference(family, tp, extra):
    model = tiny_model(family, **extra)
    sd = model.state_dict()
    for t in range(tp):
        got = dict(vllm_weights(model, tensor_parallel_size=tp, tp_rank=t))
        assert_same(got, ref_vllm(sd, model.config, tp, t))


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_checkpoint_naming_source(family):
    model = tiny_model(family)
    sd = model.state_dict()
    ckpt = moe_checkpoint_names(sd, model.config)
    got = dict(vllm_weights(ckpt, model.config, tensor_parallel_size=2, tp_rank=1))
    assert_same(got, ref_vllm(sd, model.config, 2, 1))


def test_tied_embeddings_and_hf_to_hf_roundtrip():
    model = tiny_model("qwen2", tie_word_embeddings=True)
    sd = model.state_dict()
    assert "lm_head.weight" in sd  # the alias is accepted and skipped
    got = dict(vllm_weights(model, tensor_parallel_size=2, tp_rank=0))
    assert "lm_head.weight" not in got
    assert_same(got, ref_vllm(sd, model.config, 2, 0))
    spec = ModelSpec.from_hf_config(model.config)
    out = plan(hf_layout(spec), hf_layout(spec, names="checkpoint")).execute(sd)
    assert all(torch.equal(v, sd[k]) for k, v in out.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_conversion_is_torchs(dtype):
    model = tiny_model("qwen3")
    sd = model.state_dict()
    with torch.no_grad():  # values that exercise rounding ties, subnormals, overflow and NaN
        w = sd["model.layers.0.self_attn.q_proj.weight"]
        special = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 2 ** -20, -2 ** -24, 3 * 2 ** -26, 65519.0, 65520.0,
                                1e30, float("inf"), float("nan"), -0.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11])
        w.view(-1)[: special.numel()] = special
    got = dict(vllm_weights(model, tensor_parallel_size=1, dtype=dtype))
    want = {k: v.to(dtype) for k, v in ref_vllm(sd, model.config, 1, 0).items()}
    for k, v in want.items():  # bit-exact, NaN payloads aside
        nan = v.isnan()
        assert torch.equal(got[k].isnan(), nan), k
        assert torch.equal(got[k][~nan].view(torch.int16), v[~nan].view(torch.int16)), k


def test_plan_is_reusable_and_writes_in_place():
    model = tiny_model("llama")
    spec = ModelSpec.from_hf_config(model.config)
    p = verl_fast.reshard.plan(hf_layout(spec), vllm_layout(spec, 2, {0: 1}), bucket_bytes=4096)
    assert p.num_buckets == 1  # buckets bound received bytes: nothing is received here
    dst = p.allocate_destinations()
    sd = model.state_dict()
    for step in range(2):
        with torch.no_grad():
            for v in sd.values():
                v.add_(1.0)
        out = p.execute(sd, dst)
        assert all(out[k] is dst[k] for k in dst)
        assert_same(dict(out), ref_vllm(sd, model.config, 2, 1))
    stats = p.stats()
    assert stats["received_bytes"] == 0 and stats["local_bytes"] > 0


def test_one_shot_reshard_entry():
    model = tiny_model("qwen2")
    spec = ModelSpec.from_hf_config(model.config)
    out = verl_fast.reshard(model.state_dict(), hf_layout(spec), vllm_layout(spec, 1))
    assert_same(dict(out), ref_vllm(model.state_dict(), model.config, 1, 0))


# ---- bad input ---------------------------------------------------------------------------------


def test_one_shot_calls_reuse_plan_and_outputs():
    """vllm_weights(reuse=True) / reshard keep their plan and output tensors for the next call with
    the same layouts: the second call writes the new weights into the first call's tensors."""
    model = tiny_model("qwen2")
    first = dict(vllm_weights(model, tensor_parallel_size=2, tp_rank=1, reuse=True))
    pointers = {k: v.data_ptr() for k, v in first.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    second = dict(vllm_weights(model, tensor_parallel_size=2, tp_rank=1, reuse=True))
    assert {k: v.data_ptr() for k, v in second.items()} == pointers
    assert_same(second, ref_vllm(model.state_dict(), model.config, 2, 1))
    other = dict(vllm_weights(model, tensor_parallel_size=2, tp_rank=0, reuse=True))  # another shard: its own
    assert_same(other, ref_vllm(model.state_dict(), model.config, 2, 0))
    assert other["model.norm.weight"].data_ptr() != pointers["model.norm.weight"]
    spec = ModelSpec.from_hf_config(model.config)
    a = verl_fast.reshard(model.state_dict(), hf_layout(spec), vllm_layout(spec, 1))
    b = verl_fast.reshard(model.state_dict(), hf_layout(spec), vllm_layout(spec, 1))
    assert all(a[k] is b[k] for k in a)


def test_unknown_parameter_is_named():
    model = tiny_model("qwen2")
    sd = dict(model.state_dict())
    sd["model.layers.0.self_attn.rotary.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.rotary.weight"):
        dict(vllm_weights(sd, model.config))


def test_shape_mismatch_is_named():
    model = tiny_model("qwen2")
    sd = dict(model.state_dict())
    sd["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 95)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight.*\[64, 96\]"):
        dict(vllm_weights(sd, model.config))


def test_missing_parameter_is_named():
    model = tiny_model("qwen2")
    sd = dict(model.state_dict())
    del sd["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.bias"):
        dict(vllm_weights(sd, model.config))


def test_missing_shard_is_named():
    spec = ModelSpec.from_hf_config(tiny_model("qwen2").config)
    src = hf_layout(spec)
    half = [t for t in src.tensors if t.name != "model.layers.1.self_attn.o_proj.weight"]
    o = next(t for t in src.tensors if t.name == "model.layers.1.self_attn.o_proj.weight")
    piece = o.pieces[0]
    half.append(PhysTensor(o.name, 0, (32, 64), o.dtype,
                           [type(piece)(o.name, 0, 32, 0, 64, 0, 64)]))  # only the first 32 rows
    broken = Layout(src.logical, half, 1)
    with pytest.raises(ValueError, match=r"rows \[32, 64\).*model.layers.1.self_attn.o_proj.weight"):
        plan(broken, vllm_layout(spec, 2, {0: 1}))


def test_wrong_dtype_and_device_named():
    model = tiny_model("qwen2")
    spec = ModelSpec.from_hf_config(model.config)
    p = plan(hf_layout(spec), vllm_layout(spec, 1))
    sd = dict(model.state_dict())
    sd["model.norm.weight"] = sd["model.norm.weight"].double()
    with pytest.raises(TypeError, match="model.norm.weight"):
        p.execute(sd)
    dst = p.allocate_destinations()
    dst["model.layers.0.mlp.gate_up_proj.weight"] = torch.empty(64, 192).t()
    with pytest.raises(ValueError, match="gate_up_proj"):
        p.execute(model.state_dict(), dst)


def test_cpp_planner_validates_tables():
    C = verl_fast.ops.native.ext()
    a = C.ReshardPlanArgs()
    a.logical_shapes = torch.tensor([[4, 4]])
    a.logical_names = ["w"]
    a.src_tensors = torch.tensor([[0, 16, 0, 0]])
    a.src_names = ["w"]
    a.src_pieces = torch.tensor([[0, 0, 4, 0, 4, 0, 1, 4]])  # ends at element 17 > 16
    a.dst_tensors = torch.tensor([[0, 16, 0, 0]])
    a.dst_names = ["w"]
    a.dst_pieces = torch.tensor([[0, 0, 4, 0, 4, 0, 0, 4]])
    with pytest.raises(ValueError, match=r"source tensor w: piece 0 \(offset 1, pitch 4, 4 x 4\) ends past its 16"):
        C.ReshardPlan(a)
    a.src_pieces = torch.tensor([[0, 0, 4, 0, 4, 0, 0, 4]])
    a.dst_pieces = torch.tensor([[0, 0, 3, 0, 4, 0, 0, 4]])
    with pytest.raises(ValueError, match=r"destination tensor w: elements \[12, 16\) are written by no piece"):
        C.ReshardPlan(a)
    a.dst_pieces = torch.tensor([[0, 0, 4, 0, 4, 0, 0, 4]])
    p = C.ReshardPlan(a)
    with pytest.raises(ValueError, match="expected 1 source"):
        p.bind([], [torch.zeros(16)], [torch.zeros(0, dtype=torch.uint8)] * 2, [torch.zeros(0, dtype=torch.uint8)] * 2)
    u8 = [torch.zeros(0, dtype=torch.uint8)] * 2
    with pytest.raises(TypeError, match="destination w must be float32, got float64"):
        p.bind([torch.zeros(16)], [torch.zeros(16, dtype=torch.float64)], u8, u8)
    with pytest.raises(ValueError, match="source w must have 16 elements"):
        p.bind([torch.zeros(15)], [torch.zeros(16)], u8, u8)
    p.bind([torch.zeros(16)], [torch.zeros(16)], u8, u8)
    with pytest.raises(ValueError, match="bucket 5 outside"):
        p.run(5, C.ReshardPhase.copy)
