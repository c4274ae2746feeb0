"""The static-cache decode (rollout/hf_decode.py) serving tiny random-weight Qwen2-VL / Qwen2.5-VL models:
rows with 0, 1 and 2 images, left-padded, decode what ``generate`` decodes with the same images (greedy
tokens exactly, log-probs within float tolerance), sampled tokens follow the float64 softmax of the
model's own forward with the images (a chi-square test), image placeholders are never drawn, and the
engine picks the loop for a vision-language model (falling back to ``generate`` with one logged reason
where it cannot). On a GPU (gpu-marked): the CUDA-graph and compiled decode, fp32 exactly and the
trainer's bf16 autocast within a bf16 margin."""

import logging
import os

import pytest
import torch

pytest.importorskip("PIL")

from test_hf_decode import reference_probs  # noqa: E402
from tiny_vlm import VLM_FAMILIES, build_vlm, square_image  # noqa: E402
from verl_fast.models import vision  # noqa: E402
from verl_fast.records.generation import SamplingSpec  # noqa: E402
from verl_fast.rollout import merged_projections  # noqa: E402
from verl_fast.rollout.hf_engine import HFGenerateEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")

# (images, extra words) a row: 0, 1 and 2 pictures of two sizes, prompts of different lengths (left padding)
ROWS = [(0, 0), (1, 3), (2, 1), (1, 0), (0, 5)]


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm(request):
    return build_vlm(request.param)


def vlm_prompts(processor, rows=ROWS):
    """Token ids and ``VisionInputs`` (None for a text row) of prompts with the given image counts."""
    ids, images = [], []
    for k, (count, words) in enumerate(rows):
        pictures = [square_image(1 + (j + k) % 9, 56 + 28 * ((j + k) % 2), k) for j in range(count)]
        picture = f"<|vision_start|>{processor.image_token}<|vision_end|>"
        text = picture * count + "how many red squares?" + " one" * words
        if count:
            row, inputs = processor.encode(text, pictures)
        else:
            row, inputs = processor.tokenizer(text, add_special_tokens=False)["input_ids"], None
        ids.append(row)
        images.append(inputs)
    return ids, images


def own_logits(model, prompt, response, inputs):
    """The model's own forward over ``prompt + response`` with the prompt's images (M-RoPE positions from
    its rope index): float64 logits [len(response) + 1, V] predicting each response token and the next."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(response)], device=device)
    mask = torch.ones_like(ids)
    keywords = vision.model_inputs(model, ids, mask, [inputs])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **keywords).logits[0, len(prompt) - 1 :]
    return logits.double().cpu()


def assert_greedy_within_bf16(model, prompts, images, out):
    """Each greedy token is the argmax of the model's own float32 forward with the images within a bf16
    margin, and its log-prob agrees with that forward's (near-ties may break either way in bf16)."""
    for row in range(out.num_sequences):
        p = int(out.prompt_index[row])
        length = int(out.response_mask[row].sum())
        response = out.response_ids[row, :length]
        logits = own_logits(model, prompts[p], response.tolist(), images[p])[:-1]
        allowed = logits.index_fill(-1, torch.tensor(vision.placeholder_ids(model)), float("-inf"))  # never drawn
        chosen = logits.gather(-1, response[:, None]).squeeze(-1)
        assert (allowed.max(-1).values - chosen).max() < 0.1, row
        want = torch.log_softmax(logits, -1)
        torch.testing.assert_close(out.logprobs[row, :length].double(), want.gather(-1, response[:, None]).squeeze(-1),
                                   atol=5e-2, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_equals_generate_with_the_same_images(vlm, device):
    model, processor = vlm
    model.to(device)
    prompts, images = vlm_prompts(processor)
    fast = HFGenerateEngine(model, processor.tokenizer, fast_decode="on")
    plain = HFGenerateEngine(model, processor.tokenizer, fast_decode="off")
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=12)
    a, b = fast.generate(prompts, spec, vision=images), plain.generate(prompts, spec, vision=images)
    assert fast.last_mode == ("graph" if device == "cuda" else "eager") and plain.last_mode == "generate"
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert a.finish_reasons == b.finish_reasons
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    model.to("cpu")


def test_placeholders_never_drawn_greedy_like_generate(vlm):
    """A model whose head prefers ``<|image_pad|>``: the loop's greedy tokens are still ``generate``'s
    (which suppresses the placeholders), sampled rows never draw one, and the log-probs stay the
    unfiltered softmax's."""
    model, processor = vlm
    original = model.lm_head.weight.detach().clone()
    with torch.no_grad():
        model.lm_head.weight[model.config.image_token_id] *= 50
    try:
        prompts, images = vlm_prompts(processor)
        fast = HFGenerateEngine(model, processor.tokenizer, fast_decode="on")
        plain = HFGenerateEngine(model, processor.tokenizer, fast_decode="off")
        greedy = SamplingSpec(temperature=0.0, max_tokens=6)
        a, b = fast.generate(prompts, greedy, vision=images), plain.generate(prompts, greedy, vision=images)
        assert fast.last_mode == "eager" and torch.equal(a.response_ids, b.response_ids)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)  # (log-probs near -20 here)
        sampled = fast.generate(prompts, SamplingSpec(n=8, temperature=1.0, max_tokens=6, seed=0), vision=images)
        drawn = sampled.response_ids[sampled.response_mask.bool()]
        assert drawn.numel() > 0 and not torch.isin(drawn, torch.tensor(vision.placeholder_ids(model))).any()
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(original)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("count", [1, 2])
def test_sampled_tokens_follow_the_models_own_forward(vlm, count, device):
    """3,000 samples of one prompt with ``count`` images, two tokens each: the first tokens' counts
    (the prefill with the images) and the second tokens' counts per first token (a decode step at the
    M-RoPE text positions) against the float64 temperature / top-k / top-p distribution of the model's
    own forward with the images, by a chi-square test; every log-prob the unfiltered softmax's."""
    model, processor = vlm
    model.to(device)
    temperature, top_k, top_p = 0.8, 5, 0.95
    prompts, images = vlm_prompts(processor, [(count, 2)])
    engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="on")
    samples = 3000
    out = engine.generate(prompts, SamplingSpec(n=samples, temperature=temperature, top_k=top_k, top_p=top_p,
                                                max_tokens=2, seed=0), vision=images)
    assert engine.last_mode == "eager"  # the loop, not generate; two tokens are too few steps to capture a graph
    never = vision.placeholder_ids(model)

    def distribution(logits):
        filtered = logits.clone()
        filtered[never] = float("-inf")  # generate's suppression comes before the warpers
        return reference_probs(filtered, temperature, top_k, top_p), torch.log_softmax(logits / temperature, -1)

    first = out.response_ids[:, 0]
    groups = [(torch.ones(samples, dtype=torch.bool), [], first)]  # (rows, response before, tokens drawn)
    groups += [(first == t, [int(t)], out.response_ids[first == t, 1]) for t in first.unique()
               if int(t) not in engine_stop_ids(model, processor)]
    chi2, dof = 0.0, 0
    for rows, before, drawn in groups:
        probs, logp = distribution(own_logits(model, prompts[0], before, images[0])[-1])
        counts = torch.bincount(drawn, minlength=probs.shape[0]).double()
        expected = drawn.numel() * probs
        assert (counts[expected == 0] == 0).all(), "a filtered token was drawn"
        torch.testing.assert_close(out.logprobs[rows, len(before)].double(), logp[drawn], atol=1e-4, rtol=0)
        cells = expected >= 5
        chi2 += float(((counts - expected)[cells] ** 2 / expected[cells]).sum())
        dof += max(int(cells.sum()) - 1, 0)
    assert dof >= 4
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))  # chi-square survival
    assert p_value > 1e-3, (chi2, dof)
    model.to("cpu")


def test_compiled_decode_steps_match_generate(vlm):
    """``compile_decode``: the decode steps' forward compiled (Inductor's CPU code), the language model's
    q/k/v and gate/up products merged, gives ``generate``'s greedy tokens and log-probs with the images."""
    import torch._dynamo

    torch._dynamo.reset()
    model, processor = vlm
    prompts, images = vlm_prompts(processor)
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=10)
    want = HFGenerateEngine(model, processor.tokenizer, fast_decode="off").generate(prompts, spec, vision=images)
    engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="on", compile_decode=True)
    got = engine.generate(prompts, spec, vision=images)
    assert engine.fast_failed is None and engine.last_mode == "eager"
    assert {k.rsplit(".", 2)[-2] for k in engine._compiled.merged.copies} == {"self_attn", "mlp"}
    assert torch.equal(got.response_ids, want.response_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_compiled_decode_compiles_once_whatever_training_leaves_on_the_model():
    """What an update and ``generate`` leave on the model between rollouts -- gradient checkpointing turned on
    (the update's out-of-memory re-plan, ``sharding.enable_checkpointing``) and trained with, Qwen2.5-VL's cached
    rope deltas (a ``generate`` call) -- compiles the decode's forward no second time; the model keeps both."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from verl_fast.models.wrapping import hf_module
    from verl_fast.strategies import sharding

    torch._dynamo.reset()
    model, processor = build_vlm("qwen2_5_vl")
    prompts, images = vlm_prompts(processor, ROWS[1:3])
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=3)
    engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="on", compile_decode=True)

    def compiles_of_a_rollout():
        before = counters["stats"]["unique_graphs"]
        engine.generate(prompts, spec, vision=images)
        assert engine.fast_failed is None and engine.last_mode == "eager"
        return counters["stats"]["unique_graphs"] - before

    assert compiles_of_a_rollout() == 2  # the forward and the sampling
    sharding.enable_checkpointing(hf_module(model))
    model.train()
    ids = torch.tensor([prompts[0]])
    mask = torch.ones_like(ids)
    inputs = vision.model_inputs(model, ids, mask, [images[0]])
    model(input_ids=ids, attention_mask=mask, **inputs).logits.sum().backward()  # the update's forward and backward
    model.eval()
    assert compiles_of_a_rollout() == 0
    HFGenerateEngine(model, processor.tokenizer, fast_decode="off").generate(prompts, spec, vision=images)
    deltas = model.model.rope_deltas
    assert deltas is not None  # generate's, kept on the model
    assert compiles_of_a_rollout() == 0
    assert model.model.rope_deltas is deltas and model.model.language_model.layers[0].gradient_checkpointing


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_rotary_cache_write_takes_the_mrope_tables(vlm, device, monkeypatch):
    """``fused_kernels``: the merged attention's rotary embedding and cache write in one kernel
    (``kernels.rope_cache``) from the M-RoPE cos / sin tables; the sampling stays torch's (it leaves the
    placeholders out). Greedy tokens and log-probs: ``generate``'s."""
    pytest.importorskip("triton")
    from verl_fast.kernels import rope_cache

    model, processor = vlm
    model.to(device)
    prompts, images = vlm_prompts(processor)
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=8)
    want = HFGenerateEngine(model, processor.tokenizer, fast_decode="off").generate(prompts, spec, vision=images)
    ran = []
    write = rope_cache.rope_cache_write
    monkeypatch.setattr(rope_cache, "rope_cache_write", lambda *a, **k: ran.append(1) or write(*a, **k))
    engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="on", fused_kernels="on")
    done = []
    merged_projections.Merged().install(model, None, done)
    try:
        got = engine.generate(prompts, spec, vision=images)
    finally:
        merged_projections.Merged.remove(done)
    assert engine.fast_failed is None and len(ran) >= model.config.get_text_config().num_hidden_layers
    assert torch.equal(got.response_ids, want.response_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    model.to("cpu")


def engine_stop_ids(model, processor):
    """The ids that end a row (after one, a row decodes pads)."""
    from verl_fast.rollout.hf_engine import eos_token_ids

    return set(eos_token_ids(model, processor.tokenizer))


def test_engine_falls_back_to_generate_with_one_logged_reason(vlm, caplog, monkeypatch):
    """A vision-language model the loop cannot serve (here eager attention) decodes through ``generate``,
    the reason logged once however many calls; the loop itself serves the model in sdpa."""
    model, processor = vlm
    prompts, images = vlm_prompts(processor)
    spec = SamplingSpec(temperature=0.0, max_tokens=4)
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="on")
        with caplog.at_level(logging.INFO, logger="verl_fast.rollout.hf_engine"):
            for _ in range(2):
                engine.generate(prompts, spec, vision=images)
                assert engine.last_mode == "generate"
        told = [r.getMessage() for r in caplog.records if "decodes through generate" in r.getMessage()]
        assert len(told) == 1 and "attention implementation 'eager'" in told[0], told
    finally:
        model.config._attn_implementation = before
    assert vision.decode_unsupported(model) is None
    assert engine.turn_cache() is None  # a later turn has no images: multi-turn continuation stays text only
    monkeypatch.setattr(type(model.model), "get_rope_index", None)  # a vision-language model without a rope index
    engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="on")
    with caplog.at_level(logging.INFO, logger="verl_fast.rollout.hf_engine"):
        engine.generate([prompts[0]], spec, vision=[images[0]])
    assert engine.last_mode == "generate" and "has no get_rope_index" in caplog.records[-1].getMessage()


@pytest.mark.gpu
def test_compiled_graph_decode_on_cuda(vlm):
    """The bench's setting on a GPU: the compiled decode steps captured in CUDA graphs; fp32 gives
    ``generate``'s greedy tokens exactly, the trainer's bf16 autocast each token within a bf16 margin of
    the model's own float32 forward with the images."""
    model, processor = vlm
    model.to("cuda")
    prompts, images = vlm_prompts(processor)
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=16)
    want = HFGenerateEngine(model, processor.tokenizer, fast_decode="off").generate(prompts, spec, vision=images)
    for autocast in (None, torch.bfloat16):
        engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="on", compile_decode=True,
                                  autocast_dtype=autocast, fused_kernels="auto")
        got = engine.generate(prompts, spec, vision=images)
        assert engine.last_mode == "graph" and engine.fast_failed is None
        if autocast is None:
            assert torch.equal(got.response_ids, want.response_ids)
            torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
        else:
            assert_greedy_within_bf16(model, prompts, images, got)
    model.to("cpu")
