"""Vision-language actors: exact response log-probs with images against the model's own forward, the
vision tower frozen, LoRA on the language model only."""

import contextlib
import copy

import pytest
import torch

pytest.importorskip("PIL")

from tiny_vlm import VLM_FAMILIES, build_vlm, square_image  # noqa: E402
from verl_fast.data import RLDataProcessor  # noqa: E402
from verl_fast.models import packed, vision  # noqa: E402
from verl_fast.models.response_logprobs import response_logprobs  # noqa: E402
from verl_fast.records.experience import Experience, concat  # noqa: E402


def _rows(processor):
    """Three prompts: two images, one image, none; each with a response of its own length."""
    data = RLDataProcessor(processor, max_prompt_length=1024)
    prompts = [
        data.encode({"prompt": [{"role": "user", "content": "<image> and <image> how many?"}],
                     "images": [square_image(2, 56), square_image(1, 84, seed=3)]}),
        data.encode({"prompt": "count the squares", "image": square_image(3, 112, seed=5)}),
        data.encode({"prompt": "what is 2 + 3?"}),
    ]
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(10, 300, (n,), generator=g).tolist() for n in (5, 3, 7)]
    return prompts, responses


def _batch(prompts, responses, pad):
    """Left-padded prompts, right-padded responses: [B, P + L] ids and mask, as Experience lays them."""
    P = max(len(p.prompt_ids) for p in prompts)
    L = max(len(r) for r in responses)
    ids = torch.full((len(prompts), P + L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p.prompt_ids) : P] = torch.tensor(p.prompt_ids)
        ids[i, P : P + len(r)] = torch.tensor(r)
        mask[i, P - len(p.prompt_ids) : P + len(r)] = 1
    return ids, mask, L


def _reference(model, prompt, response):
    """float64 log-probs of ``response`` after ``prompt`` from the model's own forward on the row alone
    (no padding; the model computes its M-RoPE positions itself)."""
    ids = torch.tensor([prompt.prompt_ids + response])
    kwargs = {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if prompt.vision is not None:
        kwargs.update(pixel_values=prompt.vision.pixel_values.double(), image_grid_thw=prompt.vision.image_grid_thw)
    logits = model(input_ids=ids, **kwargs).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt.prompt_ids) - 1 : -1], -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("family", VLM_FAMILIES)
@pytest.mark.parametrize("fused", [False, True])
def test_logprobs_with_images_match_own_forward(family, fused):
    """float32 log-probs of a left-padded batch (two pictures, one, none) against each row alone in float64."""
    model, processor = build_vlm(family)
    reference = copy.deepcopy(model).double()
    prompts, responses = _rows(processor)
    ids, mask, L = _batch(prompts, responses, processor.pad_token_id)
    inputs = vision.model_inputs(model, ids, mask, [p.vision for p in prompts])
    with torch.no_grad():
        logp, _ = response_logprobs(model, ids, mask, L, fused=fused, model_inputs=inputs)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ref = _reference(reference, p, r)
            assert torch.allclose(logp[i, : len(r)].double(), ref, atol=1e-4, rtol=0), (i, logp[i], ref)
    # the images matter: the plain forward (no images, 1-D positions) differs on the image rows only
    with torch.no_grad():
        blind, _ = response_logprobs(model, ids, mask, L, fused=fused)
    assert not torch.allclose(blind[0, :5], logp[0, :5], atol=1e-3)
    assert torch.allclose(blind[2, :7], logp[2, :7], atol=1e-5)  # the text row: plain positions agree


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_packed_attention_switch_leaves_the_vision_tower_its_own(family):
    """Under ``packed.attention_switched`` (the update's packed rows) the config hands the varlen name
    to the vision tower's config too: the tower's unpacked calls must still attend as before, and
    every config gets its own implementation back."""
    model, processor = build_vlm(family)
    prompts, responses = _rows(processor)
    ids, mask, L = _batch(prompts, responses, processor.pad_token_id)
    inputs = vision.model_inputs(model, ids, mask, [p.vision for p in prompts])
    names = (model.config._attn_implementation, model.config.vision_config._attn_implementation)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, **inputs).logits
        with packed.attention_switched(model):
            got = model(input_ids=ids, attention_mask=mask, **inputs).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (model.config._attn_implementation, model.config.vision_config._attn_implementation) == names


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_packed_switch_inside_the_batched_tower_keeps_its_segments(family, monkeypatch):
    """The update's passes hold ``vision_attention.batched`` and then ``packed.attention_switched``: the
    tower still attends through the batched segment attention, given its segments' boundaries (the
    composite config's varlen name reached the tower, whose per-window calls then came without them)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from verl_fast.models import vision_attention

    model, processor = build_vlm(family)
    prompts, responses = _rows(processor)
    ids, mask, L = _batch(prompts, responses, processor.pad_token_id)
    inputs = vision.model_inputs(model, ids, mask, [p.vision for p in prompts])
    segmented = []
    original = vision_attention.segment_attention

    def counted(*args, cu_seq_lens_q=None, **kwargs):
        segmented.append(cu_seq_lens_q is not None)
        return original(*args, cu_seq_lens_q=cu_seq_lens_q, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, vision_attention.ATTENTION, counted)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, **inputs).logits
        with vision_attention.batched(model), packed.attention_switched(model):
            assert model.config.vision_config._attn_implementation == vision_attention.ATTENTION
            got = model(input_ids=ids, attention_mask=mask, **inputs).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert segmented and all(segmented)
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_gradients_reach_language_model_not_frozen_tower():
    model, processor = build_vlm("qwen2_vl")
    assert vision.freeze_vision_tower(model) > 0
    prompts, responses = _rows(processor)
    ids, mask, L = _batch(prompts, responses, processor.pad_token_id)
    logp, _ = response_logprobs(model, ids, mask, L, model_inputs=vision.model_inputs(
        model, ids, mask, [p.vision for p in prompts]))
    logp.sum().backward()
    assert all(p.grad is None for p in model.model.visual.parameters())
    assert model.model.language_model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_lora_adapts_language_model_only():
    pytest.importorskip("peft")
    from verl_fast.config import LoraConfig
    from verl_fast.models import lora

    model, _ = build_vlm("qwen2_5_vl")
    peft_model = lora.apply(model, LoraConfig(r=4))
    adapted = [n for n, _ in peft_model.named_parameters() if "lora_A" in n]
    assert adapted and not any(".visual." in n for n in adapted)
    assert any("language_model" in n for n in adapted)


def test_experience_keeps_images_with_rows():
    """select / concat carry each row's images with its tokens."""
    _, processor = build_vlm("qwen2_vl")
    prompts, responses = _rows(processor)
    ids, mask, L = _batch(prompts, responses, processor.pad_token_id)
    exp = Experience(input_ids=ids, attention_mask=mask, response_mask=mask[:, -L:], prompt_index=torch.arange(3),
                     vision=[p.vision for p in prompts])
    sub = exp.select(torch.tensor([2, 0]))
    assert sub.vision == [prompts[2].vision, prompts[0].vision]
    text_only = Experience(input_ids=ids[2:], attention_mask=mask[2:], response_mask=mask[2:, -L:],
                           prompt_index=torch.tensor([0]))
    both = concat([sub, text_only])
    assert both.vision == [prompts[2].vision, prompts[0].vision, None]


def _tower_patches(model):
    """A list that collects the patch count of each vision-tower call of ``model``."""
    seen = []
    model.model.visual.register_forward_pre_hook(lambda module, args: seen.append(int(args[0].shape[0])))
    return seen


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_images_once_runs_each_prompts_images_once_with_the_same_logprobs_and_gradients(family):
    """Three samples of each prompt (the same ``VisionInputs`` objects, as a rollout's experience holds
    them): the log-probs and every gradient (tower trained) equal the plain forward's over per-row copies
    (float32: only the sums' order differs), while the tower sees each prompt's patches once."""
    model, processor = build_vlm(family)
    prompts, responses = _rows(processor)
    prompts, responses = [p for p in prompts for _ in range(3)], [r for r in responses for _ in range(3)]
    ids, mask, L = _batch(prompts, responses, processor.pad_token_id)
    shared = [p.vision for p in prompts]
    copies = [None if v is None else copy.deepcopy(v) for v in shared]  # no two rows share an object
    patches = _tower_patches(model)

    def run(context):
        model.zero_grad(set_to_none=True)
        with context as inputs:
            logp, _ = response_logprobs(model, ids, mask, L, model_inputs=inputs)
        (logp * torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = run(contextlib.nullcontext(vision.model_inputs(model, ids, mask, copies)))
    looped = patches.pop()
    got, got_grads = run(vision.images_once(model, ids, mask, shared))
    once = patches.pop()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert want_grads.keys() == got_grads.keys() and any(".visual." in f".{n}" for n in got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert looped == 3 * once == 3 * sum(int(v.pixel_values.shape[0]) for v in shared[::3] if v is not None)
    assert "get_image_features" not in vars(vision._core(model))  # the model's own method again


def test_distinct_images_indexes_each_rows_images():
    one, two = _rows(build_vlm("qwen2_vl")[1])[0][:2]
    a, b = one.vision, two.vision  # two pictures, one picture
    firsts, index = vision.distinct_images([b, a, None, b, a, a])
    assert firsts == [b, a] and index == [0, 1, 2, 0, 1, 2, 1, 2]


def test_benchmark_shape_draws_its_weights_as_the_published_model():
    """The 3B benchmark model's weights are drawn at Qwen2.5-VL-3B's standard deviation (0.02): drawn at the tiny
    model's 0.1, its 36 layers grow the stream until two bf16 forwards disagree by over a nat a token, and the
    guardrails' sync check stops the run (as it did on the GPU). The config alone: no weights are drawn."""
    from verl_fast.models import random_vlm

    processor = random_vlm.build_processor()
    for family in random_vlm.FAMILIES:
        assert random_vlm.build_config(family, processor.tokenizer, "3b").text_config.initializer_range == 0.02
        assert random_vlm.build_config(family, processor.tokenizer, "tiny").text_config.initializer_range == 0.1
