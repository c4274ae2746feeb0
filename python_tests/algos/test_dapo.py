"""DAPO (Yu et al. 2025): overlong reward shaping against eq. 13 written here, and dynamic sampling
through the trainer (groups whose samples all score the same are dropped and more prompts drawn,
up to algorithm.max_extra_draws, counted in the metrics)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as C
from verl_fast.algos.dapo import informative_groups, overlong_penalty, rows_of
from verl_fast.trainer.rl_trainer import RLTrainer


def eq13(length, l_max, l_cache):
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("l_max, l_cache, factor", [(8, 1, 1.0), (16, 4, 0.5), (64, 64, 2.0), (4096, 512, 1.0)])
def test_overlong_penalty_is_eq_13(l_max, l_cache, factor):
    lengths = torch.tensor(sorted({0, 1, l_max - l_cache - 1, l_max - l_cache, l_max - l_cache + 1,
                                   (2 * l_max - l_cache) // 2, l_max - 1, l_max, l_max + 1, l_max + 40} - {-1}))
    got = overlong_penalty(lengths, l_max, l_cache, factor)
    for n, p in zip(lengths.tolist(), got.tolist()):
        assert p == pytest.approx(factor * eq13(n, l_max, l_cache), abs=1e-6), n
    with pytest.raises(ValueError, match=r"overlong_buffer must be in \[1, max_new_tokens=8\]"):
        overlong_penalty(lengths, 8, 9)
    with pytest.raises(ValueError, match="overlong_buffer must be in"):
        overlong_penalty(lengths, 8, 0)


def test_informative_groups_and_their_rows():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    index = torch.tensor([3, 3, 1, 1, 0, 0, 5])  # prompt 5 has one sample: no comparison, dropped
    assert informative_groups(scores, index) == [1]
    rows, ids = rows_of(torch.tensor([3, 3, 1, 1, 0, 0]), [0, 3])
    assert rows.tolist() == [4, 5, 0, 1] and ids.tolist() == [0, 0, 1, 1]
    assert rows_of(index, [])[0].numel() == 0


def test_config_checks():
    with pytest.raises(ValueError, match="dynamic_sampling is not supported with algorithm.type=ppo"):
        C.from_dict({"algorithm": {"type": "ppo", "dynamic_sampling": True}})
    with pytest.raises(ValueError, match="overlong_buffer=65 must be <= rollout.max_new_tokens=64"):
        C.from_dict({"algorithm": {"overlong_buffer": 65}})
    with pytest.raises(ValueError, match="max_extra_draws must be >= 0"):
        C.from_dict({"algorithm": {"max_extra_draws": -1}})


# ---------------------------------------------------------------- through the trainer

# Half the prompts score 0 whatever is sampled (an uninformative group), the others vary.
PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": "const" if a % 2 else "vary"},
            "data_source": "toy"} for a, b in [(1, 2), (3, 4), (5, 6), (2, 2), (7, 8), (9, 1), (4, 4), (11, 3)]]


def reward(solution_str, ground_truth):
    return 0.0 if ground_truth == "const" else float(len(solution_str) % 3)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def trainer_for(tiny_path, tmp_path, **algorithm):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6},
           "algorithm": {"type": "grpo", **algorithm},
           "trainer": {"total_steps": 1, "train_batch_size": 4, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    return RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg)


def test_dynamic_sampling_keeps_only_informative_groups(tiny_path, tmp_path):
    trainer = trainer_for(tiny_path, tmp_path, dynamic_sampling=True, max_extra_draws=6)
    items = trainer.processor.encode_all(PROMPTS)
    trainer._items = items
    const = [r for r in items if r.ground_truth == "const"]
    metrics = {}
    exp = trainer.make_experience(const[:2] + [r for r in items if r.ground_truth == "vary"][:2], metrics)
    kept = int(metrics["dynamic_sampling/kept_groups"])
    assert metrics["dynamic_sampling/dropped_groups"] >= 2  # at least the two constant prompts of the batch
    assert 1 <= metrics["dynamic_sampling/extra_draws"] <= 6
    assert exp.num_sequences == 4 * kept and exp.prompt_index.tolist() == [g for g in range(kept) for _ in range(4)]
    for g in range(kept):  # every kept group's samples differ, so each has a non-zero advantage
        s = exp.scores[exp.prompt_index == g]
        assert (s != s[0]).any()
        assert exp.advantages[exp.prompt_index == g].abs().sum() > 0
    if kept == 4:
        assert metrics["dynamic_sampling/extra_draws"] >= 1
    history = trainer.fit(PROMPTS)  # and a whole step trains on what it kept
    assert "dynamic_sampling/kept_groups" in history[-1] and "actor/pg_loss" in history[-1]


def test_dynamic_sampling_runs_out_of_draws(tiny_path, tmp_path):
    trainer = trainer_for(tiny_path, tmp_path, dynamic_sampling=True, max_extra_draws=2)
    items = [r for r in trainer.processor.encode_all(PROMPTS) if r.ground_truth == "const"]
    trainer._items = items
    with pytest.raises(RuntimeError, match=r"scored the same in the step's batch and 2 extra draws"):
        trainer.make_experience(items[:4], {})


def test_overlong_shaping_in_the_reward(tiny_path, tmp_path):
    trainer = trainer_for(tiny_path, tmp_path, overlong_buffer=4, overlong_penalty_factor=0.5)
    metrics = {}
    exp = trainer.make_experience(trainer.processor.encode_all(PROMPTS[:4]), metrics)
    lengths = exp.response_mask.sum(-1).tolist()
    penalty = [0.5 * eq13(n, 6, 4) for n in lengths]
    assert any(p < 0 for p in penalty), "responses in the buffer"
    totals = exp.token_level_rewards.sum(-1).tolist()
    for total, score, p in zip(totals, exp.scores.tolist(), penalty):
        assert total == pytest.approx(score + p, abs=1e-6)
    assert metrics["reward/overlong_penalty"] == pytest.approx(sum(penalty) / len(penalty), abs=1e-6)
