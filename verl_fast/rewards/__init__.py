"""Rewards: rule-based scorers, reward models, user callables, and the registry by ``reward_fn.type``
(its names, its ``on_error`` modes and its start-up checks registered in the config here); several
reward functions, each named and weighted, combine as ``weighted.WeightedRewards``."""

from __future__ import annotations

from typing import Any, Optional, Tuple

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
from verl_fast.rewards.by_source import DataSourceReward
from verl_fast.rewards.rule import GSM8KReward, ReasoningGymReward, gsm8k_answer, last_number
from verl_fast.rewards.weighted import WeightedRewards
from verl_fast.rewards import code, judge, verl_managers
from verl_fast.rewards.judge import bind_engine as bind_judge_engine


def build_reward(cfg: Any, override: Optional[Any] = None, tokenizer: Optional[Any] = None
                 ) -> Optional[WeightedRewards]:
    """The reward for ``cfg`` (a RewardConfig): each of its functions (``config.reward_functions``)
    guarded by its ``on_error`` and ``timeout_s``, weighted. ``override`` (passed to RLTrainer) wins:
    a callable, a RewardFunction or a transformers sequence-classification model, or a list of them,
    each optionally a mapping ``{"fn": f, "weight": w, "name": n}`` (guarded by ``cfg``'s ``on_error``
    and ``timeout_s``); ``tokenizer`` (the actor's) serves such a model when none is saved beside it.
    pairwise_ranking (DPO) scores nothing: preference pairs carry their ranking."""
    if override is not None:
        items = override if isinstance(override, (list, tuple)) else [override]
        parts = [_override_part(item, i, cfg, tokenizer) for i, item in enumerate(items)]
        return WeightedRewards(parts)
    entries = config.reward_functions(cfg)
    if any(e.type == "pairwise_ranking" for e in entries):
        return None
    parts = []
    for e in entries:
        reward = _unguarded(e)
        parts.append((e.name or reward.name, e.weight, GuardedReward(reward, e.on_error, e.timeout_s)))
    return WeightedRewards(parts)


def _override_part(item: Any, index: int, cfg: Any, tokenizer: Optional[Any]
                   ) -> Tuple[str, float, GuardedReward]:
    spec = dict(item) if isinstance(item, dict) else {"fn": item}
    unknown = sorted(set(spec) - {"fn", "weight", "name"})
    if unknown or "fn" not in spec:
        raise ValueError(f"reward_fn[{index}]: a mapping needs 'fn' (and optionally 'weight', 'name'), got keys "
                         f"{sorted(spec)}")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight != weight:
        raise ValueError(f"reward_fn[{index}].weight must be a number, got {weight!r}")
    fn = spec["fn"]
    reward = RewardModel.for_model(fn, tokenizer) if is_sequence_classifier(fn) else as_reward_function(fn)
    return (str(spec.get("name") or reward.name), float(weight), GuardedReward(reward, cfg.on_error, cfg.timeout_s))


def _reward_model(cfg: Any) -> RewardFunction:
    import torch

    from verl_fast.models.loading import attention_kwargs

    return RewardModel.from_pretrained(cfg.model_name, attention_kwargs(cfg, "reward_fn", torch.cuda.is_available()))


# reward_fn.type -> the reward it builds from the reward_fn section; auto: each row by its data_source
# (rewards/by_source.py, as verl routes them); pairwise_ranking (DPO) scores nothing: preference pairs
# carry their ranking
REWARDS = {
    "auto": lambda cfg: DataSourceReward(),
    "reasoning_gym": lambda cfg: ReasoningGymReward(),
    "gsm8k": lambda cfg: GSM8KReward(),
    "callable": lambda cfg: verl_managers.callable_reward(cfg.path, cfg.manager, cfg.kwargs),
    "reward_model": _reward_model,
    "code": lambda cfg: code.CodeReward(code.parse(cfg.sandbox)),
    "judge": lambda cfg: judge.JudgeReward.from_config(judge.parse(cfg.judge)),
    "pairwise_ranking": lambda cfg: None,
}


def _unguarded(cfg: Any) -> RewardFunction:
    if cfg.type not in REWARDS:
        raise ValueError(f"unknown reward_fn.type {cfg.type!r}")
    return REWARDS[cfg.type](cfg)


def _check(cfg: config.Config) -> None:
    for key, r in config.keyed_reward_functions(cfg.reward_fn):
        several = key != "reward_fn"  # one of a weighted section's functions
        if r.type == "callable" and not r.path:
            raise ValueError(f"{key}.type=callable needs {key}.path ('module:function')")
        problems = verl_managers.check(r.manager, r.type, key)
        if problems:
            raise ValueError(problems[0])
        if r.type == "reward_model" and not r.model_name:
            raise ValueError(f"{key}.type=reward_model needs {key}.model_name")
        if several and r.timeout_s is not None and r.timeout_s <= 0:
            raise ValueError(f"{key}.timeout_s must be > 0 seconds (or null for no limit), got {r.timeout_s}")
        if several and r.type == "pairwise_ranking":
            raise ValueError(f"{key}.type=pairwise_ranking is not supported in a list of reward functions; use "
                             "reward_fn.type=pairwise_ranking alone (DPO)")


config.REWARDS.register(*REWARDS, config.WEIGHTED_REWARD)
config.REWARD_ERRORS.register(*ON_ERROR)
config.REWARD_MANAGERS.register(*verl_managers.MANAGERS)
config.register_check(_check)

__all__ = [
    "RewardInput",
    "RewardFunction",
    "CallableReward",
    "DataSourceReward",
    "GuardedReward",
    "ON_ERROR",
    "RewardModel",
    "RewardStopped",
    "RewardTimeout",
    "GSM8KReward",
    "ReasoningGymReward",
    "WeightedRewards",
    "as_reward_function",
    "build_reward",
    "gsm8k_answer",
    "last_number",
    "load_callable",
]
