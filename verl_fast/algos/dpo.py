"""DPO (Rafailov et al.) on the dataset's chosen / rejected pairs (``Step.PREFERENCE``, no rollout): the
summed response log-probs of chosen and rejected under the actor and the reference (none with
``reward_fn.reference_free``; ``ipo`` takes their per-token means, as Azar et al.'s authors and TRL
do), the DPO loss (``algorithm.loss_type``: sigmoid, ipo, hinge, robust, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop (``loss_terms.dpo_loss``), with ``beta`` and
``label_smoothing``) plus ``algorithm.sft_weight`` times the chosen responses' mean token NLL (RPO),
backward, one optimiser step per batch.

Batching: a forward/backward takes ``trainer.per_device_train_batch_size`` pairs (else half of
``actor.micro_batch_size``: a pair is two sequences); with ``trainer.gradient_accumulation_steps``
an optimiser step sees that many micro-batches on every process, i.e. ``per_device_train_batch_size
x gradient_accumulation_steps x processes`` pairs (else ``trainer.train_batch_size`` pairs).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from verl_fast.algos.algorithm import Step, kl_reference
from verl_fast.algos.loss_terms import dpo_loss
from verl_fast.algos.preference_loss_variants import ipo_loss
from verl_fast.config import Config, CriticConfig
from verl_fast.data import PreferencePair, RLDataProcessor
from verl_fast.models.response_logprobs import response_logprobs


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
            raise ValueError(f"algorithm.type=dpo is not supported with reward_fn.type={cfg.reward_fn.type}; "
                             "leave reward_fn out (DPO learns from chosen/rejected pairs)")
        refuse_megatron(cfg)
        check_loss(cfg)

    @classmethod
    def build(cls, cfg: Config) -> "DPO":
        return cls(cfg)

    def configure(self, world: int) -> None:
        """Says which settings do not apply, and sizes the step from ``gradient_accumulation_steps``
        (module docstring)."""
        cfg = self.cfg
        warn_unused_critic(cfg)
        if cfg.actor.type == "vllm" or cfg.rollout.type == "vllm":
            warnings.warn("actor.type=vllm / rollout.type=vllm does not apply to algorithm.type=dpo: offline DPO "
                          "generates nothing (it trains on the dataset's chosen/rejected pairs), so no vLLM engine "
                          "is started; use algorithm.type=online_dpo to sample the pairs with vLLM",
                          UserWarning, stacklevel=3)
        if cfg.trainer.gradient_accumulation_steps:
            cfg.trainer.train_batch_size = pairs_per_micro_batch(cfg) * cfg.trainer.gradient_accumulation_steps * world

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[PreferencePair]:
        return processor.build_dpo_dataset(rows)

    def pairs(self, batch: List[PreferencePair], generate: Any, score: Any, metrics: Dict[str, Any]) -> List[PreferencePair]:
        return batch

    def update(self, strategy: Any, pairs: List[PreferencePair], pad_id: int) -> Dict[str, float]:
        return update(self.cfg, strategy, pairs, pad_id)


def needs_reference(cfg: Config) -> bool:
    """DPO's reference: the loss reads it unless ``reward_fn.reference_free`` (and a KL term would)."""
    return kl_reference(cfg) or not cfg.reward_fn.reference_free


def refuse_megatron(cfg: Config) -> None:
    """DPO trains the Hugging Face actor itself, which the Megatron strategy only rolls out with."""
    if cfg.actor.strategy == "megatron":
        raise ValueError(f"algorithm.type={cfg.algorithm.type} is not supported with actor.strategy=megatron; "
                         "use fsdp2, fsdp1 or none")


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


def pair_tensors(pairs: List[PreferencePair], pad_id: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """``[2B, P + L]`` ids and attention mask (chosen rows first, then rejected) and the ``[2B, L]``
    response mask (``sequence_tensors``)."""
    return sequence_tensors([p.prompt_ids for p in pairs] * 2,
                            [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs], pad_id, device)


def sequence_tensors(prompts: List[List[int]], responses: List[List[int]], pad_id: int,
                     device: torch.device) -> Tuple[torch.Tensor, ...]:
    """``[N, P + L]`` ids and attention mask and the ``[N, L]`` response mask of prompt / response
    rows: left-padded prompts, right-padded responses."""
    P = max(len(p) for p in prompts)
    L = max(1, max(len(r) for r in responses))
    ids = torch.full((len(responses), P + L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, resp) in enumerate(zip(prompts, responses)):
        if prompt:
            ids[row, P - len(prompt) : P] = torch.as_tensor(prompt)
            mask[row, P - len(prompt) : P] = 1
        if resp:
            ids[row, P : P + len(resp)] = torch.as_tensor(resp)
            mask[row, P : P + len(resp)] = 1
    return ids.to(device), mask.to(device), mask[:, P:].to(device)


def sequence_logprobs(model, ids, mask, response_mask, autocast) -> torch.Tensor:
    with autocast():
        logp, _ = response_logprobs(model, ids, mask, response_mask.shape[1])
    return (logp.float() * response_mask).sum(-1)


def step(actor: torch.nn.Module, ref: Optional[torch.nn.Module], pairs: List[PreferencePair], *, pad_id: int,
         device: torch.device, autocast: Callable[[], ContextManager[Any]], algorithm: Any,
         pairs_per_micro_batch: int) -> Dict[str, float]:
    """``algorithm``: the config's algorithm section (beta, loss_type, label_smoothing, sft_weight); without a
    ``ref`` the loss is reference-free. ``pairs_per_micro``: pairs per forward/backward."""
    total = len(pairs)
    size = pairs_per_micro_batch
    # the SFT term's mean is over every chosen token of the step, so micro-batches add up to it
    chosen_tokens = max(1, sum(len(p.chosen_ids) for p in pairs))
    stats: Dict[str, float] = {"dpo/loss": 0.0, "dpo/reward_margin": 0.0, "dpo/reward_accuracy": 0.0}
    if algorithm.sft_weight:
        stats["dpo/sft_nll"] = 0.0
    for start in range(0, total, size):
        chunk = pairs[start : start + size]
        ids, mask, rmask = pair_tensors(chunk, pad_id, device)
        policy = sequence_logprobs(actor, ids, mask, rmask, autocast)
        if ref is not None:
            with torch.no_grad():
                reference = sequence_logprobs(ref, ids, mask, rmask, autocast)
        else:  # reference-free DPO
            reference = torch.zeros_like(policy)
        B = len(chunk)
        if algorithm.loss_type == "ipo":  # IPO on per-token log-ratios (preference_loss_variants.ipo_loss)
            lengths = rmask.sum(-1).clamp(min=1)
            loss, s = ipo_loss(policy[:B] / lengths[:B], policy[B:] / lengths[B:], reference[:B] / lengths[:B],
                               reference[B:] / lengths[B:], algorithm.beta)
        else:
            loss, s = dpo_loss(policy[:B], policy[B:], reference[:B], reference[B:], algorithm.beta,
                               algorithm.loss_type, algorithm.label_smoothing, algorithm.discopop_tau)
        share = loss * B / total  # the mean over all pairs of the step
        if algorithm.sft_weight:
            nll = -policy[:B].sum() / chosen_tokens  # this micro-batch's share of the chosen tokens' mean NLL
            share = share + algorithm.sft_weight * nll
            stats["dpo/sft_nll"] += nll.item()
        share.backward()
        stats["dpo/loss"] += loss.item() * B / total
        stats["dpo/reward_margin"] += float(s["reward_margin"]) * B / total
        stats["dpo/reward_accuracy"] += float(s["reward_accuracy"]) * B / total
    return stats


def update(cfg: Config, strategy: Any, pairs: List[PreferencePair], pad_id: int) -> Dict[str, float]:
    """One optimiser step of ``strategy``'s actor on ``pairs``: the DPO step, then the optimizer."""
    metrics = step(strategy.actor, strategy.ref, pairs, pad_id=pad_id, device=strategy.device,
                   autocast=strategy.autocast, algorithm=cfg.algorithm, pairs_per_micro_batch=pairs_per_micro_batch(cfg))
    metrics["actor/grad_norm"] = strategy.optimizer_step()
    return metrics
