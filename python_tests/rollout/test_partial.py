"""Synchronous partial rollouts (rollout.partial_step_tokens) on a tiny model whose responses end at ragged
lengths: carried samples keep their tokens and behaviour log-probs exactly, the continued tokens' log-probs
are the model's given the whole prefix, a step trains on complete groups only, the carry's age is bounded,
a checkpoint keeps the carry, and the combinations that cannot work are refused."""

import copy
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_toy import PROMPTS, reward
from ragged import save_ragged_model
from verl_fast import config as config_mod
from verl_fast.bench import lengths
from verl_fast.data import RLDataProcessor
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.rollout.partial import PartialRollout
from verl_fast.trainer.catalog import register
from verl_fast.trainer.rl_trainer import RLTrainer

CAP = 24


@pytest.fixture(scope="module")
def ragged_path(tmp_path_factory):
    # an EOS rate of about 1/12 a step: lengths from 1 to past the cap
    return save_ragged_model(tmp_path_factory.mktemp("ragged") / "qwen2", lengths.LengthSpec(3.6, 0.5))


def pool(path, step_tokens=6, round_tokens=None, max_carry=2):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = RLDataProcessor(tokenizer, 64, CAP).encode_all(PROMPTS)
    engine = HFGenerateEngine(model, tokenizer)
    return model, rows, PartialRollout(engine, tokenizer, step_tokens, round_tokens, max_carry)


def specs(rows, seed, n=4):
    return [SamplingSpec(n=n, max_tokens=CAP, seed=seed + i) for i in range(len(rows))]


def rows_of(gen, g):
    """(tokens, log-probs, finish reason) of the samples of the ``g``-th group in ``gen``."""
    out = []
    for r in (gen.prompt_index == g).nonzero().flatten().tolist():
        width = int(gen.response_mask[r].sum())
        out.append((gen.response_ids[r, :width].tolist(), gen.logprobs[r, :width].tolist(), gen.finish_reasons[r]))
    return out


def test_carried_samples_keep_their_tokens_and_logprobs_exactly(ragged_path):
    _, rows, partial = pool(ragged_path)
    carried, checked = {}, 0
    for step in range(4):
        batch = rows[2 * step : 2 * step + 2]
        trained, gen = partial.rollout(batch, specs(batch, 100 * step), step, 100 * step, {})
        for g, row in enumerate(trained):  # a carried group trains on exactly what it had, then more
            after = rows_of(gen, g)
            for tokens, logprobs in carried.pop(tuple(row.prompt_ids), []):
                assert any(a[0][: len(tokens)] == tokens and a[1][: len(logprobs)] == logprobs for a in after)
                checked += 1
        carried.update({tuple(c.row.prompt_ids): [(list(s.tokens), list(s.logprobs)) for s in c.samples]
                        for c in partial.carry})
    assert checked


def test_continued_tokens_have_the_models_logprobs_of_the_whole_prefix(ragged_path):
    model, rows, partial = pool(ragged_path, step_tokens=12, round_tokens=3)
    batch = rows[:2]
    trained, gen = partial.rollout(batch, specs(batch, 7), 0, 7, {})
    reference = copy.deepcopy(model).double()  # float64
    checked = 0
    for g, row in enumerate(trained):
        for tokens, logprobs, _ in rows_of(gen, g):
            ids = torch.tensor([list(row.prompt_ids) + tokens])
            with torch.no_grad():
                ref = reference(ids).logits[0].log_softmax(-1)
            P = len(row.prompt_ids)
            want = [ref[P - 1 + t, tok].item() for t, tok in enumerate(tokens)]
            assert logprobs == pytest.approx(want, abs=1e-4)
            checked += len(tokens) > 3  # past the first round: re-submitted prefixes
    assert checked


def test_a_step_trains_on_complete_groups_only_and_the_carry_ages_at_most_max_carry(ragged_path):
    _, rows, partial = pool(ragged_path, step_tokens=4, max_carry=2)
    for step in range(6):
        batch = [rows[(2 * step + i) % len(rows)] for i in range(2)]
        metrics = {}
        trained, gen = partial.rollout(batch, specs(batch, step), step, step, metrics)
        assert 1 <= len(trained) <= len(batch)
        assert gen.num_sequences == 4 * len(trained)
        widths = gen.response_mask.sum(-1).tolist()
        for width, reason in zip(widths, gen.finish_reasons):
            assert reason in ("stop", "length")
            assert reason == "stop" or width == CAP  # a sample ends by EOS or at the cap, never at a budget
        assert metrics["partial/max_age"] <= 2
        assert all(step - c.born <= 2 for c in partial.carry)
        assert metrics["partial/carried_groups"] == len(partial.carry)


def test_the_budget_cuts_the_tail(ragged_path):
    """With a budget below the cap, some samples are carried (the tail is not waited for)."""
    _, rows, partial = pool(ragged_path, step_tokens=4)
    batch = rows[:4]
    metrics = {}
    partial.rollout(batch, specs(batch, 3), 0, 3, metrics)
    assert metrics["partial/carried_groups"] >= 1 and metrics["partial/carried_tokens"] > 0


def build(path, out, steps=4, lr=1e-2, **rollout):
    cfg = {"actor": {"lr": lr, "micro_batch_size": 8},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": CAP, "partial_step_tokens": 3, **rollout},
           "algorithm": {"type": "grpo", "rollout_correction": True},
           "trainer": {"total_steps": steps, "train_batch_size": 2, "output_dir": str(out), "progress_bar": False,
                       "plot": False, "device": "cpu", "loggers": ["jsonl"], "save_freq": 2}}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(path), reward_fn=reward, config=cfg)


def test_training_runs_and_a_resume_continues_the_carry(ragged_path, tmp_path):
    whole = [h for h in build(ragged_path, tmp_path / "whole").fit(PROMPTS) if "actor/pg_loss" in h]
    assert len(whole) == 4 and all("partial/rounds" in h for h in whole)
    assert any("rollout_correction/is_weight_mean" in h for h in whole)  # (a step whose advantages are all 0 has none)
    build(ragged_path, tmp_path / "split").fit(PROMPTS)
    state = json.loads((tmp_path / "split/checkpoints/step_000002/trainer_state.json").read_text())
    carry = state["partial_rollout"]["carry"]
    assert carry and all(len(s["tokens"]) == len(s["logprobs"]) for c in carry for s in c["samples"])
    shutil.rmtree(tmp_path / "split/checkpoints/step_000004")
    resumed = [h for h in build(ragged_path, tmp_path / "split").fit(PROMPTS) if "actor/pg_loss" in h]
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole[2:], resumed[2:]):  # the resumed run continues the same carry
        assert a["partial/trained_from_carry"] == b["partial/trained_from_carry"]
        assert a["reward/mean"] == b["reward/mean"] and a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"])


def test_bad_combinations_fail_at_start_up():
    register()
    on = {"rollout": {"partial_step_tokens": 8}}
    with pytest.raises(ValueError, match="needs algorithm.rollout_correction=true"):
        config_mod.from_dict(on)
    ok = {**on, "algorithm": {"rollout_correction": True}}
    with pytest.raises(ValueError, match="is not supported with algorithm.type=remax"):
        config_mod.from_dict({**on, "algorithm": {"type": "remax", "rollout_correction": True}})
    with pytest.raises(ValueError, match="is not supported with algorithm.type=dpo"):
        config_mod.from_dict({**on, "reward_fn": {"type": "pairwise_ranking"},
                              "algorithm": {"type": "dpo", "rollout_correction": True}})
    with pytest.raises(ValueError, match="is not supported with trainer.async_mode"):
        config_mod.from_dict({**ok, "trainer": {"async_mode": "one_step"}})
    with pytest.raises(ValueError, match="is not supported with algorithm.dynamic_sampling"):
        config_mod.from_dict({**on, "algorithm": {"rollout_correction": True, "dynamic_sampling": True}})
    with pytest.raises(ValueError, match="partial_round_tokens=9 must be at most"):
        config_mod.from_dict({"rollout": {"partial_step_tokens": 8, "partial_round_tokens": 9},
                              "algorithm": {"rollout_correction": True}})
    config_mod.from_dict(ok)  # and the plain combination is accepted


def test_stop_strings_are_refused_when_the_rollout_runs(ragged_path):
    _, rows, partial = pool(ragged_path)
    with pytest.raises(ValueError, match="not supported with stop strings"):
        partial.rollout(rows[:1], [SamplingSpec(n=2, max_tokens=CAP, stop=("x",))], 0, 0, {})


def test_the_default_carry_lets_a_sample_reach_its_cap_on_the_step_budgets_alone():
    """partial_max_carry's null: ceil(cap / budget) - 1 (bounded 1..4), so no overdue group needs rounds past a
    step's budget; a value set is kept."""
    from verl_fast.trainer.partial_checks import max_carry

    def resolved(cap, budget, carry=None):
        return max_carry(config_mod.from_dict({"rollout": {"max_new_tokens": cap, "partial_step_tokens": budget,
                                                           "partial_max_carry": carry},
                                               "algorithm": {"rollout_correction": True}}).rollout)

    assert [resolved(1024, 256), resolved(1024, 512), resolved(1000, 256), resolved(1024, 1024),
            resolved(16384, 256), resolved(1024, 256, carry=2)] == [3, 1, 3, 1, 4, 2]


def overdue_rounds(path, max_carry, steps=10):
    """Each step's rounds run after the budget for its overdue groups alone (partial/overdue_rounds)."""
    _, rows, partial = pool(path, step_tokens=6, max_carry=max_carry)
    out = []
    for step in range(steps):
        batch = [rows[(3 * step + i) % len(rows)] for i in range(3)]
        metrics = {}
        partial.rollout(batch, specs(batch, 11 * step), step, 11 * step, metrics)
        out.append(metrics["partial/overdue_rounds"])
    return out


def test_with_the_default_carry_no_step_decodes_past_its_budget_for_overdue_groups(ragged_path):
    """Budget 6, cap 24: the default carry (3) gives a sample 4 budgets before it is overdue, which reach the
    cap, so no step runs rounds for overdue groups after its budget; a carry of 1 leaves overdue samples short
    of their cap, finished in rounds of their own."""
    assert overdue_rounds(ragged_path, max_carry=3) == [0.0] * 10
    assert sum(overdue_rounds(ragged_path, max_carry=1)) > 0
