"""The actor's loss: the policy losses ``actor.policy_loss`` picks by name, as per-token losses ``[B, L]``
before aggregation, and ``actor_loss``, the loss of one micro-batch that every training backend (HF /
FSDP and Megatron) takes: the policy loss aggregated with ``actor.loss_agg_mode`` after any rollout
correction, minus the entropy bonus, plus the KL loss.

A policy loss is a function ``(actor config, logp, old_logp, advantages, response_mask) -> (per_token,
stats)`` under ``@register_policy_loss("name")``; ``actor.policy_loss``'s choices are the registered names.

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

from typing import Callable, Dict, Optional, Tuple

import torch

from verl_fast import config
from verl_fast.algos.loss_terms import agg_loss, entropy_loss, kl_penalty, ppo_clip_tokens
from verl_fast.algos.rollout_correction import truncated_is_weights
from verl_fast.config import ActorConfig
from verl_fast.ops.masked import masked_mean, masked_sum
from verl_fast.records.experience import Experience

SYNC_GAP = "guardrails/sync_logprob_diff"  # mean |actor - engine| log-prob per response token

Tokens = Tuple[torch.Tensor, Dict[str, torch.Tensor]]
PolicyLoss = Callable[[ActorConfig, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Tokens]
_LOSSES: Dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Registers the decorated function as ``actor.policy_loss: name``."""
    def add(loss: PolicyLoss) -> PolicyLoss:
        _LOSSES[name] = loss
        config.POLICY_LOSSES.register(name)
        return loss
    return add


def policy_loss_names() -> Tuple[str, ...]:
    """``actor.policy_loss``'s choices: the registered policy losses."""
    return tuple(_LOSSES)


def policy_loss_fn(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; one line naming the choices otherwise."""
    loss = _LOSSES.get(name)
    if loss is None:
        raise ValueError(f"actor.policy_loss must be one of {list(_LOSSES)}, got {name!r}")
    return loss


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


@register_policy_loss("vanilla")
def _vanilla(a: ActorConfig, logp, old_logp, advantages, response_mask) -> Tokens:
    return ppo_clip_tokens(logp, old_logp, advantages, response_mask, a.clip_ratio_low, a.clip_ratio_high,
                           a.clip_ratio_c)


@register_policy_loss("gspo")
def _gspo(a: ActorConfig, logp, old_logp, advantages, response_mask) -> Tokens:
    return gspo_tokens(logp, old_logp, advantages, response_mask, a.clip_ratio_low, a.clip_ratio_high)


@register_policy_loss("gspo_token")
def _gspo_token(a: ActorConfig, logp, old_logp, advantages, response_mask) -> Tokens:
    return gspo_tokens(logp, old_logp, advantages, response_mask, a.clip_ratio_low, a.clip_ratio_high,
                       token_level=True)


@register_policy_loss("cispo")
def _cispo(a: ActorConfig, logp, old_logp, advantages, response_mask) -> Tokens:
    return cispo_tokens(logp, old_logp, advantages, response_mask, a.clip_ratio_low, a.clip_ratio_high)


@register_policy_loss("sapo")
def _sapo(a: ActorConfig, logp, old_logp, advantages, response_mask) -> Tokens:
    return sapo_tokens(logp, old_logp, advantages, response_mask, a.sapo_tau_pos, a.sapo_tau_neg)


def policy_loss_tokens(a: ActorConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor) -> Tokens:
    """The per-token loss of ``a.policy_loss`` with the actor section's settings."""
    return policy_loss_fn(a.policy_loss)(a, logp, old_logp, advantages, response_mask)


def actor_loss(a, logp: torch.Tensor, entropy: torch.Tensor, sub: Experience, counts: Dict[str, float],
               correction_cap: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """``a``: the actor config. ``logp`` / ``entropy`` [n, L] of the micro-batch ``sub``; ``counts``:
    the mini-batch's normalisers; ``correction_cap``: the rollout correction's weights are taken from
    this forward (no old-log-prob pass ran), capped there. Returns this micro-batch's share of the
    mini-batch loss and its statistics at the scale of a whole batch (callers average micro-batches
    weighted by tokens, and take the largest of a ``*_max``), as 0-d tensors: reading them here would
    stall the host until the GPU finished this forward, before it could queue the backward (callers
    read them once the update is queued)."""
    logp = logp.float()
    old = sub.old_logprobs if sub.old_logprobs is not None else logp.detach()
    per_token, stats = policy_loss_tokens(a, logp, old, sub.advantages, sub.response_mask)
    weights = sub.rollout_is_weights  # algorithm.rollout_correction (rollout_correction.py)
    if correction_cap is not None:
        weights, spread = truncated_is_weights(old, sub.rollout_logprobs, sub.response_mask, correction_cap)
        stats.update({f"rollout_correction/{k}": v for k, v in spread.items()})
    if sub.old_logprobs is None and sub.rollout_logprobs is not None:  # this forward is the policy the engine
        # should have sampled from: the sync guardrail's measure, free here (trainer/guardrails.py)
        stats[SYNC_GAP] = masked_mean((old - sub.rollout_logprobs.float()).abs(), sub.response_mask.float())
    if weights is not None:
        per_token = per_token * weights
    pg = agg_loss(per_token, sub.response_mask, a.loss_agg_mode, **counts)
    loss = pg
    ent = entropy_loss(entropy.float(), sub.response_mask, a.loss_agg_mode, **counts)
    if a.entropy_coeff:
        loss = loss - a.entropy_coeff * ent
    out = {"pg_loss": pg.detach(), "entropy": ent.detach(),
           **{k: torch.as_tensor(v).detach() for k, v in stats.items()}}
    if sub.ref_logprobs is not None:
        kl = kl_penalty(logp, sub.ref_logprobs, a.kl_loss_type if a.use_kl_loss else "low_var_kl")
        kl_term = agg_loss(kl, sub.response_mask, a.loss_agg_mode, **counts)
        if a.use_kl_loss:
            loss = loss + a.kl_loss_coef * kl_term
        out["kl"] = kl_term.detach()
    # the trainer averages micro-batch statistics weighted by their response tokens: scaling this
    # micro-batch's share of the loss by the inverse of its token share makes that average the sum of
    # the shares (the mini-batch's loss) whatever the aggregation mode
    share = sub.response_mask.sum() / max(counts["num_tokens"], 1.0)
    for k in ("pg_loss", "entropy", "kl"):
        if k in out:
            out[k] = out[k] / share.clamp(min=1e-9)
    return loss, out
