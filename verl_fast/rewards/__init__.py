"""Rewards: rule-based scorers, reward models, user callables, and the registry by ``reward_fn.type``
(its names, its ``on_error`` modes and its start-up checks registered in the config here)."""

from __future__ import annotations

from typing import Any, Optional

from verl_fast import config
from verl_fast.rewards.interface import (
    ON_ERROR,
    CallableReward,
    GuardedReward,
    RewardFunction,
    RewardInput,
    as_reward_function,
    load_callable,
)
from verl_fast.rewards.deadline import RewardStopped, RewardTimeout
from verl_fast.rewards.model import RewardModel, is_sequence_classifier
from verl_fast.rewards.rule import GSM8KReward, ReasoningGymReward, gsm8k_answer, last_number


def build_reward(cfg: Any, override: Optional[Any] = None, tokenizer: Optional[Any] = None) -> Optional[RewardFunction]:
    """The reward for ``cfg`` (a RewardConfig), guarded by ``cfg.on_error`` and ``cfg.timeout_s``; ``override`` (a callable,
    a RewardFunction or a transformers sequence-classification model passed to RLTrainer) wins; ``tokenizer``
    (the actor's) serves such a model when none is saved beside it. pairwise_ranking (DPO) scores nothing:
    preference pairs carry their ranking."""
    reward = _unguarded(cfg, override, tokenizer)
    return None if reward is None else GuardedReward(reward, cfg.on_error, cfg.timeout_s)


def _reward_model(cfg: Any) -> RewardFunction:
    import torch

    from verl_fast.models.loading import attention_kwargs

    return RewardModel.from_pretrained(cfg.model_name, attention_kwargs(cfg, "reward_fn", torch.cuda.is_available()))


# reward_fn.type -> the reward it builds from the reward_fn section; pairwise_ranking (DPO) scores
# nothing: preference pairs carry their ranking
REWARDS = {
    "reasoning_gym": lambda cfg: ReasoningGymReward(),
    "gsm8k": lambda cfg: GSM8KReward(),
    "callable": lambda cfg: CallableReward(load_callable(cfg.path)),
    "reward_model": _reward_model,
    "pairwise_ranking": lambda cfg: None,
}


def _unguarded(cfg: Any, override: Optional[Any], tokenizer: Optional[Any]) -> Optional[RewardFunction]:
    if is_sequence_classifier(override):
        return RewardModel.for_model(override, tokenizer)
    if override is not None:
        return as_reward_function(override)
    if cfg.type not in REWARDS:
        raise ValueError(f"unknown reward_fn.type {cfg.type!r}")
    return REWARDS[cfg.type](cfg)


def _check(cfg: config.Config) -> None:
    r = cfg.reward_fn
    if r.type == "callable" and not r.path:
        raise ValueError("reward_fn.type=callable needs reward_fn.path ('module:function')")
    if r.type == "reward_model" and not r.model_name:
        raise ValueError("reward_fn.type=reward_model needs reward_fn.model_name")


config.REWARDS.register(*REWARDS)
config.REWARD_ERRORS.register(*ON_ERROR)
config.register_check(_check)

__all__ = [
    "RewardInput",
    "RewardFunction",
    "CallableReward",
    "GuardedReward",
    "ON_ERROR",
    "RewardModel",
    "RewardStopped",
    "RewardTimeout",
    "GSM8KReward",
    "ReasoningGymReward",
    "as_reward_function",
    "build_reward",
    "gsm8k_answer",
    "last_number",
    "load_callable",
]
