"""Rewards: rule-based scorers, reward models, user callables, and the registry the config uses."""

from __future__ import annotations

from typing import Any, Optional

from verl_fast.rewards.interface import (
    ON_ERROR,
    CallableReward,
    GuardedReward,
    RewardFunction,
    RewardInput,
    as_reward_function,
    load_callable,
)
from verl_fast.rewards.model import RewardModel
from verl_fast.rewards.rule import GSM8KReward, ReasoningGymReward, gsm8k_answer, last_number


def build_reward(cfg: Any, override: Optional[Any] = None) -> Optional[RewardFunction]:
    """The reward for ``cfg`` (a RewardConfig), guarded by ``cfg.on_error``; ``override`` (a callable
    or RewardFunction passed to RLTrainer) wins. pairwise_ranking (DPO) scores nothing: preference
    pairs carry their ranking."""
    reward = _unguarded(cfg, override)
    return None if reward is None else GuardedReward(reward, cfg.on_error)


def _unguarded(cfg: Any, override: Optional[Any]) -> Optional[RewardFunction]:
    if override is not None:
        return as_reward_function(override)
    kind = cfg.type
    if kind == "reasoning_gym":
        return ReasoningGymReward()
    if kind == "gsm8k":
        return GSM8KReward()
    if kind == "callable":
        return CallableReward(load_callable(cfg.path))
    if kind == "reward_model":
        import torch

        from verl_fast.models.loading import attention_kwargs

        return RewardModel.from_pretrained(cfg.model_name, attention_kwargs(cfg, "reward_fn", torch.cuda.is_available()))
    if kind == "pairwise_ranking":
        return None
    raise ValueError(f"unknown reward_fn.type {kind!r}")


__all__ = [
    "RewardInput",
    "RewardFunction",
    "CallableReward",
    "GuardedReward",
    "ON_ERROR",
    "RewardModel",
    "GSM8KReward",
    "ReasoningGymReward",
    "as_reward_function",
    "build_reward",
    "gsm8k_answer",
    "last_number",
    "load_callable",
]
