"""DPO (Rafailov et al.) on the dataset's chosen / rejected pairs (``Step.PREFERENCE``, no rollout): the
summed response log-probs of chosen and rejected under the actor and the reference (none with
``reward_fn.reference_free``; ``ipo`` takes their per-token means, as Azar et al.'s authors and TRL
do), the DPO loss (``algorithm.loss_type``: sigmoid, ipo, hinge, robust, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop (``preference_losses.dpo_loss``), with ``beta`` and
``label_smoothing``) plus ``algorithm.sft_weight`` times the chosen responses' mean token NLL (RPO),
through the strategy's ``forward_backward`` (``pair_rows.py``: every training backend), one optimiser
step per batch. Log-probs are taken at ``rollout.temperature`` (1 unless set), as every pass of the actor.

Batching: a forward/backward takes ``trainer.per_device_train_batch_size`` pairs (else half of
``actor.micro_batch_size``: a pair is two sequences); with ``trainer.gradient_accumulation_steps``
an optimiser step sees that many micro-batches on every process, i.e. ``per_device_train_batch_size
x gradient_accumulation_steps x processes`` pairs (else ``trainer.train_batch_size`` pairs).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import torch

from verl_fast.algos import pair_rows
from verl_fast.algos.algorithm import Step, kl_reference
from verl_fast.algos.preference_losses import dpo_loss, ipo_loss
from verl_fast.config import Config, CriticConfig
from verl_fast.data import RLDataProcessor
from verl_fast.records.prompts import PreferencePair
from verl_fast.records.experience import Experience


class DPO:
    """The ``PreferenceAlgorithm`` of offline DPO (``algorithm.py``)."""

    name = "dpo"
    step = Step.PREFERENCE
    item_type = PreferencePair
    samples = False
    needs_critic = False

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.needs_reference = needs_reference(cfg)

    @staticmethod
    def check(cfg: Config) -> None:
        if cfg.reward_fn.type not in ("auto", "pairwise_ranking"):  # auto: no reward entry, nothing scored
            raise ValueError(f"algorithm.type={cfg.algorithm.type} is not supported with reward_fn.type={cfg.reward_fn.type}; "
                             "leave reward_fn out (DPO learns from chosen/rejected pairs)")
        check_loss(cfg)

    @classmethod
    def build(cls, cfg: Config) -> "DPO":
        return cls(cfg)

    def configure(self, world: int) -> None:
        """Says which settings do not apply, and sizes the step from ``gradient_accumulation_steps``
        (module docstring)."""
        cfg = self.cfg
        warn_unused_critic(cfg)
        if cfg.trainer.gradient_accumulation_steps:
            cfg.trainer.train_batch_size = pairs_per_micro_batch(cfg) * cfg.trainer.gradient_accumulation_steps * world

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[PreferencePair]:
        return processor.build_dpo_dataset(rows)

    def pairs(self, batch: List[PreferencePair], generate: Any, score: Any, metrics: Dict[str, Any]) -> List[PreferencePair]:
        return batch

    def update(self, updates: Any, pairs: List[PreferencePair], pad_id: int) -> Dict[str, float]:
        return step(updates, pairs, pad_id, self.cfg.algorithm, pairs_per_micro_batch(self.cfg))


def needs_reference(cfg: Config) -> bool:
    """DPO's reference: the loss reads it unless ``reward_fn.reference_free`` (and a KL term would)."""
    return kl_reference(cfg) or not cfg.reward_fn.reference_free


def check_loss(cfg: Config) -> None:
    """The label smoothing a DPO loss can take (exo_pair's target has no log at 0; robust divides by
    1 - 2 eps)."""
    alg = cfg.algorithm
    if alg.loss_type == "exo_pair" and alg.label_smoothing <= 0:
        raise ValueError("algorithm.loss_type=exo_pair needs algorithm.label_smoothing > 0 (the target "
                         f"distribution's eps, e.g. 0.001), got {alg.label_smoothing}")
    if alg.loss_type == "discopop" and alg.discopop_tau <= 0:
        raise ValueError(f"algorithm.loss_type=discopop needs algorithm.discopop_tau > 0, got {alg.discopop_tau}")
    if alg.loss_type == "robust" and alg.label_smoothing >= 0.5:
        raise ValueError(f"algorithm.loss_type=robust needs algorithm.label_smoothing < 0.5, got {alg.label_smoothing}")


def pairs_per_micro_batch(cfg: Config) -> int:
    t = cfg.trainer
    return t.per_device_train_batch_size or max(1, cfg.actor.micro_batch_size // 2)


def warn_unused_critic(cfg: Config) -> None:
    """A critic section says nothing to DPO (called at start-up, from the trainer's constructor)."""
    if cfg.critic != CriticConfig():
        warnings.warn(f"the critic section does not apply to algorithm.type={cfg.algorithm.type} (DPO trains no "
                      "value model); it is ignored", UserWarning, stacklevel=4)


def step(updates: Any, pairs: List[PreferencePair], pad_id: int, algorithm: Any, per_micro: int) -> Dict[str, float]:
    """One optimiser step of the actor on ``pairs`` through ``updates`` (``trainer/updates.py``), the
    loss the mean over the pairs; ``algorithm``: the config's section (beta, loss_type,
    label_smoothing, sft_weight). Without a reference model the loss is reference-free."""
    strategy = updates.strategy
    exp = pair_rows.pair_experience(pairs, pad_id, strategy.device)
    micro = pair_rows.micro_batches(len(pairs), per_micro, 2, strategy.device)
    pair_rows.reference_logprobs(strategy, exp, micro)
    total = len(pairs)
    # the SFT term's mean is over every chosen token of the step, so micro-batches add up to it
    chosen_tokens = max(1, sum(len(p.chosen_ids) for p in pairs))

    def loss_fn(logp: torch.Tensor, sub: Experience) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        sums = policy = pair_rows.summed(logp, sub)
        reference = pair_rows.summed(sub.ref_logprobs, sub) if sub.ref_logprobs is not None else torch.zeros_like(policy)
        if algorithm.loss_type == "ipo":  # IPO on per-token log-ratios (preference_losses.ipo_loss)
            policy, reference = policy / pair_rows.lengths(sub), reference / pair_rows.lengths(sub)
            loss, s = ipo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], algorithm.beta)
        else:
            loss, s = dpo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], algorithm.beta,
                               algorithm.loss_type, algorithm.label_smoothing, algorithm.discopop_tau)
        part = sub.num_sequences // 2 / total  # this micro-batch's share of the step's pairs
        stats = {"dpo/loss": loss.detach() * part, "dpo/reward_margin": s["reward_margin"] * part,
                 "dpo/reward_accuracy": s["reward_accuracy"] * part}
        share = loss * part
        if algorithm.sft_weight:
            nll = -sums[0::2].sum() / chosen_tokens  # its share of the chosen tokens' mean NLL
            share = share + algorithm.sft_weight * nll
            stats["dpo/sft_nll"] = nll.detach()
        return share, stats

    metrics, norm = pair_rows.step(updates, exp, micro, loss_fn)
    return {**metrics, "actor/grad_norm": norm}
