"""The preference losses beside DPO's (``loss_terms.dpo_loss``), as small pure functions over per-sequence
log-probs ``[B]``. Each returns the mean loss over its examples and detached statistics.

    ipo     Azar et al. 2023         DPO's ``ipo`` on *averaged* (per-token) log-probs: (m - 1/(2 beta))^2
    simpo   Meng et al. 2024, eq. 6  -log sig(beta (a_c - a_r) - gamma), averaged log-probs, no reference
    cpo     Xu et al. 2024, eq. 3    -log sig(beta (s_c - s_r)), summed log-probs, no reference (+ alpha NLL)
    orpo    Hong et al. 2024, eq. 6  -lambda log sig(log odds(a_c) - log odds(a_r)), odds(a) = p / (1 - p), p = e^a
    kto     Ethayarajh et al. 2024   lambda_D (1 - sig(beta (r - z0))) desirable, lambda_U (1 - sig(beta (z0 - r)))
                                     undesirable, r the summed log-ratio to the reference, z0 = max(0, KL estimate)

``a`` is a sequence's mean token log-prob, ``s`` its sum. The NLL terms of CPO / ORPO (the chosen
responses' token-mean NLL) are added by the caller, which sees every micro-batch's tokens
(``reference_free.py``). ``label_smoothing`` (conservative DPO's eps, which TRL's CPO trainer takes for
``simpo`` and ``cpo``) mixes in eps times the loss of the flipped preference.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

Stats = Dict[str, torch.Tensor]


def _smoothed_logsigmoid(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - eps) log sig(z) - eps log sig(-z): conservative DPO's label smoothing."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _pair_stats(chosen_reward: torch.Tensor, rejected_reward: torch.Tensor) -> Stats:
    c, r = chosen_reward.detach(), rejected_reward.detach()
    return {"reward_margin": (c - r).mean(), "reward_accuracy": (c > r).float().mean(),
            "chosen_reward": c.mean(), "rejected_reward": r.mean()}


def simpo_loss(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float = 2.0, gamma: float = 0.5,
               label_smoothing: float = 0.0) -> Tuple[torch.Tensor, Stats]:
    """SimPO over the mean token log-probs ``[B]`` of chosen and rejected; ``gamma`` the target reward
    margin (the reward is beta times the mean log-prob)."""
    losses = _smoothed_logsigmoid(beta * (chosen_avg - rejected_avg) - gamma, label_smoothing)
    return losses.mean(), _pair_stats(beta * chosen_avg, beta * rejected_avg)


def cpo_loss(chosen_sum: torch.Tensor, rejected_sum: torch.Tensor, beta: float = 0.1,
             label_smoothing: float = 0.0) -> Tuple[torch.Tensor, Stats]:
    """CPO's preference term over the summed log-probs ``[B]`` (DPO's sigmoid loss with the reference
    dropped); the caller adds ``cpo_alpha`` times the chosen responses' NLL."""
    losses = _smoothed_logsigmoid(beta * (chosen_sum - rejected_sum), label_smoothing)
    return losses.mean(), _pair_stats(beta * chosen_sum, beta * rejected_sum)


def log_odds(avg_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(avg_logp), avg_logp < 0."""
    # log(1 - e^a) as log(-expm1(a)): 1 - exp(a) loses every digit as a -> 0; a is kept at most -1e-7
    # (p < 1: a sequence the model is certain of has infinite odds)
    a = avg_logp.clamp(max=-1e-7)
    return a - torch.log(-torch.expm1(a))


def orpo_loss(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float = 0.1) -> Tuple[torch.Tensor, Stats]:
    """ORPO's odds-ratio term over the mean token log-probs ``[B]``, weighted by ``beta`` (the paper's
    lambda); the caller adds the chosen responses' NLL."""
    ratio = F.logsigmoid(log_odds(chosen_avg) - log_odds(rejected_avg))
    stats = _pair_stats(beta * chosen_avg, beta * rejected_avg)
    stats["log_odds_ratio"] = ratio.detach().mean()
    return -beta * ratio.mean(), stats


def ipo_loss(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, ref_chosen_avg: torch.Tensor,
             ref_rejected_avg: torch.Tensor, beta: float = 0.1) -> Tuple[torch.Tensor, Stats]:
    """IPO over the mean token log-probs ``[B]`` of policy and reference (the length normalisation the
    IPO paper's token-level regulariser implies and TRL applies)."""
    c, r = chosen_avg - ref_chosen_avg, rejected_avg - ref_rejected_avg
    losses = (c - r - 1.0 / (2.0 * beta)).square()
    return losses.mean(), _pair_stats(beta * c, beta * r)


def kto_loss(policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
             beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> Tuple[torch.Tensor, Stats]:
    """KTO over the summed log-probs ``[B]`` of unpaired completions under the policy and the
    reference, ``desirable`` ``[B]`` bool their labels, ``kl`` the reference point's KL estimate (a
    scalar: the mean log-ratio of mismatched prompt / completion pairs, the caller's; clamped at 0 and
    detached here, as the paper holds it constant)."""
    z0 = kl.detach().clamp(min=0)
    r = policy - reference
    desirable = desirable.bool()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))
    rewards = beta * r.detach()
    d, u = desirable.float(), (~desirable).float()
    stats = {"kl": z0, "chosen_reward": (rewards * d).sum() / d.sum().clamp(min=1),
             "rejected_reward": (rewards * u).sum() / u.sum().clamp(min=1)}
    return losses.mean(), stats
