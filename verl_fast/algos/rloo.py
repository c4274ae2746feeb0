"""RLOO (Ahmadian et al., "Back to Basics"): each of a prompt's ``rollout.n >= 2`` samples is
baselined by the mean outcome reward of the prompt's other samples (leave-one-out), on every
response token (``compute_rloo_advantage``). No critic, no whitening; PPO-clip loss."""

from __future__ import annotations

from verl_fast.algos.policy_gradient import PolicyGradientSpec
from verl_fast.ops.advantage import compute_rloo_advantage


def _rloo(exp, baselines, alg, whiten):
    return compute_rloo_advantage(exp.token_level_rewards, exp.response_mask, exp.prompt_index)


RLOO = PolicyGradientSpec("rloo", _rloo, group_baseline=True)
