"""KTO (Ethayarajh et al. 2024; ``Step.PREFERENCE``, no rollout) on unpaired completions, TRL's KTO
format: rows ``{"prompt", "completion", "label": bool}`` (strings or chat messages, as DPO's pairs).

Each step: the summed completion log-probs under the actor and the reference; the reference point
z0 = max(0, mean over the step's examples of the log-ratio of *mismatched* pairs (prompt i with
completion i+1 of the same micro-batch, TRL's KL estimate), averaged over the data-parallel ranks,
no gradient); ``preference_loss_variants.kto_loss`` with ``beta`` and ``kto_desirable_weight`` /
``kto_undesirable_weight``; the mean over the step's examples; one optimiser step. Batching as DPO's:
``per_device_train_batch_size`` examples a forward / backward (else half of ``actor.micro_batch_size``).

    verl-fast train algorithm.type=kto trainer.dataset=kto.jsonl
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from verl_fast import distributed
from verl_fast.algos import dpo
from verl_fast.algos.algorithm import Step
from verl_fast.algos.preference_loss_variants import kto_loss
from verl_fast.config import Config
from verl_fast.data import RLDataProcessor


@dataclass
class KTOExample:
    """One unpaired completion: token ids of the prompt and of the completion (EOS appended)."""

    prompt_ids: List[int]
    completion_ids: List[int]
    desirable: bool


def encode(processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[KTOExample]:
    """``prompt`` / ``completion`` / ``label`` rows as KTOExamples (prompts chat-templated, overlong
    ones skipped as DPO's)."""
    examples = []
    for i, row in enumerate(rows):
        if not {"prompt", "completion", "label"} <= set(row):
            raise ValueError(f"algorithm.type=kto: row {i} needs prompt / completion / label (TRL's unpaired "
                             f"format), got keys {sorted(row)}")
        if not isinstance(row["label"], bool):
            raise ValueError(f"algorithm.type=kto: row {i}'s label must be true or false, got {row['label']!r}")
        text = processor.template(row["prompt"])
        fitted = processor._fit(processor.tokenizer(text, add_special_tokens=False)["input_ids"], text)
        if fitted is None:
            processor.skipped_overlong += 1
            continue
        completion = processor.response_text(row["prompt"], row["completion"], "completion")
        examples.append(KTOExample(fitted[0], processor._response_ids(completion), row["label"]))
    return examples


class KTO:
    """The ``PreferenceAlgorithm`` of KTO (module docstring)."""

    name = "kto"
    step = Step.PREFERENCE
    item_type = KTOExample
    samples = False
    needs_critic = False
    needs_reference = True

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @staticmethod
    def check(cfg: Config) -> None:
        dpo.refuse_megatron(cfg)
        if cfg.reward_fn.reference_free:
            raise ValueError("reward_fn.reference_free is not supported with algorithm.type=kto (its reward is the "
                             "log-ratio to the reference); use algorithm.type=simpo or cpo for a reference-free loss")

    @classmethod
    def build(cls, cfg: Config) -> "KTO":
        return cls(cfg)

    def configure(self, world: int) -> None:
        dpo.DPO.configure(self, world)  # type: ignore[arg-type]  # the same warnings and batch sizing

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[KTOExample]:
        return encode(processor, rows)

    def pairs(self, batch: List[KTOExample], generate: Any, score: Any, metrics: Dict[str, Any]) -> List[KTOExample]:
        return batch

    def update(self, strategy: Any, batch: List[KTOExample], pad_id: int) -> Dict[str, float]:
        metrics = step(strategy, batch, pad_id, self.cfg)
        metrics["actor/grad_norm"] = strategy.optimizer_step()
        return metrics


def _logps(model: torch.nn.Module, prompts, completions, pad_id: int, strategy: Any) -> torch.Tensor:
    ids, mask, rmask = dpo.sequence_tensors(prompts, completions, pad_id, strategy.device)
    return dpo.sequence_logprobs(model, ids, mask, rmask, strategy.autocast)


def kl_estimate(strategy: Any, batch: List[KTOExample], pad_id: int, size: int) -> torch.Tensor:
    """The mean log-ratio of mismatched pairs (prompt i, completion i+1 within each micro-batch of
    ``size``), over the ranks; no gradient."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(batch), size):
            chunk = batch[start : start + size]
            prompts = [e.prompt_ids for e in chunk]
            shifted = [chunk[(i + 1) % len(chunk)].completion_ids for i in range(len(chunk))]
            ratio = _logps(strategy.actor, prompts, shifted, pad_id, strategy) - _logps(
                strategy.ref, prompts, shifted, pad_id, strategy)
            total, count = total + float(ratio.sum()), count + len(chunk)
    total, count = distributed.all_reduce_numbers([total, float(count)], group=strategy.dp_group) \
        if strategy.dp_size > 1 else (total, float(count))
    return torch.tensor(total / count, device=strategy.device)


def step(strategy: Any, batch: List[KTOExample], pad_id: int, cfg: Config) -> Dict[str, float]:
    """The backward passes of one KTO step over ``batch``; its statistics."""
    alg, size = cfg.algorithm, dpo.pairs_per_micro_batch(cfg)
    kl = kl_estimate(strategy, batch, pad_id, size)
    stats: Dict[str, float] = {"kto/loss": 0.0}
    for start in range(0, len(batch), size):
        chunk = batch[start : start + size]
        prompts, completions = [e.prompt_ids for e in chunk], [e.completion_ids for e in chunk]
        policy = _logps(strategy.actor, prompts, completions, pad_id, strategy)
        with torch.no_grad():
            reference = _logps(strategy.ref, prompts, completions, pad_id, strategy)
        labels = torch.tensor([e.desirable for e in chunk], device=policy.device)
        loss, s = kto_loss(policy, reference, labels, kl, alg.beta, alg.kto_desirable_weight,
                           alg.kto_undesirable_weight)
        (loss * len(chunk) / len(batch)).backward()
        stats["kto/loss"] += loss.item() * len(chunk) / len(batch)
    stats["kto/kl"] = float(kl.clamp(min=0))
    return stats
