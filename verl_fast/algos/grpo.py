"""GRPO (Shao et al., DeepSeekMath) and Dr.GRPO (Liu et al., "Understanding R1-Zero-Like Training").

Each prompt is answered ``rollout.n >= 2`` times; a sample's advantage is its outcome reward
against the other samples of its prompt, ``(s - mean) / (std + algorithm.epsilon)`` (GRPO) or
``s - mean`` (Dr.GRPO, no division by the std), on every response token (``compute_grpo_advantage``).
No critic, no whitening; PPO-clip loss. Dr.GRPO is usually run with
``actor.loss_agg_mode: seq-mean-token-sum-norm`` (the paper's length normalisation).
"""

from __future__ import annotations

from verl_fast.algos.policy_gradient import PolicyGradientSpec
from verl_fast.ops.advantage import compute_grpo_advantage


def _grpo(exp, baselines, alg, whiten):
    return compute_grpo_advantage(exp.token_level_rewards, exp.response_mask, exp.prompt_index, alg.epsilon)


def _drgrpo(exp, baselines, alg, whiten):
    return compute_grpo_advantage(exp.token_level_rewards, exp.response_mask, exp.prompt_index, norm_by_std=False)


GRPO = PolicyGradientSpec("grpo", _grpo, group_baseline=True)
DR_GRPO = PolicyGradientSpec("drgrpo", _drgrpo, group_baseline=True)
