"""PPO (Schulman et al.) as in InstructGPT / verl: a critic (a value head on any causal LM, or a
token-classification model) estimates each response position's value; advantages are GAE
(``algorithm.gamma``, ``algorithm.lam``) whitened over the batch (over every data-parallel rank's
tokens with several), returns ``A + V``. The actor trains on the PPO-clip loss, the critic on the
clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- critic.cliprange_value) - R)^2)``
aggregated with ``critic.loss_agg_mode`` over the mini-batch.
"""

from __future__ import annotations

from verl_fast.algos.loss_terms import value_loss
from verl_fast.algos.policy_gradient import PolicyGradientSpec
from verl_fast.ops.advantage import compute_gae


def _gae(exp, baselines, alg, whiten):
    if exp.values is None:
        raise ValueError("gae needs critic values")
    return compute_gae(exp.token_level_rewards, exp.values, exp.response_mask, alg.gamma, alg.lam, whiten=whiten)


def _value_loss(values, sub, counts, num_sequences, cfg):
    """The micro-batch ``sub``'s share of the mini-batch's value loss, and its statistics
    (``vf_clipfrac`` weighted by the micro-batch's share of the batch's ``num_sequences``)."""
    c = cfg.critic
    loss, stats = value_loss(values.float(), sub.values, sub.returns, sub.response_mask, c.cliprange_value,
                             c.loss_agg_mode, **counts)
    return loss, {"vf_loss": loss.item(), "vf_clipfrac": float(stats["vf_clipfrac"]) * sub.num_sequences / num_sequences}


PPO = PolicyGradientSpec("ppo", _gae, whitened=True, critic_loss=_value_loss)
