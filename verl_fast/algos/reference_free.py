"""ORPO, SimPO and CPO (``Step.PREFERENCE``, no rollout, no reference model): the dataset's chosen /
rejected pairs, the actor's response log-probs of both, a loss of the policy alone
(``preference_losses``), plus a weight times the chosen responses' token-mean NLL, through the
strategy's ``forward_backward`` (``pair_rows.py``), one optimiser step per batch.

    orpo   odds ratio of the per-token mean log-probs, weight beta (the paper's lambda); NLL weight 1
    simpo  -log sig(beta (a_c - a_r) - simpo_gamma) on mean log-probs; NLL weight cpo_alpha (default 0)
    cpo    -log sig(beta (s_c - s_r)) on summed log-probs; NLL weight cpo_alpha (default 1)

``label_smoothing`` applies to simpo and cpo (conservative, as TRL's CPO trainer). Batching is DPO's
(``dpo.py``): ``per_device_train_batch_size`` pairs a forward / backward, the NLL's mean over every
chosen token of the step, so gradient accumulation gives the same gradient as one pass.

    verl-fast train algorithm.type=simpo algorithm.beta=2.0 algorithm.simpo_gamma=0.5 \\
        reward_fn.type=pairwise_ranking trainer.dataset=pairs.jsonl
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

from verl_fast.algos import dpo, pair_rows
from verl_fast.algos.algorithm import Step, kl_reference
from verl_fast.algos.preference_losses import cpo_loss, orpo_loss, simpo_loss
from verl_fast.config import Config
from verl_fast.data import RLDataProcessor
from verl_fast.records.prompts import PreferencePair
from verl_fast.records.experience import Experience

# loss(chosen_sum, rejected_sum, chosen_len, rejected_len [B], algorithm section) -> (loss, stats)
PairLoss = Callable[..., Tuple[torch.Tensor, Dict[str, torch.Tensor]]]


def _orpo(sc, sr, lc, lr, alg) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return orpo_loss(sc / lc, sr / lr, alg.beta)


def _simpo(sc, sr, lc, lr, alg) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return simpo_loss(sc / lc, sr / lr, alg.beta, alg.simpo_gamma, alg.label_smoothing)


def _cpo(sc, sr, lc, lr, alg) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return cpo_loss(sc, sr, alg.beta, alg.label_smoothing)


def nll_weight(cfg: Config) -> float:
    """The weight of the chosen responses' NLL: ORPO's is 1; SimPO's and CPO's ``algorithm.cpo_alpha``
    (unset: 0 for SimPO as its paper, 1 for CPO as its paper and TRL)."""
    alg = cfg.algorithm
    if alg.type == "orpo":
        return 1.0
    if alg.cpo_alpha is not None:
        return alg.cpo_alpha
    return 1.0 if alg.type == "cpo" else 0.0


class ReferenceFree:
    """The ``PreferenceAlgorithm`` of ORPO, SimPO and CPO (module docstring)."""

    step = Step.PREFERENCE
    item_type = PreferencePair
    samples = False
    needs_critic = False
    needs_reference = False

    def __init__(self, name: str, loss: PairLoss):
        self.name, self.loss = name, loss
        self.cfg: Config = None  # type: ignore[assignment]  # set by build

    def check(self, cfg: Config) -> None:
        dpo.DPO.check(cfg)
        if kl_reference(cfg):
            raise ValueError(f"actor.use_kl_loss / algorithm.use_kl_in_reward is not supported with "
                             f"algorithm.type={self.name}, which loads no reference model; turn them off")
        if cfg.algorithm.label_smoothing >= 0.5:
            raise ValueError(f"algorithm.type={self.name} needs algorithm.label_smoothing < 0.5, got "
                             f"{cfg.algorithm.label_smoothing}")
        if self.name == "simpo" and cfg.algorithm.beta <= 0:
            raise ValueError("algorithm.type=simpo needs algorithm.beta > 0 (the paper uses 2.0 to 10.0)")

    def build(self, cfg: Config) -> "ReferenceFree":
        built = ReferenceFree(self.name, self.loss)
        built.cfg = cfg
        return built

    def configure(self, world: int) -> None:
        dpo.DPO.configure(self, world)  # type: ignore[arg-type]  # the same warnings and batch sizing

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[PreferencePair]:
        return processor.build_dpo_dataset(rows)

    def pairs(self, batch: List[PreferencePair], generate: Any, score: Any,
              metrics: Dict[str, Any]) -> List[PreferencePair]:
        return batch

    def update(self, updates: Any, pairs: List[PreferencePair], pad_id: int) -> Dict[str, float]:
        return step(updates, pairs, pad_id=pad_id, loss=lambda *a: self.loss(*a, self.cfg.algorithm),
                    nll_weight=nll_weight(self.cfg), per_micro=dpo.pairs_per_micro_batch(self.cfg), prefix=self.name)


def step(updates: Any, pairs: List[PreferencePair], *, pad_id: int, loss: PairLoss, nll_weight: float,
         per_micro: int, prefix: str) -> Dict[str, float]:
    """One optimiser step of the actor through ``updates`` (``trainer/updates.py``): ``loss`` (the
    mean over the pairs) plus ``nll_weight`` times the chosen tokens' mean NLL over ``pairs``,
    ``per_micro`` pairs a pass; the statistics and ``actor/grad_norm``."""
    device = updates.strategy.device
    exp = pair_rows.pair_experience(pairs, pad_id, device)
    micro = pair_rows.micro_batches(len(pairs), per_micro, 2, device)
    total = len(pairs)
    # the NLL's mean is over every chosen token of the step, so micro-batches add up to it
    chosen_tokens = max(1, sum(len(p.chosen_ids) for p in pairs))

    def loss_fn(logp: torch.Tensor, sub: Experience):
        sums, lengths = pair_rows.summed(logp, sub), pair_rows.lengths(sub)
        value, s = loss(sums[0::2], sums[1::2], lengths[0::2], lengths[1::2])
        nll = -sums[0::2].sum() / chosen_tokens  # this micro-batch's share of the chosen tokens' mean NLL
        part = sub.num_sequences // 2 / total
        stats = {f"{prefix}/loss": value.detach() * part, f"{prefix}/nll": nll.detach(),
                 **{f"{prefix}/{k}": v * part for k, v in s.items()}}
        return value * part + nll_weight * nll, stats

    metrics, norm = pair_rows.step(updates, exp, micro, loss_fn)
    return {**metrics, "actor/grad_norm": norm}


ORPO = ReferenceFree("orpo", _orpo)
SIMPO = ReferenceFree("simpo", _simpo)
CPO = ReferenceFree("cpo", _cpo)
