"""The guardrails (trainer/guardrails.py, trainer/watchdog.py): each fires on what it guards against, and
stays quiet on a healthy run."""

import copy
import io
import logging
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.config import GuardrailsConfig
from verl_fast.records.experience import Experience
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.trainer.guardrails import GuardrailStop, Guardrails, Streak, flat_group_fraction
from verl_fast.trainer.rl_trainer import RLTrainer
from verl_fast.trainer.watchdog import EXIT_STATUS, Watchdog

PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}, "data_source": "toy"}
           for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def config(tmp_path, guardrails=None, **trainer):
    return {"actor": {"lr": 1e-3, "micro_batch_size": 8},
            "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6},
            "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
            "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                        "progress_bar": False, "plot": False, "device": "cpu", **trainer},
            "guardrails": guardrails or {}}


def length_reward(solution_str):
    return float(len(solution_str) % 3)


# ---- the pieces, against plain references


def test_flat_group_fraction_against_a_plain_count():
    g = torch.Generator().manual_seed(0)
    for groups, n in [(1, 2), (5, 4), (7, 3)]:
        scores = torch.randint(0, 2, (groups * n,), generator=g).float()
        index = torch.arange(groups).repeat_interleave(n)
        expected = sum(len(set(scores[i * n:(i + 1) * n].tolist())) == 1 for i in range(groups)) / groups
        assert flat_group_fraction(scores, index) == expected
    assert flat_group_fraction(torch.tensor([1.0, 2.0]), torch.tensor([0, 1])) == 0.0  # single samples: no groups


def test_a_streak_fires_once_per_run_of_steps():
    s = Streak(3)
    assert [s.update(h) for h in [True, True, True, True, False, True, True, True]] == \
        [False, False, True, False, False, False, False, True]


def exp_of(scores, n):
    N = len(scores)
    return Experience(input_ids=torch.zeros(N, 3, dtype=torch.long), attention_mask=torch.ones(N, 3),
                      response_mask=torch.ones(N, 2), prompt_index=torch.arange(N // n).repeat_interleave(n),
                      scores=torch.tensor(scores, dtype=torch.float32))


def test_signal_warnings_fire_after_their_streak(caplog):
    g = Guardrails(GuardrailsConfig(truncation_steps=2, flat_groups_steps=2), is_main=True)
    metrics = {}
    with caplog.at_level(logging.WARNING, logger="verl_fast.trainer.guardrails"):
        g.after_rewards(1, exp_of([1, 1, 0, 0], 2), truncated=0.9, not_applicable=0, metrics=metrics)
        assert not caplog.records
        g.after_rewards(2, exp_of([1, 1, 0, 0], 2), truncated=0.9, not_applicable=0, metrics=metrics)
    text = " | ".join(r.getMessage() for r in caplog.records)
    assert "step 2: response/truncated above 0.5 for 2 steps" in text
    assert "100% of the prompt groups scored every sample the same" in text
    assert "every sample of the batch" not in text  # two values: not constant
    assert metrics["guardrails/flat_groups"] == 1.0 and metrics["guardrails/constant_rewards"] == 0.0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verl_fast.trainer.guardrails"):
        for step in (3, 4):
            g.after_rewards(step, exp_of([0.5] * 4, 2), truncated=0.0, not_applicable=0, metrics=metrics)
    assert "step 4: every sample of the batch scored 0.5 for 2 steps in a row" in caplog.text


def test_a_batch_no_reward_applies_to_is_refused_not_trained_on_zero(tiny_path, tmp_path):
    model, tok = load(tiny_path)

    def not_applicable(prompts, completions, **kwargs):
        return [None] * len(completions)

    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=not_applicable, config=config(tmp_path))
    with pytest.raises(GuardrailStop, match=r"step 1: every reward function answered None .* all 8 samples"):
        trainer.fit(PROMPTS)
    # warn: trains on 0.0, as before, but says so
    model, tok = load(tiny_path)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=not_applicable,
                        config=config(tmp_path, {"all_none_rewards": "warn"}, total_steps=1, overwrite=True))
    history = trainer.fit(PROMPTS)
    assert history[-1]["guardrails/not_applicable"] == 8.0 and history[-1]["reward/mean"] == 0.0


# ---- NaN / inf in the update


def test_a_nan_gradient_skips_the_step_and_names_it(tiny_path, tmp_path, caplog):
    model, tok = load(tiny_path)
    poisoned = model.model.layers[0].mlp.up_proj.weight
    poisoned.register_hook(lambda grad: grad * float("nan"))
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward,
                        config=config(tmp_path, {"max_nonfinite_steps": 2}, total_steps=3))
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="verl_fast.trainer.guardrails"):
        with pytest.raises(GuardrailStop, match=r"step 2: 2 steps in a row had a NaN / inf gradient"):
            trainer.fit(PROMPTS)
    assert "step 1: actor mini-batch 1 of 1: gradient norm nan" in caplog.text
    assert "the optimiser step was skipped" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a skipped step changed weights"


def test_one_nan_step_among_good_ones_is_named_and_the_run_goes_on(tiny_path, tmp_path, caplog):
    model, tok = load(tiny_path)
    calls = {"n": 0}

    def once(grad):
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 1 else grad

    model.model.layers[0].mlp.up_proj.weight.register_hook(once)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward, config=config(tmp_path))
    with caplog.at_level(logging.WARNING, logger="verl_fast.trainer.guardrails"):
        history = trainer.fit(PROMPTS)
    assert [m["guardrails/skipped_steps"] for m in history] == [1.0, 0.0]
    assert "step 1: actor mini-batch 1 of 1" in caplog.text
    assert history[0]["actor/grad_norm"] == 0.0 and history[1]["actor/grad_norm"] > 0


# ---- the weight sync, on an engine that decodes a copy of the actor


class CopyEngine(HFGenerateEngine):
    """HF decode on a copy of the actor, synced by copying its parameters; ``corrupt`` spoils the sync."""

    owns_weights = True

    def __init__(self, actor, tokenizer, corrupt=None):
        super().__init__(copy.deepcopy(actor), tokenizer, fast_decode="off")
        self.corrupt = corrupt

    def sync_from(self, model):
        with torch.no_grad():
            for (name, mine), theirs in zip(self.model.named_parameters(), model.parameters()):
                mine.copy_(theirs)
                if self.corrupt is not None:
                    self.corrupt(name, mine)
        return {"bytes": 0}


def skip_one(name, tensor):  # the sync left this tensor as it was: another model's weights
    if name == "model.layers.1.mlp.gate_proj.weight":
        tensor.copy_(torch.randn_like(tensor) * 0.5)


def wrong_layout(name, tensor):  # a square projection written transposed
    if name == "model.layers.0.self_attn.o_proj.weight":
        tensor.copy_(tensor.t().clone() * 8)


@pytest.mark.parametrize("corrupt,group", [(skip_one, "model.layers.1.mlp.gate_proj"),
                                           (wrong_layout, "model.layers.0.self_attn.o_proj")])
@pytest.mark.parametrize("old_pass", [False, True])  # measured in the update's forward / from the old log-probs
def test_a_corrupted_sync_stops_the_run_naming_the_group(tiny_path, tmp_path, corrupt, group, old_pass):
    model, tok = load(tiny_path)
    engine = CopyEngine(model, tok, corrupt)
    cfg = config(tmp_path, {"sync_logprob_tolerance": 0.02})
    cfg["actor"]["ppo_epochs"] = 2 if old_pass else 1
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward, rollout_engine=engine, config=cfg)
    engine.sync_from(model)  # the engine built beside the actor: its first sync
    with pytest.raises(GuardrailStop, match=rf"step 1: the rollout engine's log-probs .* differ from the actor's "
                                            rf".*parameter groups that differ: {group}$"):
        trainer.fit(PROMPTS)


def test_a_healthy_sync_passes_the_check_at_every_step(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    engine = CopyEngine(model, tok)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward, rollout_engine=engine,
                        config=config(tmp_path, {"sync_logprob_tolerance": 0.02}, total_steps=3))
    engine.sync_from(model)
    history = trainer.fit(PROMPTS)
    assert all(m["guardrails/sync_logprob_diff"] < 1e-4 for m in history), history


# ---- the watchdog


def test_the_watchdog_names_a_late_phase_its_rank_and_its_stack():
    out = io.StringIO()
    dog = Watchdog("warn", factor=2.0, min_s=0.05, first_s=0.1, rank=3, poll_s=0.02, out=out)
    with dog:
        with dog.phase("reward"):
            time.sleep(0.01)  # its first run: within first_s
        with dog.phase("reward"):  # expected now: max(0.05, 2 x 0.01)
            a_stuck_reward_function()
    text = out.getvalue()
    assert text.count("verl-fast watchdog: phase reward on rank 3 has run") == 1, text  # once per run
    assert "a_stuck_reward_function" in text and "time.sleep" in text.split("a_stuck_reward_function")[-1]
    assert "guardrails.watchdog=stop would end the run" in text


def a_stuck_reward_function():
    time.sleep(0.3)


def test_the_watchdog_stop_asks_for_a_clean_stop_then_exits():
    out, events = io.StringIO(), []
    dog = Watchdog("stop", factor=2.0, min_s=0.01, first_s=0.05, poll_s=0.01, out=out,
                   stop=lambda: events.append("SIGTERM"), exit=lambda code: events.append(code))
    with dog:
        with dog.phase("weight_sync"):
            time.sleep(0.2)
    assert events[0] == "SIGTERM" and EXIT_STATUS in events, events
    assert "exiting 124 (the last complete checkpoint is intact)" in out.getvalue()


def test_the_watchdog_off_starts_no_thread_and_a_fast_phase_prints_nothing():
    out = io.StringIO()
    with Watchdog("off", 10.0, 1.0, 1.0, out=out) as dog:
        assert dog._thread is None
    dog = Watchdog("warn", 10.0, 1.0, 1.0, poll_s=0.01, out=out)
    with dog, dog.phase("generation"):
        time.sleep(0.05)
    assert out.getvalue() == ""


# ---- their cost


def test_each_step_reports_the_seconds_its_checks_took(tiny_path, tmp_path, monkeypatch):
    """perf/guardrails_s: the checks' own time in the step; a check made slower by 50 ms shows in it."""
    import time

    from verl_fast.trainer import guardrails

    model, tok = load(tiny_path)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward, config=config(tmp_path))
    plain = trainer.fit(PROMPTS)
    assert all(0 < m["perf/guardrails_s"] < m["time/step"] for m in plain), plain
    counted = guardrails.flat_group_fraction
    monkeypatch.setattr(guardrails, "flat_group_fraction", lambda *a: (time.sleep(0.05), counted(*a))[1])
    model, tok = load(tiny_path)
    slow = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=length_reward,
                     config=config(tmp_path / "slow")).fit(PROMPTS)
    assert all(m["perf/guardrails_s"] >= 0.05 for m in slow), slow
    assert max(m["perf/guardrails_s"] for m in plain) < 0.05
