"""Algorithms by name: ``algorithm.type`` picks one when the trainer is built (``build``).

    grpo, drgrpo           grpo.py          group-normalised outcome reward (Dr.GRPO: no std)
    ppo                    ppo.py           critic values, GAE, clipped value loss
    rloo                   rloo.py          leave-one-out group baseline
    reinforce_pp(_baseline) reinforce_pp.py discounted return (or group baseline), whitened
    remax                  remax.py         the greedy rollout's reward as the baseline
    dpo                    dpo.py           offline chosen / rejected pairs
    online_dpo             online_dpo.py    sampled pairs, ranked by the reward

A new algorithm is a module with a spec (``name``, ``check(cfg)``, ``build(cfg)``) added to ``SPECS``.
"""

from __future__ import annotations

from typing import Any, Dict

from verl_fast import config
from verl_fast.algos import dpo, grpo, online_dpo, ppo, reinforce_pp, remax, rloo
from verl_fast.algos.algorithm import Algorithm

SPECS: Dict[str, Any] = {spec.name: spec for spec in (
    grpo.GRPO, grpo.DR_GRPO, ppo.PPO, rloo.RLOO, reinforce_pp.REINFORCE_PP, reinforce_pp.REINFORCE_PP_BASELINE,
    remax.REMAX, dpo.DPO, online_dpo.OnlineDPO,
)}


def build(cfg: config.Config) -> Algorithm:
    """The algorithm ``cfg.algorithm.type`` names, for this run."""
    return SPECS[cfg.algorithm.type].build(cfg)
