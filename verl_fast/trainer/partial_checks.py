"""Start-up checks of synchronous partial rollouts (``rollout.partial_step_tokens``; registered in the config,
``verl_fast.trainer.catalog`` imports this module) and ``build``, the trainer's pool or None: the combinations
a rollout carried across steps cannot serve, each named with what to use instead."""

from __future__ import annotations

from typing import Any, Optional

from verl_fast import config
from verl_fast.rollout.partial import PartialRollout

KEY = "rollout.partial_step_tokens"


def check(cfg: config.Config) -> None:
    r = cfg.rollout
    if not r.partial_step_tokens:
        return
    from verl_fast.algos.policy_gradient import NoBaseline, PolicyGradientSpec
    from verl_fast.algos.registry import SPECS

    spec = SPECS[cfg.algorithm.type]
    if not isinstance(spec, PolicyGradientSpec):
        raise ValueError(f"{KEY} is not supported with algorithm.type={cfg.algorithm.type} (its samples are drawn "
                         "inside the step); use a policy-gradient algorithm (grpo, rloo, ppo, ...) or set it to 0")
    if not isinstance(spec.baseline, NoBaseline):
        raise ValueError(f"{KEY} is not supported with algorithm.type={cfg.algorithm.type} (its greedy baseline "
                         "rollout runs on the current weights, unlike the carried samples); use grpo or rloo")
    if not cfg.algorithm.rollout_correction:
        raise ValueError(f"{KEY} needs algorithm.rollout_correction=true: a carried sample's tokens were drawn by "
                         "older weights and are weighted by exp(old_logprob - behaviour_logprob); set it")
    if r.partial_round_tokens and r.partial_round_tokens > r.partial_step_tokens:
        raise ValueError(f"rollout.partial_round_tokens={r.partial_round_tokens} must be at most "
                         f"{KEY}={r.partial_step_tokens} (a round is part of a step's budget)")
    for name, on, why in (
            ("trainer.async_mode", cfg.trainer.async_mode != "off", "full mode has its own: trainer.partial_rollouts"),
            ("algorithm.dynamic_sampling", cfg.algorithm.dynamic_sampling, "its extra draws are sampled in the step"),
            ("rollout.multi_turn", bool(r.multi_turn), "a trajectory's turns are not carried"),
            ("rollout.record_routing", r.record_routing, "a carried sample's routes would be of older weights"),
            ("actor.routing_replay", cfg.actor.routing_replay, "a carried sample's routes would be of older weights")):
        if on:
            raise ValueError(f"{KEY} is not supported with {name} ({why}); set {KEY}=0")


def build(cfg: config.Config, engine: Any, tokenizer: Any, world: int) -> Optional[PartialRollout]:
    """The trainer's pool, or None when partial rollouts are off."""
    r = cfg.rollout
    if not r.partial_step_tokens:
        return None
    if world > 1:
        raise ValueError(f"{KEY} is not supported with {world} training processes yet (each rank's rounds would "
                         f"differ); run one training process or set {KEY}=0")
    return PartialRollout(engine, tokenizer, r.partial_step_tokens, r.partial_round_tokens, max_carry(r))


MOST_CARRY = 4  # the derived max_carry's bound: samples at most this many versions old


def max_carry(r: Any) -> int:
    """``rollout.partial_max_carry`` resolved. Its null: the fewest steps after its first that let a sample reach
    ``max_new_tokens`` on the step budgets alone, so that a step's rollout is one budget of decode steps (a smaller
    carry finishes the overdue groups in rounds of their own after the budget: a second stretch of decode steps,
    for a few rows, at nearly a full batch's cost a step); bounded to 1..``MOST_CARRY``."""
    if r.partial_max_carry is not None:
        return r.partial_max_carry
    return min(MOST_CARRY, max(1, -(-r.max_new_tokens // r.partial_step_tokens) - 1))


config.register_check(check)
