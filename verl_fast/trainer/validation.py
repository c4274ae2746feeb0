"""Validation: the ``trainer.val_dataset`` prompts rolled out with their own sampling
(``trainer.val_n``, ``val_temperature`` (0: greedy), ``val_top_p``, ``val_max_new_tokens``) and
scored by the run's reward, without a gradient or an update.

Each rank rolls out its share of the prompts (every world-th one); the sums are reduced over the
ranks, so the metrics are those of the whole set: ``val/reward/mean``, ``val/<data_source>/reward/mean``
for each data source the set holds, ``val/response/length``, and ``val/<key>`` for each key the
reward reports (each reward function's mean, a dict result's extra keys; means over the ranks)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from verl_fast import distributed
from verl_fast.config import Config
from verl_fast.records.prompts import PromptRow
from verl_fast.records.generation import GenerationOutput, SamplingSpec
from verl_fast.rollout.operator import RolloutOperator

# score(batch, generation) -> [N] rewards (the trainer's, with its fault handling)
Score = Callable[[Sequence[PromptRow], GenerationOutput], torch.Tensor]


def sampling(cfg: Config) -> SamplingSpec:
    """The validation rollout's sampling."""
    t = cfg.trainer
    return SamplingSpec(n=t.val_n, temperature=t.val_temperature, top_p=t.val_top_p,
                        top_k=cfg.rollout.top_k if t.val_temperature > 0 else -1,
                        max_tokens=t.val_max_new_tokens or cfg.rollout.max_new_tokens, logprobs=False)


class Validation:
    """The validation set of a run (``rows``: every prompt, on every rank) and its rollout."""

    def __init__(self, cfg: Config, rows: List[PromptRow], engine: Any, rank: int, world: int, group: Any = None,
                 operator_for: Optional[Callable[[SamplingSpec], RolloutOperator]] = None):
        """``operator_for(sampling)``: the rollout operator with the validation's sampling, where the
        run's rollout is not the plain one (multi-turn: ``MultiTurnRolloutOperator.with_sampling``)."""
        if len(rows) < world:
            raise ValueError(f"trainer.val_dataset has {len(rows)} prompts, fewer than the {world} processes; "
                             "every rank needs one")
        self.cfg, self.rank, self.world, self.group, self.engine = cfg, rank, world, group, engine
        self.rows = rows[rank::world]
        self.sources = sorted({r.data_source for r in rows if r.data_source})
        self.operator = operator_for(sampling(cfg)) if operator_for is not None else \
            RolloutOperator(engine, sampling(cfg), max_num_seqs=cfg.rollout.max_num_seqs)

    def run(self, score: Score, reward: Any, seed: int) -> Tuple[Dict[str, float], List[Dict[str, Any]]]:
        """The metrics over the whole set, and this rank's samples (prompt, response, reward, data_source)."""
        gen = self.operator.rollout(self.rows, seed=seed)
        # the engine's figures since its last read are this rollout's (read here, not in the next step's)
        engine_figures = self.engine.metrics()
        scores = score(self.rows, gen).double().cpu()
        index = gen.prompt_index.tolist()
        lengths = gen.response_mask.sum(-1).double().cpu()
        sums = [float(scores.sum()), float(lengths.sum()), float(len(index))]
        for source in self.sources:
            mine = torch.tensor([self.rows[i].data_source == source for i in index], dtype=torch.bool)
            sums += [float(scores[mine].sum()), float(mine.sum())]
        extra = dict(getattr(reward, "last_metrics", {}))
        keys = sorted(extra)
        if self.world > 1:
            summed = distributed.all_reduce_numbers(sums + [extra[k] for k in keys], group=self.group)
            sums, extra = summed[: len(sums)], {k: v / self.world for k, v in zip(keys, summed[len(sums):])}
        total = max(sums[2], 1.0)
        metrics = {"val/reward/mean": sums[0] / total, "val/response/length": sums[1] / total}
        for k, source in enumerate(self.sources):
            s, n = sums[3 + 2 * k], sums[4 + 2 * k]
            if n:
                metrics[f"val/{source}/reward/mean"] = s / n
        metrics.update({f"val/{k}": v for k, v in extra.items()})
        metrics.update({f"val/rollout/{k}": v for k, v in engine_figures.items()})  # this rank's
        samples = [{"prompt": self.rows[i].prompt_text, "response": text, "reward": float(r),
                    "data_source": self.rows[i].data_source}
                   for i, text, r in zip(index, gen.texts, scores.tolist())]
        return metrics, samples
