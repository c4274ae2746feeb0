"""Advantage estimators by name: the trainer picks one at config validation and calls it per batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from verl_fast.ops import advantage as ops


@dataclass
class AdvantageInput:
    token_level_rewards: torch.Tensor  # [N, L]
    response_mask: torch.Tensor  # [N, L]
    index: torch.Tensor  # [N] group id (the prompt each sample answers)
    values: Optional[torch.Tensor] = None  # [N, L] critic values (gae)
    reward_baselines: Optional[torch.Tensor] = None  # [N] greedy-rollout reward (remax)
    gamma: float = 1.0
    lam: float = 1.0
    epsilon: float = 1e-6
    whiten: bool = True  # batch-wide whitening (the estimators in BATCH_WHITENED); False: the caller does it


Estimator = Callable[[AdvantageInput], Tuple[torch.Tensor, torch.Tensor]]


def _gae(x: AdvantageInput):
    if x.values is None:
        raise ValueError("gae needs critic values")
    return ops.compute_gae(x.token_level_rewards, x.values, x.response_mask, x.gamma, x.lam, whiten=x.whiten)


ESTIMATORS: Dict[str, Estimator] = {
    "gae": _gae,
    "grpo": lambda x: ops.compute_grpo_advantage(x.token_level_rewards, x.response_mask, x.index, x.epsilon),
    "drgrpo": lambda x: ops.compute_grpo_advantage(x.token_level_rewards, x.response_mask, x.index,
                                                   norm_by_std=False),
    "rloo": lambda x: ops.compute_rloo_advantage(x.token_level_rewards, x.response_mask, x.index),
    "reinforce_pp": lambda x: ops.compute_reinforce_pp_advantage(x.token_level_rewards, x.response_mask, x.gamma,
                                                                 whiten=x.whiten),
    "reinforce_pp_baseline": lambda x: ops.compute_reinforce_pp_baseline_advantage(
        x.token_level_rewards, x.response_mask, x.index, whiten=x.whiten),
    "remax": lambda x: ops.compute_remax_advantage(x.token_level_rewards, x.reward_baselines, x.response_mask),
}

#: estimators that whiten their advantages over the whole batch's response tokens (with several
#: data-parallel ranks the batch is every rank's share: the trainer whitens over all of them)
BATCH_WHITENED = frozenset({"gae", "reinforce_pp", "reinforce_pp_baseline"})

#: estimators whose baseline is the other samples of the same prompt (need n > 1 per prompt)
GROUP_ESTIMATORS = frozenset({"grpo", "drgrpo", "rloo", "reinforce_pp_baseline"})


def get_estimator(name: str) -> Estimator:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {sorted(ESTIMATORS)}") from None
