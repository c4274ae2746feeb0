"""SFT, DPO and PPO (a vision-language critic) on a tiny random-weight Qwen2-VL with images: each step's
loss against a float64 reference computed here from the model's own forward on each row alone with
its images, micro-batches of rows with ragged image counts (0, 1, 2 pictures), the vision tower frozen
or trained as ``actor.freeze_vision_tower`` says."""

import copy

import pytest
import torch

pytest.importorskip("PIL")

from tiny_vlm import build_vlm, square_image  # noqa: E402
from verl_fast.models.value import ValueModel  # noqa: E402
from verl_fast.trainer.rl_trainer import RLTrainer  # noqa: E402

QUESTION = {"type": "text", "text": "How many red squares?"}


def _user(images):
    return {"role": "user", "content": [{"type": "image"}] * images + [QUESTION]}


def _answer(text):
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def sft_rows():
    """Ragged image counts, TRL's two conversational formats, one text-only row."""
    rows = []
    for i, count in enumerate((1, 2, 0, 1, 2, 1)):
        pictures = [square_image(1 + (i + k) % 3, 56 + 28 * ((i + k) % 2), 10 * i + k) for k in range(count)]
        if i % 2:
            row = {"prompt": [_user(count)], "completion": _answer(f"{i % 3} squares")}
        else:
            row = {"messages": [_user(count)] + _answer(f"there are {i % 3}")}
        if count:
            row["images"] = pictures
        else:
            row["messages"] = [{"role": "user", "content": "say 2"}, {"role": "assistant", "content": "2"}]
        rows.append(row)
    return rows


def dpo_rows():
    return [{"images": [square_image(1 + i % 3, 56, i)] * (1 + i % 2), "prompt": [_user(1 + i % 2)],
             "chosen": _answer(str(1 + i % 3)), "rejected": _answer(f"maybe {i}")} for i in range(4)]


def config(tmp_path, algorithm, **actor):
    return {
        "actor": {"lr": 1e-2, "micro_batch_size": 2, **actor},
        "algorithm": {"type": algorithm},
        "trainer": {"total_steps": 2, "output_dir": str(tmp_path / "run"), "progress_bar": False, "plot": False,
                    "device": "cpu"},
    }


def row_logprobs(model, ids, vision):
    """float64 log-probs of tokens ``ids[1:]`` under the model's forward on the row alone, with its images."""
    ids = torch.as_tensor(ids)[None]
    kwargs = {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if vision is not None:
        kwargs.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw)
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def tower(model):
    return {n: p.detach().clone() for n, p in model.model.visual.named_parameters()}


@pytest.mark.parametrize("batching", [{"micro_batch_size": 2}, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 90}])
def test_sft_loss_with_images(tmp_path, batching):
    """The first step's loss is the token-mean NLL of the assistant tokens under the model's own forward
    (each row alone), by row count or under a token budget (micro-batches of rows with 0-2 pictures)."""
    model, processor = build_vlm("qwen2_vl")
    before, frozen = copy.deepcopy(model), tower(model)
    cfg = config(tmp_path, "sft", **batching)
    cfg["trainer"]["train_batch_size"] = 6
    trainer = RLTrainer(actor_model=model, tokenizer=processor, config=cfg)
    rows = sft_rows()
    examples = trainer.algorithm.encode(trainer.processor, rows)
    # the data: each image's placeholder expanded to its tokens, the loss on the answer's tokens only
    for e, row in zip(examples, rows):
        images = len(row.get("images", []))
        assert (e.vision is None) == (images == 0)
        if images:
            assert e.vision.num_images == images
            expected = sum(int(g.prod()) // 4 for g in e.vision.image_grid_thw)
            assert e.ids.count(model.config.image_token_id) == expected
        answer = processor.tokenizer.decode([t for t, m in zip(e.ids, e.loss_mask) if m])
        last = (row["completion"] if "completion" in row else row["messages"])[-1]["content"]
        assert answer == (last if isinstance(last, str) else last[0]["text"]) + "<|im_end|>\n", answer
    exp = trainer.algorithm.experience(examples, processor.tokenizer.pad_token_id, trainer.device)
    micro = trainer.updates.micro(exp)
    counts = [sorted(0 if v is None else v.num_images for v in exp.select(idx).vision) for idx in micro]
    assert len(micro) > 1 and any(len(set(c)) > 1 for c in counts), counts  # ragged image counts in a pass
    total, count = 0.0, 0
    for e in examples:
        mask = torch.tensor(e.loss_mask[1:], dtype=torch.float64)
        total -= float((row_logprobs(before, e.ids, e.vision) * mask).sum())
        count += int(mask.sum())
    history = trainer.fit(rows)
    assert len(history) == 2
    assert history[0]["sft/loss"] == pytest.approx(total / count, rel=1e-5)
    assert all(torch.equal(p, frozen[n]) for n, p in model.model.visual.named_parameters())
    assert not torch.equal(before.lm_head.weight, model.lm_head.weight)


def test_sft_trains_the_tower_when_not_frozen(tmp_path):
    model, processor = build_vlm("qwen2_5_vl")
    frozen = tower(model)
    cfg = config(tmp_path, "sft", freeze_vision_tower=False)
    cfg["trainer"]["train_batch_size"] = 6
    RLTrainer(actor_model=model, tokenizer=processor, config=cfg).fit(sft_rows())
    changed = [n for n, p in model.model.visual.named_parameters() if not torch.equal(p, frozen[n])]
    assert changed and any("merger" in n for n in changed) and any("blocks" in n for n in changed)


def test_sft_refuses_a_cut_through_image_tokens(tmp_path):
    model, processor = build_vlm("qwen2_vl")
    cfg = config(tmp_path, "sft")
    cfg["algorithm"]["sft_max_length"] = 8
    trainer = RLTrainer(actor_model=model, tokenizer=processor, config=cfg)
    with pytest.raises(ValueError, match=r"SFT row 0: .* the cut would drop image tokens"):
        trainer.algorithm.encode(trainer.processor, sft_rows()[:1])


@pytest.mark.parametrize("algorithm, rows, message", [
    ("sft", lambda: [{**sft_rows()[0], "images": [b"not a picture"]}], r"SFT row 0: images\[0\]: cannot read"),
    ("dpo", lambda: [{**dpo_rows()[0], "images": [b"not a picture"]}], r"preference row 0: images\[0\]: cannot read"),
    ("dpo", lambda: [{**dpo_rows()[1], "images": dpo_rows()[1]["images"][:1]}],
     "preference row 0: the prompt has 2 image placeholders for 1 images"),
])
def test_bad_image_rows_named(tmp_path, algorithm, rows, message):
    model, processor = build_vlm("qwen2_vl")
    trainer = RLTrainer(actor_model=model, tokenizer=processor, config=config(tmp_path, algorithm))
    with pytest.raises(ValueError, match=message):
        trainer.algorithm.encode(trainer.processor, rows())


@pytest.mark.parametrize("reference_free", [False, True])
def test_dpo_loss_with_images(tmp_path, reference_free):
    """DPO's first loss: sigmoid of beta times the chosen-minus-rejected log-ratio margins, each sequence's
    summed response log-probs from the actor's (and a reference of other weights') own forward with the
    pair's images; pairs of one and two pictures in micro-batches of one pair."""
    model, processor = build_vlm("qwen2_vl")
    ref, _ = build_vlm("qwen2_vl", seed=1)
    before, frozen = copy.deepcopy(model), tower(model)
    cfg = config(tmp_path, "dpo")
    cfg["trainer"]["train_batch_size"] = 4
    cfg["trainer"]["per_device_train_batch_size"] = 1
    cfg["algorithm"]["beta"] = 0.5
    cfg["reward_fn"] = {"reference_free": reference_free}
    trainer = RLTrainer(actor_model=model, tokenizer=processor, ref_model=None if reference_free else ref,
                        config=cfg)
    pairs = trainer.algorithm.encode(trainer.processor, dpo_rows())
    assert [p.vision.num_images for p in pairs] == [1, 2, 1, 2]

    def summed(m, pair, response):
        n = len(response)
        return float(row_logprobs(m, pair.prompt_ids + response, pair.vision)[-n:].sum())

    losses = []
    for p in pairs:
        margin = summed(before, p, p.chosen_ids) - summed(before, p, p.rejected_ids)
        if not reference_free:
            margin -= summed(ref, p, p.chosen_ids) - summed(ref, p, p.rejected_ids)
        losses.append(-torch.nn.functional.logsigmoid(torch.tensor(0.5 * margin, dtype=torch.float64)))
    history = trainer.fit(pairs)
    assert history[0]["dpo/loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
    assert all(torch.equal(p, frozen[n]) for n, p in model.model.visual.named_parameters())


def _length_reward(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[0]["content"]) % 3) for c in completions]


def test_ppo_critic_values_with_images(tmp_path):
    """PPO with a vision-language critic: its values are its own forward on each row alone with the row's
    images (a random head, so they are not all zero); both models step, both vision towers stay frozen."""
    from test_vlm_trainer import verl_rows

    actor, processor = build_vlm("qwen2_vl")
    actor_tower = tower(actor)
    backbone, _ = build_vlm("qwen2_vl", seed=2)
    critic = ValueModel(backbone)
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    critic_tower, critic_lm = tower(backbone), backbone.model.language_model.layers[0].mlp.up_proj.weight.clone()
    cfg = config(tmp_path, "ppo")
    cfg["rollout"] = {"type": "hf", "n": 2, "max_new_tokens": 4}
    cfg["trainer"]["train_batch_size"] = 3
    cfg["critic"] = {"lr": 1e-2, "micro_batch_size": 2}
    trainer = RLTrainer(actor_model=actor, tokenizer=processor, critic_model=critic, reward_fn=_length_reward,
                        config=cfg)
    batch = trainer.processor.encode_all(verl_rows(2) + verl_rows()[-1:])
    exp = trainer.make_experience(batch, {})
    for r in range(exp.num_sequences):
        keep = exp.attention_mask[r].bool()
        ids = exp.input_ids[r][keep][None]
        v = exp.vision[r]
        kwargs = {"mm_token_type_ids": (ids == backbone.config.image_token_id).int()}
        if v is not None:
            kwargs.update(pixel_values=v.pixel_values, image_grid_thw=v.image_grid_thw)
        with torch.no_grad():
            hidden = backbone.model(input_ids=ids, **kwargs).last_hidden_state[0].double()
        values = hidden @ critic.head.weight[0].double() + critic.head.bias.double()
        n = int(exp.response_mask[r].sum())
        assert torch.allclose(exp.values[r, :n].double(), values[-n - 1 : -1], atol=1e-5), r
    assert exp.values.abs().sum() > 0
    history = trainer.fit(verl_rows())
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["critic/vf_loss"])) for h in history)
    assert not torch.equal(critic_lm, backbone.model.language_model.layers[0].mlp.up_proj.weight)
    assert all(torch.equal(p, critic_tower[n]) for n, p in backbone.model.visual.named_parameters())
    assert all(torch.equal(p, actor_tower[n]) for n, p in actor.model.visual.named_parameters())


def test_sft_resume_with_images_matches_the_uninterrupted_run(tmp_path):
    """Two SFT steps with the tower trained, against one step, a checkpoint, and a trainer on other weights
    that resumes it for the second: the same weights (model and optimiser state restored)."""
    def run(folder, steps, seed):
        model, processor = build_vlm("qwen2_vl", seed=seed)
        cfg = config(folder, "sft", freeze_vision_tower=False)
        cfg["trainer"].update(train_batch_size=3, total_steps=steps)
        RLTrainer(actor_model=model, tokenizer=processor, config=cfg).fit(sft_rows())
        return model

    whole = run(tmp_path / "whole", 2, 0)
    run(tmp_path / "cut", 1, 0)
    resumed = run(tmp_path / "cut", 2, 1)  # seed 1: the checkpoint's weights must win
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("algorithm", ["orpo", "simpo"])
def test_reference_free_pair_losses_step_with_images(tmp_path, algorithm):
    """ORPO / SimPO read the pairs as DPO does (both rows of a pair with its images): they step."""
    model, processor = build_vlm("qwen2_vl")
    frozen, head = tower(model), model.lm_head.weight.detach().clone()
    cfg = config(tmp_path, algorithm)
    cfg["trainer"]["train_batch_size"] = 4
    history = RLTrainer(actor_model=model, tokenizer=processor, config=cfg).fit(dpo_rows())
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h[f"{algorithm}/loss"])) for h in history)
    assert not torch.equal(head, model.lm_head.weight)
    assert all(torch.equal(p, frozen[n]) for n, p in model.model.visual.named_parameters())
