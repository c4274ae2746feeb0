"""The policy losses ``actor.policy_loss`` picks, as per-token losses ``[B, L]`` before aggregation
(``actor_loss`` aggregates them with ``actor.loss_agg_mode``, after any rollout correction).

    vanilla     PPO-clip with asymmetric and dual clipping (``loss_terms.ppo_clip_tokens``)
    gspo        GSPO (Zheng et al., 2025): one importance ratio per sequence, s = exp(mean_t log r_t),
                clipped per sequence against the sequence's advantage (mean of its tokens')
    gspo_token  GSPO-token: the value of s on each token with the gradient of that token's own
                log-prob, s_t = sg(s) * pi_t / sg(pi_t), against each token's advantage
    cispo       CISPO (MiniMax-M1, 2025): -sg(clip(r, 1-low, 1+high)) * A * log pi; every token keeps
                a gradient, the clipped weight only scales it
    sapo        SAPO (Gao et al., 2025): a soft gate in place of the clip,
                -A * 4/tau * sigmoid(tau (r - 1)), tau = sapo_tau_pos for A > 0, sapo_tau_neg otherwise

Each returns ``(per_token, stats)``; the statistics are detached token means over the mask.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from verl_fast.algos.loss_terms import ppo_clip_tokens
from verl_fast.config import ActorConfig
from verl_fast.ops.masked import masked_mean, masked_sum

Tokens = Tuple[torch.Tensor, Dict[str, torch.Tensor]]
POLICY_LOSSES = ("vanilla", "gspo", "gspo_token", "cispo", "sapo")


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    # exp() of a large log-ratio overflows: the same bound as PPO-clip's
    return torch.clamp(logp - old_logp, min=-20.0, max=20.0)


def gspo_tokens(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                clip_ratio_low: float, clip_ratio_high: float, token_level: bool = False) -> Tokens:
    """GSPO's loss of each sequence, ``max(-A s, -A clip(s, 1-low, 1+high))`` with
    ``s = exp(mean over the response of (logp - old))``, on each of its tokens (so that
    ``seq-mean-token-mean`` gives the paper's mean over sequences). ``token_level``: GSPO-token."""
    mask = response_mask.to(logp.dtype)
    length = mask.sum(-1, keepdim=True).clamp(min=1.0)
    seq_log_ratio = masked_sum(logp - old_logp, mask, axis=-1).unsqueeze(-1) / length  # [B, 1]
    if token_level:
        # value sg(s) on every token, gradient that of the token's own log-prob
        log_s = seq_log_ratio.detach() + (logp - logp.detach())
        adv = advantages
    else:
        log_s = seq_log_ratio.expand_as(logp)
        adv = (masked_sum(advantages, mask, axis=-1).unsqueeze(-1) / length).expand_as(logp)
    ratio = torch.exp(torch.clamp(log_s, min=-20.0, max=20.0))
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    stats = {"clipfrac": masked_mean((loss2 > loss1).float(), mask).detach(),
             "approx_kl": masked_mean(-_log_ratio(logp, old_logp), mask).detach(),
             "seq_ratio_mean": masked_mean(ratio.detach(), mask)}
    return torch.maximum(loss1, loss2), stats


def cispo_tokens(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                 clip_ratio_low: float, clip_ratio_high: float) -> Tokens:
    """CISPO: ``-sg(clip(r, 1-low, 1+high)) * A * logp``. The paper sets no lower bound
    (``clip_ratio_low: 1.0``) and a wide upper one."""
    mask = response_mask.to(logp.dtype)
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    clipped = (ratio < 1.0 - clip_ratio_low) | (ratio > 1.0 + clip_ratio_high)
    stats = {"clipfrac": masked_mean(clipped.float(), mask).detach(),
             "approx_kl": masked_mean(-log_ratio, mask).detach()}
    return -weight * advantages * logp, stats


def sapo_tokens(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                tau_pos: float, tau_neg: float) -> Tokens:
    """SAPO: ``-A * 4/tau * sigmoid(tau (r - 1))``; its gradient is the vanilla one, ``-A r grad logp``,
    times the gate ``4 sigmoid(1 - sigmoid)`` (1 on-policy, fading smoothly off-policy)."""
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    mask = response_mask.to(logp.dtype)
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    # the temperatures in the log-probs' dtype (a Python float in where() would be float32)
    tau = torch.where(advantages > 0, logp.new_tensor(tau_pos), logp.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    stats = {"sapo_gate": masked_mean((4.0 * gate * (1.0 - gate)).detach(), mask),
             "approx_kl": masked_mean(-log_ratio, mask).detach()}
    return -advantages * gate * 4.0 / tau, stats


def policy_loss_tokens(a: ActorConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor) -> Tokens:
    """The per-token loss of ``a.policy_loss`` with the actor section's settings."""
    name = a.policy_loss
    if name == "vanilla":
        return ppo_clip_tokens(logp, old_logp, advantages, response_mask, a.clip_ratio_low, a.clip_ratio_high,
                               a.clip_ratio_c)
    if name in ("gspo", "gspo_token"):
        return gspo_tokens(logp, old_logp, advantages, response_mask, a.clip_ratio_low, a.clip_ratio_high,
                           token_level=name == "gspo_token")
    if name == "cispo":
        return cispo_tokens(logp, old_logp, advantages, response_mask, a.clip_ratio_low, a.clip_ratio_high)
    if name == "sapo":
        return sapo_tokens(logp, old_logp, advantages, response_mask, a.sapo_tau_pos, a.sapo_tau_neg)
    raise ValueError(f"actor.policy_loss must be one of {POLICY_LOSSES}, got {name!r}")
