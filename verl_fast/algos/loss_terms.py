"""The terms of the RL losses as small pure functions over token tensors ``[B, L]``, as verl defines them:
aggregation (``agg_loss``), KL estimators, PPO-clip policy loss, clipped value loss, entropy. The
preference losses (DPO's and its family) are in ``preference_losses.py``, the policy losses by name in
``policy_losses.py``.

Each takes per-token tensors and a ``response_mask`` and returns a scalar (via ``agg_loss``) plus
the statistics the trainer logs. No state, no config objects: the trainer picks the variant once.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from verl_fast.ops.masked import masked_mean, masked_sum

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k1+", "k2+", "k3+", "low_var_kl+", "abs+")


def agg_loss(loss_mat: torch.Tensor, response_mask: torch.Tensor, mode: str = "token-mean",
             norm_length: int = 0, num_tokens: Optional[float] = None,
             num_seqs: Optional[float] = None, dp_size: int = 1) -> torch.Tensor:
    """Aggregates a ``[B, L]`` per-token loss into a scalar.

    token-mean: mean over all response tokens of the batch; token-sum: their sum;
    seq-mean-token-sum: per-sequence sum, mean over sequences; seq-mean-token-mean: per-sequence
    mean, mean over sequences; seq-mean-token-sum-norm: per-sequence sum divided by a constant length
    (``norm_length``, default the padded L), mean over sequences (Dr.GRPO's normalisation, which does
    not depend on lengths). The seq-mean modes count only the rows with at least one response token:
    an all-padding row changes nothing.

    ``num_tokens`` / ``num_seqs`` / ``dp_size``: the whole (mini-)batch's normalisers when this is
    one micro-batch of it (trainer/batching.py's ``loss_normalisers`` says what they count and why
    the micro-batch losses then add up to the batch's loss).
    """
    mask = response_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if num_tokens is None:
            return masked_mean(loss_mat, mask)
        return masked_sum(loss_mat, mask) / max(float(num_tokens), 1.0)
    if mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size
    seq_sum = masked_sum(loss_mat, mask, axis=-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / (mask.sum(-1) + 1e-8)  # an all-padding row gives 0 / 1e-8 = 0
    elif mode == "seq-mean-token-sum-norm":
        per_seq = seq_sum / float(norm_length or loss_mat.shape[-1])
    else:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    # all-padding rows contribute 0 to the sum; leave them out of the count too
    if num_seqs is None:
        return per_seq.sum() / active_rows(mask).clamp(min=1).to(per_seq.dtype)
    return per_seq.sum() / max(float(num_seqs), 1.0)


def active_rows(response_mask: torch.Tensor) -> torch.Tensor:
    """Rows of a ``[B, L]`` mask with at least one response token (the seq-mean modes' count), as a
    0-d int64 tensor on the mask's device."""
    return (response_mask != 0).any(-1).sum()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference from sampled-token log-probs.

    k1 (kl): logp - ref; abs: |logp - ref|; k2 (mse): 0.5 (logp - ref)^2; k3 (low_var_kl):
    exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10] as verl does. A trailing ``+`` is the
    straight-through form: the named estimator's value with k2's gradient (k1 and k3 are unbiased
    in value but not in gradient; k2's gradient is the right one).
    """
    if kind.endswith("+"):
        base = kind[:-1]
        value = kl_penalty(logp, ref_logp, base)
        k2 = kl_penalty(logp, ref_logp, "k2")
        # k2 - k2.detach() is exactly 0 in value: adding it last keeps the named value bit for bit
        return value.detach() + (k2 - k2.detach())
    diff = logp - ref_logp
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        # exp() of a large log-ratio overflows: clamp the exponent, then the estimate (verl's choice).
        neg = torch.clamp(-diff, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    **counts,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping and dual clip (``ppo_clip_tokens``), aggregated
    with ``loss_agg_mode``. Returns the loss and ``{clipfrac, clipfrac_lower, approx_kl}``
    (detached). ``counts``: ``num_tokens`` / ``num_seqs`` of the whole batch when this is a
    micro-batch of it (see ``agg_loss``)."""
    per_token, stats = ppo_clip_tokens(logp, old_logp, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                                       clip_ratio_c)
    return agg_loss(per_token, response_mask.to(per_token.dtype), loss_agg_mode, **counts), stats


def ppo_clip_tokens(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                    clip_ratio_c: float = 3.0) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The per-token PPO-clip loss ``[B, L]`` before aggregation, and its statistics.

    ratio = exp(clamp(logp - old_logp, -20, 20)); loss = max(-A r, -A clip(r, 1-low, 1+high));
    for A < 0 the loss is further capped at -A c (dual clip, c > 1).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    per_token = torch.where(advantages < 0, dual, clipped)
    mask = response_mask.to(per_token.dtype)
    stats = {
        "clipfrac": masked_mean((loss2 > loss1).float(), mask).detach(),
        "clipfrac_lower": masked_mean(((clipped > loss3) & (advantages < 0)).float(), mask).detach(),
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return per_token, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               response_mask: torch.Tensor, cliprange_value: float = 0.5,
               loss_agg_mode: str = "token-mean", **counts) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    l1 = (values - returns).square()
    l2 = (clipped - returns).square()
    per_token = 0.5 * torch.maximum(l1, l2)
    mask = response_mask.to(per_token.dtype)
    return agg_loss(per_token, mask, loss_agg_mode, **counts), {"vf_clipfrac": masked_mean((l2 > l1).float(), mask).detach()}


def entropy_loss(entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                 **counts) -> torch.Tensor:
    """Mean entropy of the response tokens (subtracted, times a coefficient, for an entropy bonus)."""
    return agg_loss(entropy, response_mask, loss_agg_mode, **counts)
