"""Learning-rate schedules: the factor against the formulas written out here in float64, the rate the
optimizers actually step with (actor and critic, logged as actor/lr and critic/lr), and a resumed
run continuing the schedule exactly."""

import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as C
from verl_fast.trainer import lr_schedule
from verl_fast.trainer.rl_trainer import RLTrainer


def reference(kind, step, total, warmup, m):
    """The schedule of lr_schedule's docstring, in float64: warm-up (s + 1) / W, then decay over p."""
    if step < warmup:
        return (step + 1.0) / warmup
    p = (step - warmup) / max(1.0, float(total - warmup))
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return 1.0 - (1.0 - m) * p
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["constant", "linear", "cosine"]), total=st.integers(1, 500),
       warmup=st.one_of(st.none(), st.integers(0, 50)), ratio=st.floats(0, 1), m=st.floats(0, 1),
       data=st.data())
def test_factor_matches_the_formula(kind, total, warmup, ratio, m, data):
    s = SimpleNamespace(lr_scheduler=kind, warmup_steps=warmup, warmup_ratio=0.0 if warmup is not None else ratio,
                        min_lr_ratio=m)
    w = warmup if warmup is not None else math.ceil(ratio * total)
    step = data.draw(st.integers(0, total - 1))
    got = lr_schedule.factor(step, total, s)
    assert abs(got - reference(kind, step, total, w, m)) <= 1e-12
    assert 0.0 < got <= 1.0


def test_schedule_edges():
    s = SimpleNamespace(lr_scheduler="cosine", warmup_steps=2, warmup_ratio=0.0, min_lr_ratio=0.1)
    assert [lr_schedule.factor(i, 6, s) for i in range(3)] == [0.5, 1.0, 1.0]  # warm-up, then the peak
    assert lr_schedule.factor(5, 6, s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))
    assert lr_schedule.factor(3, None, SimpleNamespace(lr_scheduler="constant", warmup_steps=None, warmup_ratio=0.0,
                                                       min_lr_ratio=0.0)) == 1.0
    with pytest.raises(ValueError, match="needs the run's length"):
        lr_schedule.factor(0, None, s)
    with pytest.raises(ValueError, match="actor.warmup_steps and actor.warmup_ratio are both set"):
        C.from_dict({"actor": {"warmup_steps": 2, "warmup_ratio": 0.1}})
    with pytest.raises(ValueError, match=r"critic.lr_scheduler must be one of \['constant', 'linear', 'cosine'\]"):
        C.from_dict({"critic": {"lr_scheduler": "step"}})
    with pytest.raises(ValueError, match="actor.min_lr_ratio must be <= 1"):
        C.from_dict({"actor": {"min_lr_ratio": 1.5}})


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", seed=3)


ROWS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}} for a, b in
        [(1, 2), (3, 4), (5, 6), (7, 8)]]


def run(tiny_path, out, total=5, **trainer):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = {"actor": {"lr": 1e-3, "lr_scheduler": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.2,
                     "weight_decay": 0.01},
           "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "trainer": {"total_steps": total, "train_batch_size": 2, "output_dir": str(out), "progress_bar": False,
                       "plot": False, "device": "cpu", "hf_export": "none", **trainer}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=lambda solution_str: float(len(solution_str)),
                        config=cfg)
    return trainer, trainer.fit(ROWS)


def test_the_optimizer_steps_at_the_logged_rate_and_a_resume_continues_it(tiny_path, tmp_path):
    trainer, history = run(tiny_path, tmp_path / "full")
    rates = [m["actor/lr"] for m in history]
    want = [1e-3 * reference("cosine", s, 5, 2, 0.2) for s in range(5)]
    assert rates == pytest.approx(want, rel=1e-12, abs=0)
    assert trainer.strategy.optimizer.param_groups[0]["lr"] == rates[-1]  # what the last step stepped with
    assert trainer.strategy.optimizer.param_groups[0]["weight_decay"] == 0.01

    # the same run stopped after step 2 (its later checkpoints removed), then resumed to 5
    out = tmp_path / "resumed"
    run(tiny_path, out, save_freq=2)
    for later in ("step_000004", "step_000005"):
        shutil.rmtree(out / "checkpoints" / later)
    resumed, history2 = run(tiny_path, out, save_freq=2)
    assert [m["step"] for m in history2] == [1, 2, 3, 4, 5]
    assert [m["actor/lr"] for m in history2] == rates


def test_critic_schedule(tiny_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    critic = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = {"algorithm": {"type": "ppo"}, "critic": {"lr": 1e-2, "lr_scheduler": "linear", "warmup_ratio": 0.0},
           "rollout": {"type": "hf", "n": 1, "max_new_tokens": 4},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(tmp_path / "ppo"),
                       "progress_bar": False, "plot": False, "device": "cpu", "hf_export": "none"}}
    history = RLTrainer(actor_model=model, critic_model=critic, tokenizer=tok, config=cfg,
                        reward_fn=lambda solution_str: 1.0).fit(ROWS)
    assert [m["critic/lr"] for m in history] == pytest.approx([1e-2 * (1 - s / 3) for s in range(3)], rel=1e-12)
    assert [m["actor/lr"] for m in history] == [1e-6] * 3  # the actor's default: constant
