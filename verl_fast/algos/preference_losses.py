"""The preference losses, as small pure functions over per-sequence log-probs ``[B]``: DPO's loss types
by name (``dpo_loss``; ``algorithm.loss_type``'s choices are the names under ``@register_dpo_loss``), and
the losses beside DPO's. Each returns the mean loss over its examples and detached statistics.

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

import math
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F

from verl_fast import config

Stats = Dict[str, torch.Tensor]
# a DPO loss type: the per-pair losses [B] from the chosen and rejected log-ratios c, r [B], beta, the
# label smoothing eps and DiscoPOP's tau
PairLoss = Callable[[torch.Tensor, torch.Tensor, float, float, float], torch.Tensor]
_DPO: Dict[str, PairLoss] = {}


def register_dpo_loss(name: str) -> Callable[[PairLoss], PairLoss]:
    """Registers the decorated function as ``algorithm.loss_type: name``."""
    def add(loss: PairLoss) -> PairLoss:
        _DPO[name] = loss
        config.DPO_LOSSES.register(name)
        return loss
    return add


def dpo_loss_fn(name: str) -> PairLoss:
    """The DPO loss type registered as ``name``; one line naming the choices otherwise."""
    loss = _DPO.get(name)
    if loss is None:
        raise ValueError(f"dpo loss_type must be one of {tuple(_DPO)}, got {name!r}")
    return loss


def dpo_loss_names() -> Tuple[str, ...]:
    """``algorithm.loss_type``'s choices: the registered DPO loss types."""
    return tuple(_DPO)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, discopop_tau: float = 0.05) -> Tuple[torch.Tensor, Stats]:
    """DPO over summed sequence log-probs ``[B]``, the mean over pairs, with the log-ratios
    c = pi_c - ref_c, r = pi_r - ref_r and the margin m = c - r (pass zeros as ref for reference-free DPO);
    ``loss_type`` names one of the losses below."""
    c = policy_chosen - ref_chosen
    r = policy_rejected - ref_rejected
    losses = dpo_loss_fn(loss_type)(c, r, beta, label_smoothing, discopop_tau)
    chosen_reward = beta * c.detach()
    rejected_reward = beta * r.detach()
    stats = {
        "reward_margin": (chosen_reward - rejected_reward).mean(),
        "reward_accuracy": (chosen_reward > rejected_reward).float().mean(),
    }
    return losses.mean(), stats


@register_dpo_loss("sigmoid")
def _sigmoid(c, r, beta, eps, tau):
    """Rafailov et al.: -log sig(beta m), with conservative label smoothing eps: -(1-eps) log sig(beta m) -
    eps log sig(-beta m)."""
    z = beta * (c - r)
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


@register_dpo_loss("ipo")
def _ipo(c, r, beta, eps, tau):
    """Azar et al.: (m - 1/(2 beta))^2."""
    return ((c - r) - 1.0 / (2.0 * beta)).square()


@register_dpo_loss("hinge")
def _hinge(c, r, beta, eps, tau):
    """SLiC: relu(1 - beta m)."""
    return torch.relu(1.0 - beta * (c - r))


@register_dpo_loss("robust")
def _robust(c, r, beta, eps, tau):
    """Chowdhury et al., rDPO: (-(1-eps) log sig(beta m) + eps log sig(-beta m)) / (1 - 2 eps), eps < 0.5."""
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"dpo loss_type robust needs 0 <= label_smoothing < 0.5, got {eps}")
    z = beta * (c - r)
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


@register_dpo_loss("exo_pair")
def _exo_pair(c, r, beta, eps, tau):
    """Ji et al., EXO: KL(q || p) with q = (sig(beta m), sig(-beta m)), p = (1-eps, eps), eps > 0."""
    if not 0.0 < eps < 1.0:
        raise ValueError(f"dpo loss_type exo_pair needs 0 < label_smoothing < 1 (its target (1-eps, eps) "
                         f"has no log at 0), got {eps}")
    z = beta * (c - r)
    return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))


@register_dpo_loss("nca_pair")
def _nca_pair(c, r, beta, eps, tau):
    """Chen et al., NCA: -log sig(beta c) - 0.5 log sig(-beta c) - 0.5 log sig(-beta r)."""
    return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)


@register_dpo_loss("bco_pair")
def _bco_pair(c, r, beta, eps, tau):
    """Jung et al., BCO: -log sig(beta c) - log sig(-beta r) (no reward shift, as TRL 1.16)."""
    return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)


@register_dpo_loss("sppo_hard")
def _sppo_hard(c, r, beta, eps, tau):
    """Wu et al., SPPO with hard labels: (c - 1/(2 beta))^2 + (r + 1/(2 beta))^2."""
    return (c - 0.5 / beta).square() + (r + 0.5 / beta).square()


@register_dpo_loss("apo_zero")
def _apo_zero(c, r, beta, eps, tau):
    """D'Oosterlinck et al., APO eq. 7: (1 - sig(beta c)) + sig(beta r)."""
    return (1 - torch.sigmoid(beta * c)) + torch.sigmoid(beta * r)


@register_dpo_loss("apo_down")
def _apo_down(c, r, beta, eps, tau):
    """APO eq. 8: sig(beta c) + (1 - sig(beta m))."""
    return torch.sigmoid(beta * c) + (1 - torch.sigmoid(beta * (c - r)))


@register_dpo_loss("discopop")
def _discopop(c, r, beta, eps, tau):
    """Chris Lu et al., DiscoPOP eq. 5: with rho = beta m and w = sig(rho / tau), (1 - w) (-log sig(rho)) +
    w exp(-rho)."""
    if tau <= 0:
        raise ValueError(f"dpo loss_type discopop needs discopop_tau > 0, got {tau}")
    z = beta * (c - r)
    # w exp(-rho) as exp(log w - rho): exp(-rho) alone overflows for a large negative margin where w is 0
    return -(1 - torch.sigmoid(z / tau)) * F.logsigmoid(z) + torch.exp(F.logsigmoid(z / tau) - z)


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
