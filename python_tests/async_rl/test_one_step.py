"""trainer.async_mode=one_step on a tiny model with HF generate: the synchronous losses at lr 0,
samples exactly one version old, checkpoints that keep the generation in flight."""

import json
import shutil
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_toy import PROMPTS, reward, tiny_path  # noqa: F401 (tiny_path: a fixture)
from verl_fast import config as config_mod
from verl_fast.trainer.rl_trainer import RLTrainer


def build(path, out, mode, lr, steps=4, **trainer):
    cfg = {"actor": {"lr": lr, "micro_batch_size": 8},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6},
           "reward_fn": {"type": "gsm8k"},
           "algorithm": {"type": "grpo", "rollout_correction": True},
           "trainer": {"total_steps": steps, "train_batch_size": 2, "output_dir": str(out), "progress_bar": False,
                       "plot": False, "device": "cpu", "async_mode": mode, "loggers": ["jsonl"], **trainer}}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(path), reward_fn=reward, config=cfg)


def run(path, out, mode, lr, steps=4, **trainer):
    trainer_ = build(path, out, mode, lr, steps, **trainer)
    return trainer_, [h for h in trainer_.fit(PROMPTS) if "actor/pg_loss" in h]


def test_one_step_at_lr_zero_gives_the_synchronous_losses(tiny_path, tmp_path):
    _, sync = run(tiny_path, tmp_path / "sync", "off", 0.0)
    _, async_ = run(tiny_path, tmp_path / "one_step", "one_step", 0.0)
    assert len(sync) == len(async_) == 4
    for a, b in zip(sync, async_):
        for key in ("reward/mean", "response/length", "actor/pg_loss", "rollout_correction/is_weight_mean"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (key, a[key], b[key])


def test_samples_are_one_version_old_and_never_mix_versions(tiny_path, tmp_path):
    _, history = run(tiny_path, tmp_path / "run", "one_step", 1e-2)
    assert history[0]["async/staleness_max"] == 0.0  # the first step generates in the step
    for h in history[1:]:
        assert h["async/staleness_max"] == 1.0 and h["async/staleness_hist/1"] == 1.0
    assert all(h["async/mixed_version_sequences"] == 0.0 for h in history)
    assert all(0.0 <= h["async/overlap_fraction"] <= 1.0 for h in history)


def test_the_generation_in_flight_is_checkpointed_and_resumed_bit_identically(tiny_path, tmp_path):
    _, whole = run(tiny_path, tmp_path / "whole", "one_step", 1e-2, steps=4)
    run(tiny_path, tmp_path / "split", "one_step", 1e-2, steps=4, save_freq=2)
    # a run stopped after step 2 (its checkpoint), then resumed: the checkpoint holds step 3's samples
    state = json.loads((tmp_path / "split/checkpoints/step_000002/trainer_state.json").read_text())
    assert state["async_rollout"]["pending"]["step"] == 2
    assert set(sum(state["async_rollout"]["pending"]["versions"], [])) == {1}
    shutil.rmtree(tmp_path / "split/checkpoints/step_000004")
    _, resumed = run(tiny_path, tmp_path / "split", "one_step", 1e-2, steps=4, save_freq=2)
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's history
    for a, b in zip(whole[2:], resumed[2:]):
        assert a["actor/pg_loss"] == b["actor/pg_loss"] and a["reward/mean"] == b["reward/mean"]


def test_bad_combinations_fail_at_start_up():
    base = {"algorithm": {"rollout_correction": True}}
    with pytest.raises(ValueError, match="needs algorithm.rollout_correction=true"):
        config_mod.from_dict({"trainer": {"async_mode": "one_step"}})
    with pytest.raises(ValueError, match="is not supported with algorithm.type=dpo"):
        config_mod.from_dict({"trainer": {"async_mode": "full"}, "reward_fn": {"type": "pairwise_ranking"},
                              "algorithm": {"type": "dpo", "rollout_correction": True}})
    with pytest.raises(ValueError, match="is not supported with algorithm.type=remax"):
        config_mod.from_dict({"trainer": {"async_mode": "one_step"},
                              "algorithm": {"type": "remax", "rollout_correction": True}})
    with pytest.raises(ValueError, match="max_staleness=2 is not supported with trainer.async_mode=one_step"):
        config_mod.from_dict({**base, "trainer": {"async_mode": "one_step", "max_staleness": 2}})
    with pytest.raises(ValueError, match="async_mode=full is not supported with rollout.type=vllm"):
        config_mod.from_dict({**base, "trainer": {"async_mode": "full"},
                              "rollout": {"type": "vllm", "enable_sleep_mode": False}})
    for key, section in (("actor.routing_replay", "actor"), ("rollout.record_routing", "rollout")):
        name = key.split(".")[1]
        with pytest.raises(ValueError, match=f"is not supported with {key}=true"):
            config_mod.from_dict({**base, "trainer": {"async_mode": "one_step"}, section: {name: True}})
    with pytest.raises(ValueError, match="must be one of"):
        config_mod.from_dict({"trainer": {"async_mode": "two_step"}})
    assert config_mod.from_dict({**base, "trainer": {"async_mode": "full", "max_staleness": 3}}).trainer.max_staleness == 3


def test_a_bare_yaml_off_is_the_mode_off():
    data = config_mod.apply_overrides({}, ["trainer.async_mode=off", "rollout.length_buckets=on"])
    assert data["trainer"]["async_mode"] is False  # what YAML 1.1 makes of it
    cfg = config_mod.from_dict(data)
    assert cfg.trainer.async_mode == "off" and cfg.rollout.length_buckets == "on"


def sigterm_during_step(trainer_, step):
    """Sends this process SIGTERM inside the update of step ``step`` (1-based)."""
    update = trainer_.update_actor

    def update_then_signal(exp):
        out = update(exp)
        if trainer_.step + 1 == step:
            signal.raise_signal(signal.SIGTERM)
        return out

    trainer_.update_actor = update_then_signal


def test_sigterm_with_a_generation_in_flight_loses_nothing_and_resumes_bit_identically(tiny_path, tmp_path):
    _, whole = run(tiny_path, tmp_path / "whole", "one_step", 1e-2, steps=4)
    out = tmp_path / "stopped"
    first = build(tiny_path, out, "one_step", 1e-2, steps=4)
    sigterm_during_step(first, 2)
    history = [h for h in first.fit(PROMPTS) if "actor/pg_loss" in h]
    assert first.stopped and [h["step"] for h in history] == [1, 2]
    state = json.loads((out / "checkpoints/step_000002/trainer_state.json").read_text())
    assert state["async_rollout"]["pending"]["step"] == 2  # step 3's samples, generated during step 2
    _, resumed = run(tiny_path, out, "one_step", 1e-2, steps=4)
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed):
        assert a["actor/pg_loss"] == b["actor/pg_loss"] and a["reward/mean"] == b["reward/mean"]


def test_a_lora_actors_rollout_copy_shares_its_frozen_base(tiny_path, tmp_path):
    """The one_step copy of a LoRA actor holds the actor's own frozen base parameters (no second base)
    and adapters of its own, one version behind the actor's while the run trains."""
    pytest.importorskip("peft")
    cfg = {"actor": {"lr": 1e-2, "micro_batch_size": 8, "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6}, "reward_fn": {"type": "gsm8k"},
           "algorithm": {"type": "grpo", "rollout_correction": True},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(tmp_path / "lora"),
                       "progress_bar": False, "plot": False, "device": "cpu", "async_mode": "one_step"}}
    torch.manual_seed(0)
    trainer = RLTrainer(actor_model=AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                        tokenizer=AutoTokenizer.from_pretrained(tiny_path), reward_fn=reward, config=cfg)
    actor = dict(trainer.actor.named_parameters())
    copy_ = dict(trainer.async_rollout.operator.engine.model.named_parameters())
    assert copy_.keys() == actor.keys()
    assert all((copy_[n] is p) == (not p.requires_grad) for n, p in actor.items())
    history = [h for h in trainer.fit(PROMPTS) if "actor/pg_loss" in h]
    assert len(history) == 3 and all(h["async/staleness_max"] <= 1 for h in history)
    moved = [n for n, p in actor.items() if p.requires_grad and not torch.equal(p, copy_[n])]
    assert moved  # the copy's adapters are the version before the last update


def test_under_autocast_the_rollout_copy_holds_the_autocast_dtype(tiny_path, tmp_path):
    """With bf16 autocast the one_step copy holds bf16 weights (the actor fp32), synced each step."""
    cfg = {"actor": {"lr": 1e-2, "micro_batch_size": 8, "autocast": "bfloat16"},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6}, "reward_fn": {"type": "gsm8k"},
           "algorithm": {"type": "grpo", "rollout_correction": True},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(tmp_path), "progress_bar": False,
                       "plot": False, "device": "cpu", "async_mode": "one_step"}}
    torch.manual_seed(0)
    trainer = RLTrainer(actor_model=AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                        tokenizer=AutoTokenizer.from_pretrained(tiny_path), reward_fn=reward, config=cfg)
    snapshot = trainer.async_rollout.operator.engine.model
    assert {p.dtype for p in snapshot.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.actor.parameters()} == {torch.float32}
    before = []  # the actor's weights before each update
    update = trainer.update_actor
    trainer.update_actor = lambda exp: before.append(
        {n: p.detach().clone() for n, p in trainer.actor.named_parameters()}) or update(exp)
    history = [h for h in trainer.fit(PROMPTS) if "actor/pg_loss" in h]
    assert len(history) == 3 and all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in history)
    # last synced when step 2's generation started: version 1, the weights before the second update
    for name, p in snapshot.named_parameters():
        assert torch.equal(p, before[1][name].to(torch.bfloat16)), name
