"""The phases every policy-gradient algorithm shares (``Step.POLICY_GRADIENT``, see ``algorithm.py``);
a module per algorithm (``grpo``, ``rloo``, ``reinforce_pp``, ``remax``, ``ppo``) declares a
``PolicyGradientSpec``: its estimator call, whether the estimator whitens over the batch, whether its
baseline is the prompt's other samples, its critic loss, its extra rollout.

- Rewards: the outcome reward on each response's last token (the trainer puts it there), plus
  DAPO's overlong penalty with ``algorithm.overlong_buffer`` (``dapo.py``); with
  ``algorithm.use_kl_in_reward`` the per-token ``kl_penalty(old, ref)`` times ``kl_coef`` is
  subtracted (``shape_rewards``), which needs the old log-probs.
- Whitening scope: an estimator that whitens its advantages over the batch does so over every
  data-parallel rank's response tokens when there are several (``whiten_over_ranks``: what one
  process whitening the whole batch computes); group estimators never whiten.
- Rows and weights: DAPO's dynamic sampling (``algorithm.dynamic_sampling``, ``dapo.DynamicSampling``)
  chooses the groups the update trains on (``select_experience``); the rollout correction
  (``algorithm.rollout_correction``, ``rollout_correction.RolloutCorrection``) weighs each token
  (``correct_rollout``). Each is built here from the config, or is absent.
- Loss: ``actor.policy_loss`` (PPO-clip, GSPO, CISPO, SAPO: ``policy_losses.py``) with the actor
  section's clipping, aggregation, entropy bonus and KL-in-loss (``policy_losses.actor_loss``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from verl_fast import distributed
from verl_fast.algos.policy_losses import actor_loss
from verl_fast.algos.dapo import DynamicSampling, overlong_penalty
from verl_fast.algos.algorithm import MorePrompts, Score, Stats, Step, kl_reference, refuse_pairwise_ranking
from verl_fast.algos.loss_terms import kl_penalty
from verl_fast.algos.rollout_correction import RolloutCorrection
from verl_fast.config import AlgorithmConfig, Config
from verl_fast.data import RLDataProcessor
from verl_fast.records.prompts import PromptRow
from verl_fast.records.experience import Experience, last_token_rewards
from verl_fast.records.generation import Generate, GenerationOutput

# estimate(exp, baselines [N] or None, the algorithm section, whiten) -> (advantages [N, L], returns [N, L])
Estimate = Callable[[Experience, Optional[torch.Tensor], AlgorithmConfig, bool], Tuple[torch.Tensor, torch.Tensor]]
# critic_loss(values [n, L], micro-batch, the mini-batch's normalisers, N of the batch, config) -> (loss, stats)
CriticLoss = Callable[[torch.Tensor, Experience, Dict[str, float], int, Config], Tuple[torch.Tensor, Stats]]


class NoBaseline:
    """No extra rollout, no baseline beside the estimator's own."""

    def rollout(self, generate: Generate, batch: Sequence[PromptRow]) -> Optional[GenerationOutput]:
        return None

    def of(self, batch: Sequence[PromptRow], extra: Optional[GenerationOutput], score: Score, exp: Experience,
           metrics: Dict[str, Any]) -> Optional[torch.Tensor]:
        return None


@dataclass(frozen=True)
class PolicyGradientSpec:
    """One policy-gradient algorithm, as ``registry.py`` lists it."""

    name: str
    estimate: Estimate
    whitened: bool = False  # the estimator whitens its advantages over the batch
    group_baseline: bool = False  # the baseline is the other samples of the same prompt
    critic_loss: Optional[CriticLoss] = None  # trains a critic (values for the estimator) with this loss
    baseline: Any = NoBaseline()  # an extra rollout and the baselines it gives (ReMax)

    # what the run's assembly asks of an algorithm before building it (``registry.spec``)
    item_type = PromptRow
    samples = True

    @property
    def needs_critic(self) -> bool:
        return self.critic_loss is not None

    def check(self, cfg: Config) -> None:
        if self.group_baseline and cfg.rollout.n < 2:
            raise ValueError(f"algorithm.type={self.name} is not supported with rollout.n={cfg.rollout.n}: its "
                             "baseline is the other samples of the same prompt; use rollout.n >= 2")
        refuse_pairwise_ranking(cfg)
        if cfg.algorithm.dynamic_sampling and not self.group_baseline:
            raise ValueError(f"algorithm.dynamic_sampling is not supported with algorithm.type={self.name}: it drops "
                             "prompts whose samples all score the same, which only a group baseline makes "
                             "uninformative; use grpo, drgrpo, rloo or reinforce_pp_baseline")

    def build(self, cfg: Config) -> "PolicyGradient":
        return PolicyGradient(self, cfg)


class PolicyGradient:
    """The ``PolicyGradientAlgorithm`` phases of ``spec`` under ``cfg``."""

    step = Step.POLICY_GRADIENT
    item_type = PromptRow
    samples = True

    def __init__(self, spec: PolicyGradientSpec, cfg: Config):
        self.spec, self.cfg = spec, cfg
        self.name = spec.name
        self.needs_critic = spec.critic_loss is not None
        self.needs_reference = kl_reference(cfg)
        a = cfg.actor
        self.zero_advantage_is_idle = a.skip_zero_advantage and not a.use_kl_loss and a.entropy_coeff == 0
        alg = cfg.algorithm
        self.sampling = (DynamicSampling(cfg.trainer.train_batch_size, alg.max_extra_draws, cfg.trainer.seed)
                         if alg.dynamic_sampling else None)
        self.correction = RolloutCorrection(alg.rollout_correction_cap) if alg.rollout_correction else None
        self.scores_decide_rows = self.sampling is not None

    def configure(self, world: int) -> None:
        if self.sampling is not None and world > 1:
            raise ValueError("algorithm.dynamic_sampling is not supported with several processes yet (ranks would "
                             "keep different numbers of groups); use one process")

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[PromptRow]:
        return processor.encode_all(rows)

    def extra_rollout(self, generate: Generate, batch: Sequence[PromptRow]) -> Optional[GenerationOutput]:
        return self.spec.baseline.rollout(generate, batch)

    def reward_baselines(self, batch: Sequence[PromptRow], extra: Optional[GenerationOutput], score: Score,
                         exp: Experience, metrics: Dict[str, Any]) -> Optional[torch.Tensor]:
        return self.spec.baseline.of(batch, extra, score, exp, metrics)

    def select_experience(self, exp: Experience, more: MorePrompts, metrics: Dict[str, Any]) -> Experience:
        """DAPO's informative groups, topped up from ``more`` (with dynamic sampling); else all of ``exp``."""
        return exp if self.sampling is None else self.sampling.select(exp, more, metrics)

    def needs_old_logprobs(self, exp: Experience) -> bool:
        """Old log-probs are the current ones unless the actor moves before the last mini-batch, or
        the KL in the reward reads them (the rollout correction then reads the update's forward)."""
        a, n = self.cfg.actor, exp.num_sequences
        return a.ppo_epochs > 1 or (a.ppo_mini_batch_size or n) < n or self.cfg.algorithm.use_kl_in_reward

    def correct_rollout(self, exp: Experience, metrics: Dict[str, Any], engine: str) -> None:
        """The rollout correction's weights (with ``algorithm.rollout_correction``); else nothing."""
        if self.correction is not None:
            self.correction.weigh(exp, metrics, engine)

    def shape_rewards(self, exp: Experience, metrics: Dict[str, Any]) -> None:
        alg = self.cfg.algorithm
        if alg.overlong_buffer:  # DAPO's soft overlong punishment, on the outcome's (last) token
            penalty = overlong_penalty(exp.response_mask.sum(-1), self.cfg.rollout.max_new_tokens, alg.overlong_buffer,
                                       alg.overlong_penalty_factor).to(exp.token_level_rewards.device)
            exp.token_level_rewards = exp.token_level_rewards + last_token_rewards(penalty, exp.response_mask)
            metrics["reward/overlong_penalty"] = float(penalty.mean())
        if not alg.use_kl_in_reward:
            return
        kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, alg.kl_penalty) * exp.response_mask
        exp.token_level_rewards = exp.token_level_rewards - alg.kl_coef * kl
        metrics["reward/kl_penalty"] = float((kl.sum() / exp.response_mask.sum().clamp(min=1)).item())

    def advantages(self, exp: Experience, baselines: Optional[torch.Tensor],
                   group: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """``group``: the data-parallel ranks (None in one process)."""
        over_ranks = group is not None and self.spec.whitened
        advantages, returns = self.spec.estimate(exp, baselines, self.cfg.algorithm, not over_ranks)
        if over_ranks:
            advantages = whiten_over_ranks(advantages, exp.response_mask, group)
        return advantages, returns

    def actor_loss(self, logp: torch.Tensor, entropy: torch.Tensor, sub: Experience,
                   counts: Dict[str, float]) -> Tuple[torch.Tensor, Stats]:
        # the rollout correction's weights from this forward where no old-log-prob pass ran (correct_rollout)
        cap = self.correction.cap if self.correction is not None and sub.rollout_is_weights is None else None
        return actor_loss(self.cfg.actor, logp, entropy, sub, counts, correction_cap=cap)

    def critic_loss(self, values: torch.Tensor, sub: Experience, counts: Dict[str, float],
                    num_sequences: int) -> Tuple[torch.Tensor, Stats]:
        return self.spec.critic_loss(values, sub, counts, num_sequences, self.cfg)


def whiten_over_ranks(values: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """``values`` whitened with the masked mean and unbiased variance of every rank's tokens (what
    one process whitening the whole batch computes), ``(v - mean) * rsqrt(var + 1e-8)``; zero where
    ``mask`` is 0 (no loss reads those positions)."""
    m = mask.to(torch.float64)
    v = values.to(torch.float64) * m
    n, s, s2 = distributed.all_reduce_numbers([float(m.sum()), float(v.sum()), float((v * v).sum())], group=group)
    if n < 2:
        raise ValueError(f"whitening needs at least 2 response tokens over all ranks, got {int(n)}")
    mean = s / n
    var = max((s2 - s * mean) / (n - 1), 0.0)
    return ((values - mean) * (var + 1e-8) ** -0.5 * mask).to(values.dtype)
