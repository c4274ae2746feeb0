"""Reward functions as TRL and verl users write them: TRL's ``f(prompts, completions, **kwargs)``,
verl's per-sample signature with dataset columns, dict results with extra keys, and several
functions in a list, each named, weighted, logged and guarded on its own."""

import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as C
from verl_fast.rewards import CallableReward, GuardedReward, RewardInput, RewardTimeout, WeightedRewards, build_reward
from verl_fast.trainer.rl_trainer import RLTrainer


def rows_as_inputs(rows, responses):
    return [RewardInput(prompt=f"<templated>{i}", response=r, ground_truth=row.get("answer"),
                        data_source=row.get("data_source", ""), columns=dict(row))
            for i, (row, r) in enumerate(zip(rows, responses))]


def test_trl_signature_gets_prompts_completions_and_every_column():
    seen = {}

    def accuracy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, kwargs=kwargs)
        return [float(c == a) for c, a in zip(completions, kwargs["answer"])]

    rows = [{"prompt": "1+1?", "answer": "2", "level": 1}, {"prompt": "2+2?", "answer": "5", "level": 3}]
    fn = CallableReward(accuracy)
    assert fn.trl
    assert fn(rows_as_inputs(rows, ["2", "4"])) == [1.0, 0.0]
    assert seen["prompts"] == ["1+1?", "2+2?"] and seen["completions"] == ["2", "4"]
    # every column but the prompt, as TRL passes them (ground_truth: the row's, here from 'answer'), and
    # TRL's own completion_ids / trainer_state (none here: the inputs were built by hand)
    assert seen["kwargs"] == {"answer": ["2", "5"], "level": [1, 3], "ground_truth": ["2", "5"],
                              "completion_ids": [None, None], "trainer_state": None}


def test_trl_signature_conversational_and_named_columns_only():
    seen = {}

    def fmt(prompts, completions, level):
        seen.update(prompts=prompts, completions=completions, level=level)
        return [len(c[0]["content"]) * lv for c, lv in zip(completions, level)]

    chat = [{"role": "user", "content": "hi"}]
    rows = [{"prompt": chat, "level": 2, "other": "x"}, {"prompt": chat, "level": 5, "other": "y"}]
    assert CallableReward(fmt)(rows_as_inputs(rows, ["abc", "a"])) == [6.0, 5.0]
    assert seen["prompts"] == [chat, chat]
    assert seen["completions"] == [[{"role": "assistant", "content": "abc"}], [{"role": "assistant", "content": "a"}]]
    assert seen["level"] == [2, 5]  # 'other' is not named and there is no **kwargs: not passed


def test_trl_signature_wrong_count_names_the_function():
    def short(prompts, completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="reward function short returned 1 scores for 2 samples"):
        CallableReward(short)(rows_as_inputs([{"prompt": "a"}, {"prompt": "b"}], ["x", "y"]))


def test_verl_signature_gets_named_columns():
    def score(solution_str, ground_truth, difficulty):
        return float(solution_str == ground_truth) * difficulty

    rows = [{"prompt": "p", "answer": "2", "difficulty": 3}, {"prompt": "p", "answer": "2", "difficulty": 4}]
    assert CallableReward(score)(rows_as_inputs(rows, ["2", "1"])) == [3.0, 0.0]


def test_dict_result_extra_numeric_keys_are_kept():
    def score(solution_str):
        return {"score": float(len(solution_str)), "acc": len(solution_str) > 1, "note": "text is ignored"}

    guarded = GuardedReward(CallableReward(score), "raise")
    assert guarded(rows_as_inputs([{"prompt": "p"}] * 3, ["a", "bb", "ccc"])) == [1.0, 2.0, 3.0]
    assert guarded.last_extras == {"acc": pytest.approx(2 / 3)}
    # a batch (TRL) function's dicts too
    trl = GuardedReward(CallableReward(lambda prompts, completions: [{"score": 1.0, "x": 4.0}] * len(completions)))
    assert trl(rows_as_inputs([{"prompt": "p"}] * 2, ["a", "b"])) == [1.0, 1.0] and trl.last_extras == {"x": 4.0}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3), st.lists(st.floats(-10, 10), min_size=4, max_size=4)),
                min_size=1, max_size=4))
def test_weighted_sum_matches_a_float64_reference(parts):
    """The combined score of each sample is sum_i w_i * r_i(sample); each reward's unweighted mean logged."""
    inputs = rows_as_inputs([{"prompt": "p"}] * 4, ["r0", "r1", "r2", "r3"])
    built = []
    for k, (w, values) in enumerate(parts):
        fn = (lambda vals: (lambda samples: list(vals)))(values)
        built.append((f"f{k}", w, GuardedReward(CallableReward(fn))))
    combined = WeightedRewards(built)
    got = combined(inputs)
    want = [math.fsum(w * v[j] for w, v in parts) for j in range(4)]
    assert max(abs(g - x) for g, x in zip(got, want)) <= 1e-9 * (1 + max(abs(x) for x in want))
    if len(parts) > 1:
        for k, (_, values) in enumerate(parts):
            assert combined.last_metrics[f"reward/f{k}/mean"] == pytest.approx(math.fsum(values) / 4, abs=1e-12)
    else:
        assert combined.last_metrics == {}


def test_reward_list_from_the_config(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text(
        "def exact(solution_str, ground_truth):\n    return float(solution_str == ground_truth)\n"
        "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
        "def flaky(solution_str):\n    if solution_str == 'bad':\n        raise KeyError('x')\n    return 1.0\n")
    cfg = C.from_dict({"reward_fn": [
        {"type": "callable", "path": f"{module}:exact", "weight": 2.0},
        {"type": "callable", "path": f"{module}:length", "weight": 0.5, "name": "len"},
        {"type": "callable", "path": f"{module}:flaky", "on_error": "zero"}]})
    assert cfg.reward_fn.type == "weighted" and len(cfg.reward_fn.functions) == 3
    reward = build_reward(cfg.reward_fn)
    scores = reward(rows_as_inputs([{"prompt": "p", "answer": "ab"}, {"prompt": "p", "answer": "ab"}], ["ab", "bad"]))
    assert scores == [2.0 * 1 + 0.5 * 2 + 1.0, 0.0 + 0.5 * 3 + 0.0]
    assert reward.last_errors == 1  # flaky's on_error: zero, its own
    assert reward.last_metrics == {"reward/exact/mean": 0.5, "reward/len/mean": 2.5, "reward/flaky/mean": 0.5}


@pytest.mark.parametrize("data,message", [
    ({"reward_fn": [{"type": "callable"}]}, r"reward_fn\[0\].type=callable needs reward_fn\[0\].path"),
    ({"reward_fn": [{"type": "gsm8k", "wieght": 1}]}, r"unknown key reward_fn\[0\].wieght"),
    ({"reward_fn": [{"type": "gsm8k", "weight": "heavy"}]}, r"reward_fn\[0\].weight must be a number"),
    ({"reward_fn": [{"type": "gsm8k"}, 3]}, r"reward_fn.functions\[1\] must be a mapping"),
    ({"reward_fn": [{"type": "gsm8k"}, {"type": "pairwise_ranking"}]}, r"pairwise_ranking is not supported in a list"),
    ({"reward_fn": {"type": "weighted"}}, r"needs reward_fn.functions"),
    ({"reward_fn": [{"type": "gsm8k", "timeout_s": 0}]}, r"reward_fn\[0\].timeout_s must be > 0"),
])
def test_reward_list_errors_name_the_entry(data, message):
    with pytest.raises(ValueError, match=message):
        C.from_dict(data)


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="names must differ.*'gsm8k' more than once"):
        build_reward(C.from_dict({"reward_fn": [{"type": "gsm8k"}, {"type": "gsm8k", "weight": 2}]}).reward_fn)


def test_each_function_keeps_its_own_timeout():
    stop = threading.Event()

    def fast(samples):
        return [1.0] * len(samples)

    def hangs(samples):
        stop.wait(5)
        return [0.0] * len(samples)

    cfg = C.from_dict({}).reward_fn
    cfg.timeout_s = 0.2
    reward = build_reward(cfg, [fast, {"fn": hangs, "name": "slow", "weight": 3}])
    try:
        with pytest.raises(RewardTimeout, match="reward function hangs did not return within"):
            reward(rows_as_inputs([{"prompt": "p"}] * 2, ["a", "b"]))
    finally:
        stop.set()
    with pytest.raises(ValueError, match=r"reward_fn\[0\]: a mapping needs 'fn'"):
        build_reward(cfg, [{"function": fast}])


def test_trainer_logs_each_reward_and_passes_columns(tmp_path):
    path = save_tiny_model(tmp_path / "m", family="qwen2")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    seen_levels = []

    def length(prompts, completions, level, **kwargs):
        seen_levels.extend(level)
        return [float(len(c)) for c in completions]

    def detail(solution_str, level):
        return {"score": float(level), "has_digit": any(ch.isdigit() for ch in solution_str)}

    rows = [{"prompt": f"What is {i} + 1?", "level": i} for i in range(4)]
    cfg = {"rollout": {"type": "hf", "n": 2, "max_new_tokens": 4},
           "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    rewards = [{"fn": length, "weight": 0.25}, {"fn": detail, "weight": 2.0, "name": "lvl"}]
    m = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=rewards, config=cfg).fit(rows)[0]
    # the column reached the TRL function: each prompt's level once per sample (n = 2)
    assert len(seen_levels) == 4 and all(seen_levels.count(v) % 2 == 0 for v in seen_levels)
    assert set(seen_levels) <= {0, 1, 2, 3}
    assert m["reward/mean"] == pytest.approx(0.25 * m["reward/length/mean"] + 2.0 * m["reward/lvl/mean"], rel=1e-5)
    assert 0.0 <= m["reward/lvl/has_digit"] <= 1.0
