"""``reward_fn.launch_reward_fn_async``: the step's reward scores in a thread while the old-log-prob,
reference and value passes run; the experience is the same as scored first and passed after."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.rewards import RewardTimeout, scoring
from verl_fast.trainer.rl_trainer import RLTrainer

PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}, "data_source": "toy"}
           for a, b in [(1, 2), (3, 4)]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def ppo_trainer(path, tmp_path, reward, overlap=True, algorithm=None, **reward_fn):
    """PPO with a critic, a KL reference and two mini-batches: old-log-prob, reference and value passes."""
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    cfg = {"actor": {"lr": 1e-3, "micro_batch_size": 4, "ppo_mini_batch_size": 4, "use_kl_loss": True},
           "critic": {"lr": 1e-3},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6, "temperature": 1.0, "seed": 3},
           "reward_fn": {"launch_reward_fn_async": overlap, **reward_fn},
           "algorithm": algorithm or {"type": "ppo"},
           "trainer": {"train_batch_size": 2, "output_dir": str(tmp_path / f"run{overlap}"), "progress_bar": False,
                       "plot": False, "device": "cpu"}}
    return RLTrainer(actor_model=load(), tokenizer=AutoTokenizer.from_pretrained(path), critic_model=load(),
                     reward_fn=reward, config=cfg)


def beside(trainer):
    """What make_experience decides: the reward scores beside the passes."""
    return not trainer.algorithm.scores_decide_rows and scoring.beside_passes(
        trainer.cfg.reward_fn.launch_reward_fn_async, trainer.device, trainer.reward)


def test_same_experience_either_way(tiny_path, tmp_path):
    reward = lambda solution_str: float(len(solution_str) % 3)  # noqa: E731
    exps = {}
    for overlap in (True, False):
        trainer = ppo_trainer(tiny_path, tmp_path, reward, overlap)
        assert beside(trainer) is overlap
        exps[overlap] = trainer.make_experience(trainer.processor.encode_all(PROMPTS), {})
    a, b = exps[True], exps[False]
    for key in ("input_ids", "scores", "old_logprobs", "ref_logprobs", "values", "advantages", "returns"):
        assert getattr(a, key) is not None and torch.equal(getattr(a, key), getattr(b, key)), key


def test_the_reward_scores_while_the_passes_run(tiny_path, tmp_path):
    """The reward waits for the old-log-prob pass to start and the pass for the reward: each sees the
    other start only when they overlap (scored first, or passed first, one of them waits in vain)."""
    for overlap, wait_s in ((True, 30.0), (False, 0.5)):
        pass_started, reward_started, seen = threading.Event(), threading.Event(), {}

        def reward(solution_str, wait_s=wait_s, pass_started=pass_started, reward_started=reward_started, seen=seen):
            if "by reward" not in seen:
                reward_started.set()
                seen["by reward"] = pass_started.wait(wait_s)
            return 1.0

        trainer = ppo_trainer(tiny_path, tmp_path, reward, overlap)
        old_logprobs = trainer._old_logprobs

        def marked(exp, wait_s=wait_s, pass_started=pass_started, reward_started=reward_started, seen=seen):
            pass_started.set()
            seen["by pass"] = reward_started.wait(wait_s)
            return old_logprobs(exp)

        trainer._old_logprobs = marked
        exp = trainer.make_experience(trainer.processor.encode_all(PROMPTS), {})
        assert exp.old_logprobs is not None
        assert seen == ({"by reward": True, "by pass": True} if overlap else {"by reward": False, "by pass": True})


def test_not_beside_where_it_cannot_be(tiny_path, tmp_path):
    reward = lambda solution_str: 1.0  # noqa: E731
    assert not beside(ppo_trainer(tiny_path, tmp_path, reward, overlap=None))  # auto: GPU only
    assert not beside(ppo_trainer(tiny_path, tmp_path, reward, timeout_s=None))  # main thread
    # scores choose the groups before any pass
    trainer = ppo_trainer(tiny_path, tmp_path, reward, algorithm={"type": "grpo", "dynamic_sampling": True})
    assert trainer.algorithm.scores_decide_rows and scoring.beside_passes(True, trainer.device, trainer.reward)
    assert not beside(trainer)


def test_a_reward_failure_stops_the_step_as_before(tiny_path, tmp_path):
    def fails(solution_str):
        raise ValueError("the scorer broke")

    trainer = ppo_trainer(tiny_path, tmp_path, fails)
    with pytest.raises(ValueError, match="the scorer broke"):
        trainer.make_experience(trainer.processor.encode_all(PROMPTS), {})

    def slow(solution_str):
        threading.Event().wait(5)
        return 1.0

    trainer = ppo_trainer(tiny_path, tmp_path, slow, timeout_s=0.2)
    with pytest.raises(RewardTimeout, match="timeout_s=0.2"):
        trainer.make_experience(trainer.processor.encode_all(PROMPTS), {})
