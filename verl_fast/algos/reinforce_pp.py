"""REINFORCE++ (Hu et al.) and REINFORCE++ with a group baseline.

- ``reinforce_pp``: the discounted return (``algorithm.gamma``) of the token rewards, run backwards
  over each response (carried unchanged across masked positions inside it), whitened over the batch
  (``compute_reinforce_pp_advantage``).
- ``reinforce_pp_baseline``: the outcome reward minus the mean of the prompt's ``rollout.n >= 2``
  samples, whitened over the batch (``compute_reinforce_pp_baseline_advantage``).
With several data-parallel ranks the whitening runs over every rank's tokens. No critic; PPO-clip loss.
"""

from __future__ import annotations

from verl_fast.algos.policy_gradient import PolicyGradientSpec
from verl_fast.ops.advantage import compute_reinforce_pp_advantage, compute_reinforce_pp_baseline_advantage


def _reinforce_pp(exp, baselines, alg, whiten):
    return compute_reinforce_pp_advantage(exp.token_level_rewards, exp.response_mask, alg.gamma, whiten=whiten)


def _reinforce_pp_baseline(exp, baselines, alg, whiten):
    return compute_reinforce_pp_baseline_advantage(exp.token_level_rewards, exp.response_mask, exp.prompt_index,
                                                   whiten=whiten)


REINFORCE_PP = PolicyGradientSpec("reinforce_pp", _reinforce_pp, whitened=True)
REINFORCE_PP_BASELINE = PolicyGradientSpec("reinforce_pp_baseline", _reinforce_pp_baseline, whitened=True,
                                           group_baseline=True)
