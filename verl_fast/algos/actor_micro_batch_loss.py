"""The actor's loss on one micro-batch, shared by every training backend (HF / FSDP and Megatron)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from verl_fast.algos.loss_terms import agg_loss, entropy_loss, kl_penalty
from verl_fast.algos.policy_loss_variants import policy_loss_tokens
from verl_fast.algos.rollout_correction import truncated_is_weights
from verl_fast.ops.masked import masked_mean
from verl_fast.rollout.experience import Experience

SYNC_GAP = "guardrails/sync_logprob_diff"  # mean |actor - engine| log-prob per response token


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
