"""KTO (Ethayarajh et al. 2024; ``Step.PREFERENCE``, no rollout) on unpaired completions, TRL's KTO
format: rows ``{"prompt", "completion", "label": bool}`` (strings or chat messages, as DPO's pairs).

Each step: the summed completion log-probs under the actor and the reference; the reference point
z0 = max(0, mean over the step's examples of the log-ratio of *mismatched* pairs (prompt i with
completion i+1 of the same micro-batch, TRL's KL estimate), averaged over the data-parallel ranks,
no gradient); ``preference_losses.kto_loss`` with ``beta`` and ``kto_desirable_weight`` /
``kto_undesirable_weight``; the mean over the step's examples; one optimiser step through the
strategy's ``forward_backward`` (``pair_rows.py``). Batching as DPO's:
``per_device_train_batch_size`` examples a forward / backward (else half of ``actor.micro_batch_size``).

    verl-fast train algorithm.type=kto trainer.dataset=kto.jsonl
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from verl_fast import distributed
from verl_fast.algos import dpo, pair_rows
from verl_fast.algos.algorithm import Step
from verl_fast.algos.preference_losses import kto_loss
from verl_fast.config import Config
from verl_fast.data import RLDataProcessor
from verl_fast.records.experience import Experience


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

    def update(self, updates: Any, batch: List[KTOExample], pad_id: int) -> Dict[str, float]:
        return step(updates, batch, pad_id, self.cfg)


def _experience(batch: List[KTOExample], pad_id: int, device: torch.device, per_micro: int,
                mismatched: bool = False) -> Experience:
    """The examples as rows (``scores``: 1 desirable, 0 not); ``mismatched``: prompt i with completion
    i+1 of the same micro-batch of ``per_micro`` (TRL's KL estimate)."""
    completions = [e.completion_ids for e in batch]
    if mismatched:
        completions = []
        for start in range(0, len(batch), per_micro):
            chunk = batch[start : start + per_micro]
            completions += [chunk[(i + 1) % len(chunk)].completion_ids for i in range(len(chunk))]
    exp = pair_rows.rows_experience([e.prompt_ids for e in batch], completions, range(len(batch)), pad_id, device)
    exp.scores = torch.tensor([float(e.desirable) for e in batch], device=device)
    return exp


@torch.no_grad()
def kl_estimate(strategy: Any, batch: List[KTOExample], pad_id: int, per_micro: int) -> torch.Tensor:
    """The mean log-ratio of mismatched pairs (prompt i, completion i+1 within each micro-batch of
    ``per_micro``), over the ranks; no gradient."""
    exp = _experience(batch, pad_id, strategy.device, per_micro, mismatched=True)
    micro = pair_rows.micro_batches(len(batch), per_micro, 1, strategy.device)
    ratio = pair_rows.summed(strategy.actor_logprobs(exp, micro), exp) - pair_rows.summed(
        strategy.ref_logprobs(exp, micro), exp)
    total, count = float(ratio.sum()), float(len(batch))
    if strategy.dp_size > 1:
        total, count = distributed.all_reduce_numbers([total, count], group=strategy.dp_group)
    return torch.tensor(total / count, device=strategy.device)


def step(updates: Any, batch: List[KTOExample], pad_id: int, cfg: Config) -> Dict[str, float]:
    """One optimiser step of the actor on ``batch`` through ``updates`` (``trainer/updates.py``)."""
    alg, size, strategy = cfg.algorithm, dpo.pairs_per_micro_batch(cfg), updates.strategy
    kl = kl_estimate(strategy, batch, pad_id, size)
    exp = _experience(batch, pad_id, strategy.device, size)
    micro = pair_rows.micro_batches(len(batch), size, 1, strategy.device)
    pair_rows.reference_logprobs(strategy, exp, micro)

    def loss_fn(logp: torch.Tensor, sub: Experience):
        policy, reference = pair_rows.summed(logp, sub), pair_rows.summed(sub.ref_logprobs, sub)
        loss, _ = kto_loss(policy, reference, sub.scores > 0.5, kl, alg.beta, alg.kto_desirable_weight,
                           alg.kto_undesirable_weight)
        part = sub.num_sequences / len(batch)
        return loss * part, {"kto/loss": loss.detach() * part}

    metrics, norm = pair_rows.step(updates, exp, micro, loss_fn)
    return {**metrics, "kto/kl": float(kl.clamp(min=0)), "actor/grad_norm": norm}
