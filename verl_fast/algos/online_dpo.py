"""Online DPO (``Step.PREFERENCE``): the rollout samples ``rollout.n >= 2`` responses per prompt, the
reward function (or reward model) scores them, and each prompt's best and worst response form a
chosen/rejected pair that trains DPO in the same step (``dpo.py``), after which the engine takes the
new weights. A prompt whose samples all score the same says nothing about preference and gives no
pair; a step without pairs makes no update. One process only (ranks would keep different numbers of
pairs).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Sequence

import torch

from verl_fast.algos import dpo
from verl_fast.algos.algorithm import Score, Step, refuse_pairwise_ranking
from verl_fast.config import Config
from verl_fast.data import RLDataProcessor
from verl_fast.records.prompts import PreferencePair, PromptRow
from verl_fast.records.generation import GenerationOutput


class OnlineDPO:
    """The ``PreferenceAlgorithm`` of online DPO (``algorithm.py``)."""

    name = "online_dpo"
    step = Step.PREFERENCE
    item_type = PromptRow
    samples = True
    needs_critic = False

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.needs_reference = dpo.needs_reference(cfg)

    @staticmethod
    def check(cfg: Config) -> None:
        refuse_pairwise_ranking(cfg, " (online_dpo ranks its samples with a scoring reward: reasoning_gym, gsm8k, "
                                     "callable or reward_model)")
        if cfg.rollout.n < 2:
            raise ValueError(f"algorithm.type=online_dpo is not supported with rollout.n={cfg.rollout.n}: a pair "
                             "needs two sampled responses per prompt; use rollout.n >= 2")
        dpo.check_loss(cfg)

    @classmethod
    def build(cls, cfg: Config) -> "OnlineDPO":
        return cls(cfg)

    def configure(self, world: int) -> None:
        if world > 1:
            raise ValueError("algorithm.type=online_dpo is not supported with several processes (ranks would keep "
                             "different numbers of pairs); use one process, or dpo with a pairs dataset")
        dpo.warn_unused_critic(self.cfg)

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[PromptRow]:
        return processor.encode_all(rows)

    def pairs(self, batch: Sequence[PromptRow], generate: Callable[[Sequence[PromptRow]], GenerationOutput],
              score: Score, metrics: Dict[str, Any]) -> List[PreferencePair]:
        """Sample, score, pair each prompt's best with its worst sample."""
        start = time.perf_counter()
        gen = generate(batch)
        scores = score(batch, gen)
        pairs = best_worst_pairs(batch, gen, scores)
        metrics.update({"time/generation": time.perf_counter() - start, "reward/mean": scores.mean().item(),
                        "dpo/pairs": len(pairs)})
        return pairs

    def update(self, updates: Any, pairs: List[PreferencePair], pad_id: int) -> Dict[str, float]:
        return dpo.step(updates, pairs, pad_id, self.cfg.algorithm, dpo.pairs_per_micro_batch(self.cfg))


def best_worst_pairs(batch: Sequence[PromptRow], gen: GenerationOutput, scores: torch.Tensor) -> List[PreferencePair]:
    """One pair per prompt whose samples' scores differ: the highest-scored sample as chosen, the
    lowest as rejected (the first such sample on ties)."""
    if scores.shape != (gen.num_sequences,):
        raise ValueError(f"scores must have one value per sample ({gen.num_sequences}), got {list(scores.shape)}")
    scores = scores.detach().cpu()
    pairs = []
    for p, row in enumerate(batch):
        rows = (gen.prompt_index == p).nonzero().flatten()
        if rows.numel() < 2:
            continue
        s = scores[rows]
        best, worst = rows[int(s.argmax())], rows[int(s.argmin())]
        if scores[best] == scores[worst]:
            continue
        pairs.append(PreferencePair(
            prompt=row.prompt_text, chosen=gen.texts[best] if gen.texts else "",
            rejected=gen.texts[worst] if gen.texts else "", prompt_ids=list(row.prompt_ids),
            chosen_ids=_tokens(gen, best), rejected_ids=_tokens(gen, worst)))
    return pairs


def _tokens(gen: GenerationOutput, row: int) -> List[int]:
    return gen.response_ids[row][gen.response_mask[row].bool()].tolist()
