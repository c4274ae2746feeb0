"""GRPO on a tiny random-weight Qwen2-VL: rollout with images through the HF engine, the passes with
the same images, rewards that receive them, checkpoints, resume and the HF export with the processor."""

import io
import json

import pytest
import torch

pytest.importorskip("PIL")

from tiny_vlm import build_vlm, square_image  # noqa: E402
from verl_fast.models.vision_processor import VisionProcessor  # noqa: E402
from verl_fast.records.generation import SamplingSpec  # noqa: E402
from verl_fast.rollout.hf_engine import HFGenerateEngine  # noqa: E402
from verl_fast.trainer.rl_trainer import RLTrainer  # noqa: E402


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def verl_rows(count=8):
    rows = []
    for i in range(count):
        n = 1 + i % 3
        rows.append({"data_source": "squares", "images": [{"bytes": _png(square_image(n, 56 + 28 * (i % 2), i))}],
                     "prompt": [{"role": "user", "content": "<image>How many red squares?"}],
                     "reward_model": {"ground_truth": str(n)}})
    rows.append({"data_source": "squares", "prompt": "no picture: say 2", "reward_model": {"ground_truth": "2"}})
    return rows


def config(tmp_path, **trainer):
    return {
        "actor": {"lr": 1e-2, "micro_batch_size": 3},
        "rollout": {"type": "hf", "n": 4, "max_new_tokens": 5, "temperature": 1.0},
        "algorithm": {"type": "grpo"},
        "trainer": {"total_steps": 2, "train_batch_size": 3, "output_dir": str(tmp_path / "run"),
                    "progress_bar": False, "plot": False, "device": "cpu", **trainer},
    }


def length_reward(completions, images, ground_truth, **kwargs):
    """Varies within a group (so GRPO has a signal) and records what it was given."""
    length_reward.seen.extend(images)
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]  # chat prompts: messages
    return [float(len(t) % 3 == int(g) % 3) for t, g in zip(texts, ground_truth)]


length_reward.seen = []


def test_engine_batches_images_like_single_rows(tmp_path):
    """Greedy, the HF engine's left-padded batch of mixed rows (two sizes of picture, a text prompt)
    decodes what the model's own generate gives each row alone."""
    model, processor = build_vlm("qwen2_vl")
    trainer_rows = RLTrainer(actor_model=model, tokenizer=processor, config=config(tmp_path)).processor.encode_all(
        verl_rows(3) + verl_rows()[-1:])
    engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="off")
    out = engine.generate([r.prompt_ids for r in trainer_rows], SamplingSpec(n=2, temperature=0.0, max_tokens=6),
                          vision=[r.vision for r in trainer_rows])
    for i, row in enumerate(trainer_rows):
        ids = torch.tensor([row.prompt_ids])
        kwargs = {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
        if row.vision is not None:
            kwargs.update(pixel_values=row.vision.pixel_values, image_grid_thw=row.vision.image_grid_thw)
        alone = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                               do_sample=False, **kwargs)[0, ids.shape[1]:].tolist()
        for j in (2 * i, 2 * i + 1):
            got = out.response_ids[j][out.response_mask[j].bool()].tolist()
            assert got == alone[: len(got)] and len(got) >= 1, (i, got, alone)


def test_grpo_steps_with_images(tmp_path):
    model, processor = build_vlm("qwen2_vl")
    tower = {n: p.detach().clone() for n, p in model.model.visual.named_parameters()}
    lm = model.model.language_model.layers[0].mlp.up_proj.weight.detach().clone()
    length_reward.seen.clear()
    trainer = RLTrainer(actor_model=model, tokenizer=processor, reward_fn=length_reward,
                        config=config(tmp_path, save_freq=1, hf_export="every"))
    history = trainer.fit(verl_rows())
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in history)
    assert not torch.equal(lm, model.model.language_model.layers[0].mlp.up_proj.weight)
    assert all(torch.equal(p, tower[n]) for n, p in model.model.visual.named_parameters())  # frozen
    # the reward received each sample's decoded pictures (None for the text prompt)
    pictures = [x for x in length_reward.seen if x is not None]
    assert pictures and all(len(x) == 1 and x[0].mode == "RGB" for x in pictures)
    # the export: weights, and the processor (image processor, tokenizer, chat template)
    export = tmp_path / "run" / "checkpoints" / "step_000002"
    from transformers import AutoModelForImageTextToText

    back = AutoModelForImageTextToText.from_pretrained(export)
    assert torch.equal(back.model.language_model.layers[0].mlp.up_proj.weight,
                       model.model.language_model.layers[0].mlp.up_proj.weight)
    loaded = VisionProcessor.from_pretrained(str(export))
    assert loaded.chat_template == processor.chat_template
    assert loaded.image_processor.to_dict() == processor.image_processor.to_dict()


def test_old_logprobs_over_micro_batches_match_each_row(tmp_path):
    """The trainer's log-prob pass (micro-batches of 3 over 12 rows of mixed pictures) gives each row the
    log-probs of the model's own forward on that row alone, with its images."""
    model, processor = build_vlm("qwen2_5_vl")
    trainer = RLTrainer(actor_model=model, tokenizer=processor, reward_fn=length_reward, config=config(tmp_path))
    batch = trainer.processor.encode_all(verl_rows(2) + verl_rows()[-1:])
    exp = trainer.make_experience(batch, {})
    got = trainer._old_logprobs(exp)
    L = exp.response_length
    for r in range(exp.num_sequences):
        keep = exp.attention_mask[r].bool()
        ids = exp.input_ids[r][keep][None]
        v = exp.vision[r]
        kwargs = {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
        if v is not None:
            kwargs.update(pixel_values=v.pixel_values, image_grid_thw=v.image_grid_thw)
        with torch.no_grad():
            logits = model(input_ids=ids, **kwargs).logits[0]
        n = int(exp.response_mask[r].sum())
        ref = torch.log_softmax(logits[-n - 1 : -1].double(), -1).gather(-1, ids[0, -n:, None])[:, 0]
        assert torch.allclose(got[r, :n].double(), ref, atol=2e-5), r
        assert (got[r, n:L] == 0).all()


def test_token_budget_counts_image_rows_padded(tmp_path):
    """Under a token budget with packed passes on, rows with images (which run padded) are cut by rows x
    their longest, within the budget; counted packed, a micro-batch's padded rows went past it."""
    model, processor = build_vlm("qwen2_5_vl")
    cfg = config(tmp_path)
    cfg["actor"].update(use_dynamic_bsz=True, use_remove_padding=True, max_token_len_per_gpu=135)
    cfg["rollout"]["max_new_tokens"] = 12
    trainer = RLTrainer(actor_model=model, tokenizer=processor, reward_fn=length_reward, config=cfg)
    assert trainer.strategy.packs_sequences
    exp = trainer.make_experience(trainer.processor.encode_all(verl_rows(3)), {})
    lengths = exp.attention_mask.sum(-1)
    assert lengths.max() * 2 <= 135 < lengths.sum()  # more than one micro-batch, more than one row each
    micro = trainer.updates.micro(exp)
    assert sorted(torch.cat(micro).tolist()) == list(range(exp.num_sequences))
    assert all(len(idx) * int(lengths[idx].max()) <= 135 for idx in micro), [lengths[idx].tolist() for idx in micro]


def test_resume_continues_the_run(tmp_path):
    model, processor = build_vlm("qwen2_vl")
    first = RLTrainer(actor_model=model, tokenizer=processor, reward_fn=length_reward,
                      config=config(tmp_path, total_steps=1))
    first.fit(verl_rows())
    model2, processor2 = build_vlm("qwen2_vl", seed=1)  # other weights: the checkpoint's must win
    second = RLTrainer(actor_model=model2, tokenizer=processor2, reward_fn=length_reward, config=config(tmp_path))
    history = second.fit(verl_rows())
    assert [h["step"] for h in history] == [1, 2] and second.step == 2
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


@pytest.mark.parametrize("section, key, value, message", [
    ("algorithm", "type", "online_dpo", "algorithm.type=online_dpo is not supported with a vision-language actor"),
    ("trainer", "async_mode", "one_step", "not supported with trainer.async_mode=one_step"),
])
def test_refusals(tmp_path, section, key, value, message):
    model, processor = build_vlm("qwen2_vl")
    cfg = config(tmp_path)
    cfg[section][key] = value
    cfg["algorithm"]["rollout_correction"] = value == "one_step"  # what async_mode needs of its own
    with pytest.raises(ValueError, match=message):
        RLTrainer(actor_model=model, tokenizer=processor, reward_fn=length_reward, config=cfg)


def test_processor_with_a_text_model_refused(tmp_path):
    from tiny_models import build_model

    _, processor = build_vlm("qwen2_vl")
    with pytest.raises(ValueError, match="the actor is not a vision-language model"):
        RLTrainer(actor_model=build_model(vocab_size=len(processor)), tokenizer=processor, config=config(tmp_path))


def test_engine_never_samples_image_placeholders(tmp_path):
    """A model that would mostly sample <|image_pad|> (its head row scaled up) samples other tokens: a
    placeholder in a response would stand for an image the passes do not have."""
    model, processor = build_vlm("qwen2_vl")
    with torch.no_grad():
        model.lm_head.weight[model.config.image_token_id] *= 50
    rows = RLTrainer(actor_model=model, tokenizer=processor, config=config(tmp_path)).processor.encode_all(verl_rows(2))
    engine = HFGenerateEngine(model, processor.tokenizer, fast_decode="off")
    out = engine.generate([r.prompt_ids for r in rows], SamplingSpec(n=4, temperature=1.0, max_tokens=6),
                          vision=[r.vision for r in rows])
    sampled = out.response_ids[out.response_mask.bool()]
    assert sampled.numel() > 0 and not (sampled == model.config.image_token_id).any()
