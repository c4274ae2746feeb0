"""FP8 rollout (rollout.quantization: fp8): the HF decode's FP8 linear layers against a float64 reference of
w8a8 with per-channel / per-token scales, their refresh after an update, the engine's sync check naming a
spoiled copy, the config's defaults and refusals, and a trainer step with rollout correction."""

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config
from verl_fast.ops.reshard import fp8
from verl_fast.rollout import fp8_linear, fp8_sync
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.factory import check_fp8_engine
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.trainer.rl_trainer import RLTrainer


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def per_row_fp8_f64(x, per_row=True):
    """float64 reference: each row (or, not ``per_row``, the whole tensor) scaled by amax / 448 (1 for zeros),
    rounded to e4m3 by torch's own cast (round to nearest even), dequantised."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True) if per_row else x.abs().amax().reshape(1, 1)
    scale = torch.where(amax > 0, (amax.float() / 448.0).double(), torch.ones_like(amax))
    q = (x / scale).float().clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return q * scale


@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (33, 128)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activations", fp8_linear.ACTIVATIONS)
def test_fp8_linear_matches_the_float64_w8a8_reference(shape, bias, activations):
    g = torch.Generator().manual_seed(shape[0])
    lin = torch.nn.Linear(shape[1], 48, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, shape[1], generator=g) * 0.1)
    layer = fp8_linear.FP8Linear(lin, fast=False, per_token=activations == "token")
    assert fp8_linear.refresh([layer]) == 1
    x = torch.randn(shape, generator=g) * 3 * torch.logspace(-2, 0, shape[0]).view(-1, 1)  # tokens' sizes differ
    x[-1] = 0.0 if shape[0] > 1 else x[-1]  # a zero row: scale 1 (per token), output the bias
    expected = per_row_fp8_f64(x, activations == "token") @ per_row_fp8_f64(lin.weight.detach()).t()
    if bias:
        expected = expected + lin.bias.detach().double()
    got = layer(x)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5), (got.double() - expected).abs().max()
    # and FP8 is not the float32 product: the quantisation is really there
    assert (got - lin(x)).abs().max() > 1e-4


def test_per_tensor_activations_differ_from_per_token_ones():
    """The two ``activations`` are different quantisations (a small token loses precision to a large one)."""
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(4, 64, generator=g) * torch.tensor([[1e-4], [1.0], [1.0], [30.0]])
    err = {}
    for activations in fp8_linear.ACTIVATIONS:
        layer = fp8_linear.FP8Linear(lin, fast=False, per_token=activations == "token")
        fp8_linear.refresh([layer])
        with torch.no_grad():  # the activations' error alone: against the FP8 weight's exact product
            err[activations] = (layer(x)[0] - x[0] @ layer.dequantized.t()).abs().max()
    assert err["token"] < 0.25 * err["tensor"], err  # the small token sits in one scale's subnormals
    with pytest.raises(ValueError, match="activations must be one of token, tensor, got 'row'"):
        fp8_linear.FP8Decode(activations="row")


@pytest.mark.parametrize("activations", fp8_linear.ACTIVATIONS)
def test_under_autocast_the_fp8_product_returns_the_layers_autocast_dtype(tiny_path, activations):
    """The trainer's float32 weights decode under bf16 autocast: every FP8 product returns bf16 as the
    layer's own would (a float32 output would cache the values in float32, doubling what the decode's
    attention reads, and carry float32 activations into the next products), and the decode's KV cache holds
    the bf16 rollout's dtypes; outside autocast the input's dtype."""
    from verl_fast.rollout import hf_decode, static_kv

    lin = torch.nn.Linear(64, 32)
    layer = fp8_linear.FP8Linear(lin, fast=False, per_token=activations == "token")
    fp8_linear.refresh([layer])
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert layer(x).dtype == torch.float32 and layer(x.bfloat16()).dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == lin(x).dtype == torch.bfloat16
    model, _ = load(tiny_path)
    ids, mask = torch.randint(3, 100, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    caches = {}
    for mode in ("bf16", "fp8"):
        kept = []
        swap = fp8_linear.FP8Decode(activations).swapped(model) if mode == "fp8" else contextlib.nullcontext()
        with swap, torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            hf_decode.decode(model, ids, mask, 3, 1.0, 0, 1.0, [-1], 0, use_graph=False, min_rows=None, keep=kept)
        cache: static_kv.StaticKV = kept[0].cache
        caches[mode] = {(t.dtype, t.shape) for t in cache.keys + cache.values}
    assert caches["fp8"] == caches["bf16"] and {d for d, _ in caches["bf16"]} == {torch.bfloat16}


@pytest.mark.gpu
@pytest.mark.parametrize("activations", fp8_linear.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_mm_product_matches_the_float64_reference(activations, dtype):
    """``torch._scaled_mm`` (both activation modes) against the float64 w8a8 reference, at the decode's M=128
    and a 7B projection's K; tolerance 2^-7 of the largest output: a bf16 output's rounding and the FP8 tensor
    cores' accumulation (a wrong scale or rounding is off by 2^-4 and more). float16: the product before the
    weight's scales is thousands of times the output, beyond float16's range unless kept in float32."""
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(3584, 512, bias=True).cuda()
    with torch.no_grad():
        lin.weight.copy_((torch.randn(512, 3584, generator=g) * 0.02).cuda())
    layer = fp8_linear.FP8Linear(lin, fast=True, per_token=activations == "token")
    fp8_linear.refresh([layer])
    x = (torch.randn(128, 3584, generator=g) * torch.logspace(-1, 1, 128).view(-1, 1)).to(dtype)
    expected = (per_row_fp8_f64(x, activations == "token") @ per_row_fp8_f64(lin.weight.detach().cpu()).t()
                + lin.bias.detach().cpu().double())
    got = layer(x.cuda()).double().cpu()
    assert torch.allclose(got, expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().max().item()), \
        (got - expected).abs().max()


def test_hf_engine_decodes_with_fp8_copies_and_restores_the_model(tiny_path):
    model, tok = load(tiny_path)
    engine = HFGenerateEngine(model, tok, fast_decode="off", quantization="fp8")
    plain = HFGenerateEngine(model, tok, fast_decode="off")
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=5, seed=3)
    prompts = [tok("What is 2 + 3?")["input_ids"], tok("Hello")["input_ids"]]
    out = engine.generate(prompts, spec)
    layers = engine._fp8.layers
    assert len(layers) == 2 * 7 and engine._fp8.refreshed == 14  # q k v o gate up down in each of 2 layers
    assert all(type(m) is not fp8_linear.FP8Linear for m in model.modules())  # swapped back
    ref = plain.generate(prompts, spec)
    assert out.response_ids.shape[0] == ref.response_ids.shape[0] == 4
    # an update by the fused AdamW (the trainer's default) leaves the weights' version counters where they
    # were: the next rollout's copies must still be the new weights quantised
    up = model.model.layers[0].mlp.up_proj
    before = up.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(torch.tensor([prompts[0]])).logits.sum().backward()
    version = up.weight._version
    optimizer.step()
    assert up.weight._version == version and not torch.equal(up.weight, before)  # moved, counter did not
    engine.generate(prompts, spec)
    assert engine._fp8.refreshed == 14
    q, scale = fp8.quantize(up.weight.detach(), "channel")
    copy = engine._fp8.layers["model.layers.0.mlp.up_proj"]
    assert torch.equal(copy.weight_fp8.view(torch.uint8), q.view(torch.uint8)) and torch.equal(copy.weight_scale, scale)
    assert engine.weight_differences(model) == []
    engine._fp8.layers["model.layers.1.self_attn.v_proj"].weight_fp8.zero_()  # a spoiled copy
    assert engine.weight_differences(model) == ["model.layers.1.self_attn.v_proj"]


def test_fp8_logprobs_stay_close_to_the_actors(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    cfg = {"actor": {"lr": 1e-3, "micro_batch_size": 8},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6, "quantization": "fp8", "hf_fast_decode": "off"},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    rows = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}} for a, b in [(1, 2), (3, 4)]]
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=lambda solution_str: float(len(solution_str) % 3),
                        config=cfg)
    assert trainer.cfg.algorithm.rollout_correction is True  # on by default with FP8
    history = trainer.fit(rows)
    for m in history:
        # FP8's rounding shows (a gap above 0) within the sync guardrail's default tolerance (0.5 a token), as
        # the run itself needs (wrong scales or layouts give gaps of nats); this tiny random model's ~0.2
        assert 0 < m["guardrails/sync_logprob_diff"] < 0.5, m["guardrails/sync_logprob_diff"]
        assert "rollout_correction/mismatch_kl" in m and "rollout_correction/is_weight_mean" in m


def test_config_defaults_and_refusals():
    base = {"rollout": {"type": "hf", "quantization": "fp8"}}
    assert config.from_dict(base).algorithm.rollout_correction is True
    assert config.from_dict({**base, "algorithm": {"rollout_correction": False}}).algorithm.rollout_correction is False
    assert config.from_dict({}).algorithm.rollout_correction is False
    with pytest.raises(ValueError, match="rollout.kv_cache_dtype=fp8 is not supported with rollout.type=hf"):
        config.from_dict({"rollout": {"type": "hf", "kv_cache_dtype": "fp8"}})
    with pytest.raises(ValueError, match="rollout.quantization=awq is not supported with rollout.type=hf"):
        config.from_dict({"rollout": {"type": "hf", "quantization": "awq"}})


def test_vllm_fp8_on_the_cpu_is_refused_in_one_line():
    pytest.importorskip("vllm")
    from verl_fast.rollout import vllm_compat

    if not vllm_compat.is_cpu_platform():
        pytest.skip("a GPU vLLM builds FP8 layers")
    with pytest.raises(ValueError, match=r"^rollout.quantization=fp8 with rollout.type=vllm needs a GPU"):
        check_fp8_engine(1)


def test_the_vllm_sync_hands_fp8_projections_and_their_scales(tiny_path):
    model, _ = load(tiny_path)
    tensors = dict(fp8_sync.fp8_tensors(model, torch.bfloat16))
    w = model.model.layers[0].self_attn.q_proj.weight.detach()
    q, s = tensors["model.layers.0.self_attn.q_proj.weight"], tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and s.shape == (1, 1)
    back = fp8.dequantize(q, s, fp8.BLOCK)
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + s.max() * 2 ** -10 + 1e-12).all()
    assert tensors["model.norm.weight"].dtype == torch.bfloat16 and "model.embed_tokens.weight_scale_inv" not in tensors


@pytest.mark.gpu
def test_vllm_block_fp8_engine_follows_the_actor(tiny_path):
    """On a GPU: a block-FP8 vLLM engine synced from the actor samples tokens whose log-probs match the
    actor's within FP8's error."""
    pytest.importorskip("vllm")
    from verl_fast.rollout.factory import build_engine

    model, tok = load(tiny_path)
    model = model.cuda()
    cfg = config.from_dict({"rollout": {"type": "vllm", "quantization": "fp8", "n": 2, "max_new_tokens": 8,
                                        "enforce_eager": True, "gpu_memory_utilization": 0.2}})
    engine = build_engine(cfg, model, tok, autocast_dtype=torch.bfloat16)
    out = engine.generate([tok("What is 2 + 3?")["input_ids"]], SamplingSpec(n=2, max_tokens=8, seed=0))
    assert out.logprobs is not None and torch.isfinite(out.logprobs).all()
    params = {k: v for k, v in engine._engine_parameters().items() if k.endswith("qkv_proj.weight")}
    assert params and all(v.dtype == torch.float8_e4m3fn for v in params.values())


def test_compiled_decode_merges_the_fp8_products(tiny_path):
    """With FP8 the decode's merged q/k/v and gate/up products stay merged (an FP8 stack per attention / MLP,
    one GEMM where the layers run three or two): the merged forward computes what the layers' FP8 copies do,
    and the layers' copies are views into the stack (one quantisation, one buffer)."""
    from verl_fast.rollout import merged_projections

    model, _ = load(tiny_path)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    decode = fp8_linear.FP8Decode()
    with torch.no_grad(), decode.swapped(model):
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert merged_projections.kind(attn) == "attention" and merged_projections.kind(mlp) == "mlp"
        stack = attn.merged_product
        assert attn.k_proj.weight_fp8.data_ptr() == stack.weight_fp8[attn.q_proj.linear.out_features:].data_ptr()
        layers_each = model(ids, use_cache=False).logits  # transformers' forwards: the layers one by one
        done = []
        merged_projections.Merged().install(model, None, done)
        assert len(done) == 4 and "merged_weight" not in attn._parameters  # no bf16 copies beside FP8
        merged = model(ids, use_cache=False).logits
        merged_projections.Merged.remove(done)
    assert "merged_product" not in attn._modules and type(attn.q_proj) is torch.nn.Linear
    torch.testing.assert_close(merged, layers_each, rtol=1e-4, atol=1e-4)
    plain = model(ids, use_cache=False).logits
    assert (plain - merged).abs().max() > 1e-4  # FP8 is really in the merged product
    assert decode.refreshed == 14 and len(decode.stacks) == 4
