"""Algorithms by name: ``algorithm.type`` picks one when the trainer is built (``build``), and the
names, the loss modes (aggregation, KL, DPO, policy losses) and each algorithm's start-up checks
are registered in the config here.

    grpo, drgrpo           grpo.py          group-normalised outcome reward (Dr.GRPO: no std)
    ppo                    ppo.py           critic values, GAE, clipped value loss
    rloo                   rloo.py          leave-one-out group baseline
    reinforce_pp(_baseline) reinforce_pp.py discounted return (or group baseline), whitened
    remax                  remax.py         the greedy rollout's reward as the baseline
    dpo                    dpo.py           offline chosen / rejected pairs
    online_dpo             online_dpo.py    sampled pairs, ranked by the reward
    kto                    kto.py           unpaired completions labelled desirable or not
    orpo, simpo, cpo       reference_free.py  offline pairs, no reference model
    sft                    sft.py           supervised fine-tuning on completions / chat turns

A new algorithm is a module with a spec (``name``, ``samples``, ``needs_critic``, ``item_type``, ``check(cfg)``,
``build(cfg)``) added to ``SPECS``.
"""

from __future__ import annotations

from typing import Any, Dict

from verl_fast import config
from verl_fast.algos import (dpo, grpo, kto, loss_terms, online_dpo, ppo, reference_free,
                             reinforce_pp, remax, rloo, sft)
from verl_fast.algos.algorithm import Algorithm

SPECS: Dict[str, Any] = {spec.name: spec for spec in (
    grpo.GRPO, grpo.DR_GRPO, ppo.PPO, rloo.RLOO, reinforce_pp.REINFORCE_PP, reinforce_pp.REINFORCE_PP_BASELINE,
    remax.REMAX, dpo.DPO, online_dpo.OnlineDPO, kto.KTO, reference_free.ORPO, reference_free.SIMPO,
    reference_free.CPO, sft.SFT,
)}


def spec(cfg: config.Config) -> Any:
    """The spec ``cfg.algorithm.type`` names: what a run's assembly asks before building the algorithm
    (``samples``: it generates, so needs an engine and a reward; ``needs_critic``; ``item_type``: what the
    dataset's rows become); one line naming the choices for an unknown name."""
    found = SPECS.get(cfg.algorithm.type)
    if found is None:
        raise ValueError(f"algorithm.type must be one of {list(SPECS)}, got {cfg.algorithm.type!r}")
    return found


def build(cfg: config.Config) -> Algorithm:
    """The algorithm ``cfg.algorithm.type`` names, for this run."""
    return spec(cfg).build(cfg)


def _check(cfg: config.Config) -> None:
    spec(cfg).check(cfg)


config.ALGORITHMS.register(*SPECS)
config.LOSS_AGG_MODES.register(*loss_terms.AGG_MODES)
config.KL_ESTIMATORS.register(*loss_terms.KL_KINDS)
config.register_check(_check)
