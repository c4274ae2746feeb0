"""TRL's reward contract (parameters bound by name from prompts, completions, completion_ids,
trainer_state, the dataset's columns and **kwargs; None = not applicable, nansum over functions),
TRL's preference formats, algorithm.beta, RLTrainer(actor_model=<name>), and the early checks of the
data against the reward. TRL's own reward functions run when trl is installed (the ``trl`` extra)."""

import json
import math

import pytest

from tiny_models import save_tiny_model
from verl_fast import config as C
from verl_fast.trainer import preflight
from verl_fast.data import RLDataProcessor, preference_parts
from verl_fast.rewards import CallableReward, GuardedReward, RewardInput, WeightedRewards, build_reward
from verl_fast.trainer.rl_trainer import RLTrainer


# TRL's documentation's reward functions, as written there
def reward_func(completions, **kwargs):
    return [float(len(set(completion))) for completion in completions]


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def accuracy_reward(completions, solution, **kwargs):
    return [1.0 if s in c[0]["content"] else 0.0 for c, s in zip(completions, solution)]


def inputs(rows, responses, ids=None, state=None):
    return [RewardInput(prompt="templated", response=r, columns=dict(row), completion_ids=(ids or [None] * 9)[i],
                        trainer_state=state) for i, (row, r) in enumerate(zip(rows, responses))]


def test_trl_quickstart_functions_bind_by_name():
    plain = [{"prompt": "Write"}, {"prompt": "Say"}]
    assert CallableReward(reward_func)(inputs(plain, ["aab", "abc"])) == [2.0, 3.0]
    assert CallableReward(reward_len)(inputs(plain, ["x" * 20, "x" * 25])) == [0.0, -5.0]
    chat = [{"prompt": [{"role": "user", "content": "2+2?"}], "solution": "4"},
            {"prompt": [{"role": "user", "content": "3+3?"}], "solution": "6"}]
    assert CallableReward(accuracy_reward)(inputs(chat, ["It is 4", "It is 5"])) == [1.0, 0.0]


def test_every_trl_argument_by_keyword():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, level):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state, level=level)
        return [0.0] * len(completions)

    state = object()
    rows = [{"prompt": [{"role": "user", "content": "q"}], "level": 3}]
    CallableReward(spy)(inputs(rows, ["a"], ids=[[5, 6]], state=state))
    assert seen == {"prompts": [[{"role": "user", "content": "q"}]],
                    "completions": [[{"role": "assistant", "content": "a"}]], "ids": [[5, 6]], "state": state,
                    "level": [3]}


def test_none_is_not_applicable_weighted_nansum():
    def maybe(completions, **kwargs):
        return [None if c == "skip" else 1.0 for c in completions]

    def always(completions, **kwargs):
        return [2.0 for _ in completions]

    rows = [{"prompt": "p"}] * 2
    both = WeightedRewards([("maybe", 0.5, GuardedReward(CallableReward(maybe))),
                            ("always", 3.0, GuardedReward(CallableReward(always)))])
    assert both(inputs(rows, ["skip", "go"])) == [6.0, 0.5 + 6.0]
    assert both.last_metrics["reward/maybe/mean"] == 1.0  # over the samples it applied to
    alone = WeightedRewards([("maybe", 1.0, GuardedReward(CallableReward(maybe)))])
    assert alone(inputs(rows, ["skip", "skip"])) == [0.0, 0.0]  # TRL: a sample no function applies to scores 0
    assert math.isnan(GuardedReward(CallableReward(maybe))(inputs(rows[:1], ["skip"]))[0])


def test_verl_signature_still_per_sample():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)

    fn = CallableReward(compute_score)
    assert not fn.trl
    out = fn([RewardInput(prompt="p", response="4", ground_truth="4", data_source="d"),
              RewardInput(prompt="p", response="5", ground_truth="4", data_source="d")])
    assert out == [1.0, 0.0]


def test_missing_column_is_caught_on_the_first_rows_naming_file_and_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": "4"}) for i in range(3)))
    cfg = C.from_dict({})
    parts = [("accuracy_reward", CallableReward(accuracy_reward))]
    rows = RLDataProcessor(None).load(str(data))
    with pytest.raises(ValueError, match=rf"^{data}:1: reward function accuracy_reward needs 'solution', which the "
                                         r"row does not have \(its columns: answer, prompt\)$"):
        preflight.check_reward(parts, rows, str(data))
    data.write_text('{"prompt": "q", "data_source": "openai/gsm8k", "ground_truth": "4"}\n\n'
                    '{"prompt": "q", "data_source": "my/custom", "ground_truth": "4"}\n')
    with pytest.raises(ValueError, match=rf"^{data}:3 \(reward_fn.type=auto\): data_source 'my/custom' has no"):
        preflight.check(cfg, RLDataProcessor(None).load(str(data)), str(data))
    data.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match=rf"^{data}:1: a row needs a 'prompt' field"):
        preflight.check(cfg, RLDataProcessor(None).load(str(data)), str(data))


def test_cli_stops_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from verl_fast.cli import main as cli

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q", "data_source": "my/custom"}\n')
    code = cli.main(["train", f"data.train_files={data}", "algorithm.adv_estimator=grpo",
                     "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.model.path=/no/such/model"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if ": note: " not in line]  # verl's defaults
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"verl-fast train: config error: {data}:1 (reward_fn.type=auto): data_source 'my/custom'")


def test_algorithm_beta_is_trl_kl_coefficient_or_dpo_temperature():
    cfg = C.from_dict({"algorithm": {"type": "grpo", "beta": 0.04}})
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (True, 0.04, "k3")
    assert C.from_dict({"algorithm": {"type": "grpo", "beta": 0.0}}).actor.use_kl_loss is False
    assert C.from_dict({"algorithm": {"type": "grpo"}}).actor.use_kl_loss is False
    assert C.from_dict({"algorithm": {"type": "dpo"}}).algorithm.beta == 0.1
    assert C.from_dict({"algorithm": {"type": "dpo", "beta": 0.3}}).actor.use_kl_loss is False
    with pytest.raises(ValueError, match="algorithm.beta=0.04 .* and actor.use_kl_loss with actor.kl_loss_coef=0.01"):
        C.from_dict({"algorithm": {"type": "grpo", "beta": 0.04}, "actor": {"use_kl_loss": True, "kl_loss_coef": 0.01}})


def chat(role, text):
    return {"role": role, "content": text}


@pytest.mark.parametrize("row, parts", [
    ({"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green.", "score_chosen": 9.0, "score_rejected": 2.0},
     ("Sky?", "Blue.", "Green.")),
    ({"chosen": "The sky is blue.", "rejected": "The sky is green."}, ("The sky is", " blue.", " green.")),
    ({"chosen": [chat("user", "Sky?"), chat("assistant", "Blue.")],
      "rejected": [chat("user", "Sky?"), chat("assistant", "Green.")]},
     ([chat("user", "Sky?")], [chat("assistant", "Blue.")], [chat("assistant", "Green.")])),
    # a plain prompt column beside conversational pairs: TRL extracts the prompt from the pairs
    ({"prompt": "Sky?", "chosen": [chat("user", "Sky?"), chat("assistant", "Blue.")],
      "rejected": [chat("user", "Sky?"), chat("assistant", "Green.")]},
     ([chat("user", "Sky?")], [chat("assistant", "Blue.")], [chat("assistant", "Green.")])),
    ({"question": {"full_text": "Sky?"}, "answer_0": "Green.", "answer_1": "Blue.", "score_0": -1.0, "score_1": 1.0,
      "quotes_0": {}, "tokens_0": [], "quotes_1": {}, "tokens_1": []}, ("Sky?", "Blue.", "Green.")),
])
def test_trl_preference_formats(row, parts):
    assert preference_parts(row) == parts


def test_preference_ties_and_bad_rows():
    assert preference_parts({"question": "q", "answer_0": "a", "answer_1": "b", "score_0": 0, "score_1": 0}) is None
    with pytest.raises(ValueError, match="share no prompt"):
        preference_parts({"chosen": "Yes", "rejected": "No"})
    with pytest.raises(ValueError, match="a preference row needs chosen/rejected"):
        preference_parts({"prompt": "q", "chosen": "a"})


def test_dpo_needs_no_reward_entry_and_trains_on_implicit_pairs(tmp_path):
    path = save_tiny_model(tmp_path / "m")
    cfg = {"actor": {"lr": 1e-3}, "algorithm": {"type": "dpo"},
           "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu", "hf_export": "none"}}
    trainer = RLTrainer(actor_model=str(path), config=cfg)  # by name: model and tokenizer loaded
    assert trainer.reward is None or trainer.cfg.reward_fn.type == "auto"
    rows = [{"chosen": [chat("user", f"{a}+{a}?"), chat("assistant", str(2 * a))],
             "rejected": [chat("user", f"{a}+{a}?"), chat("assistant", "no")]} for a in range(4)]
    history = trainer.fit(rows)
    assert len(history) == 1 and "dpo/reward_margin" in history[0]


def test_trainer_passes_completion_ids_and_trainer_state(tmp_path):
    path = save_tiny_model(tmp_path / "m")
    seen = []

    def spy(completions, completion_ids, trainer_state, **kwargs):
        seen.append((completions, completion_ids, trainer_state.global_step, trainer_state.max_steps))
        return [float(len(ids) % 2) for ids in completion_ids]

    trainer = RLTrainer(actor_model=str(path), reward_fn=spy, config={
        "rollout": {"n": 2, "max_new_tokens": 6, "type": "hf"}, "algorithm": {"type": "grpo", "beta": 0.04},
        "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                    "progress_bar": False, "plot": False, "device": "cpu", "hf_export": "none"}})
    assert trainer.ref is not None  # beta > 0: the k3 KL loss needs the reference
    trainer.fit([{"prompt": [chat("user", f"say {i}")]} for i in range(2)])
    completions, ids, step, total = seen[0]
    tok = trainer.tokenizer
    assert (step, total) == (0, 1)  # TRL's global_step: the optimiser steps done before this one
    assert len(ids) == 4 and all(1 <= len(i) <= 6 for i in ids)
    for c, i in zip(completions, ids):  # the response text is what its ids decode to
        assert c[0]["role"] == "assistant" and c[0]["content"] == tok.decode(i, skip_special_tokens=True)


def test_trl_own_reward_functions():
    rewards = pytest.importorskip("trl.rewards")
    chat_rows = [{"prompt": [chat("user", "1/3?")], "solution": "\\frac{1}{3}"}] * 2
    responses = ["<think>\nhm\n</think>\nMy answer is \\boxed{\\frac{1}{3}}", "My answer is \\boxed{\\frac{1}{2}}"]
    assert CallableReward(rewards.think_format_reward)(inputs(chat_rows, responses)) == [1.0, 0.0]
    pytest.importorskip("math_verify")
    assert CallableReward(rewards.accuracy_reward)(inputs(chat_rows, responses)) == [1.0, 0.0]
    unparseable = [{"prompt": [chat("user", "?")], "solution": "not math at all {"}]
    reward = build_reward(C.RewardConfig(), [rewards.accuracy_reward, rewards.think_format_reward])
    assert reward(inputs(unparseable, ["<think>x</think> y"])) == [1.0]  # accuracy said None: left out


def test_docs_trl_example_runs_as_written(tmp_path, monkeypatch):
    """docs/verl_and_trl.md's TRL example, with only the model name pointing at a tiny local model."""
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "verl_and_trl.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", docs, re.S) if "def reward_len" in b]
    path = save_tiny_model(tmp_path / "m", max_position_embeddings=1024)  # the example's 64 new tokens fit (vLLM too)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(block.replace('"Qwen/Qwen2-0.5B-Instruct"', repr(str(path))), namespace)  # noqa: S102 - our own docs
    history = namespace["trainer"].history
    assert len(history) == 2 and all("reward/accuracy_reward/mean" in h for h in history)
