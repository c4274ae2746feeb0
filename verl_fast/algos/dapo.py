"""DAPO's (Yu et al., 2025) two sampling-side changes, for any policy-gradient algorithm whose baseline
is the other samples of the same prompt.

- Dynamic sampling (``algorithm.dynamic_sampling``): a prompt whose samples all score the same has
  advantage 0 on every sample and teaches nothing; its group is dropped and more prompts are drawn
  and sampled, up to ``algorithm.max_extra_draws`` extra draws of ``train_batch_size`` prompts,
  until the step holds ``train_batch_size`` prompts with differing scores (fewer if the draws run
  out; counted in the metrics). ``DynamicSampling`` is the policy-gradient algorithms'
  ``select_experience`` where it is on.
- Overlong reward shaping (``algorithm.overlong_buffer``, DAPO eq. 13): with ``L_max`` =
  ``rollout.max_new_tokens`` and ``L_cache`` = the buffer, a response of ``|y|`` tokens gets
  ``0`` when ``|y| <= L_max - L_cache``, ``((L_max - L_cache) - |y|) / L_cache`` up to ``L_max`` and
  ``-1`` beyond, times ``algorithm.overlong_penalty_factor``, added to its reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch

from verl_fast.algos.algorithm import MorePrompts
from verl_fast.records.prompts import PromptRow
from verl_fast.records.experience import Experience, concat


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of ``lengths`` tokens ``[N]`` (float32)."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong_buffer must be in [1, max_new_tokens={max_length}], got {buffer}")
    start = max_length - buffer  # the last length that costs nothing
    lengths = lengths.to(torch.float32)
    soft = (start - lengths) / buffer
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), torch.where(lengths <= max_length, soft, -1.0))
    return penalty * factor


def informative_groups(scores: torch.Tensor, prompt_index: torch.Tensor) -> List[int]:
    """The prompts (ids of ``prompt_index``, in first-seen order) whose samples' ``scores`` differ."""
    keep = []
    for p in dict.fromkeys(prompt_index.tolist()):
        s = scores[prompt_index == p]
        if s.numel() > 1 and bool((s != s[0]).any()):
            keep.append(p)
    return keep


def rows_of(prompt_index: torch.Tensor, prompts: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows of the ``prompts`` groups (in that order) and their prompt ids renumbered 0, 1, ..."""
    rows, ids = [], []
    for new, p in enumerate(prompts):
        r = (prompt_index == p).nonzero().flatten()
        rows.append(r)
        ids.append(torch.full((r.numel(),), new, dtype=torch.long))
    if not rows:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(rows), torch.cat(ids)


@dataclass(frozen=True)
class DynamicSampling:
    """``algorithm.dynamic_sampling`` (module docstring): ``batch_size`` is ``trainer.train_batch_size``,
    ``seed`` ``trainer.seed`` (the extra draws' generator)."""

    batch_size: int
    max_extra_draws: int
    seed: int

    def select(self, exp: Experience, more: MorePrompts, metrics: Dict[str, Any]) -> Experience:
        """The groups of ``exp`` whose scores differ, topped up from extra draws of ``more.items`` (each
        generated and scored by ``more.scored_rollout``) until ``batch_size`` of them or
        ``max_extra_draws`` is spent; prompt ids renumbered 0, 1, ... in the order kept."""
        want = self.batch_size
        kept: List[Experience] = []
        found, dropped, draws = 0, 0, 0
        while True:
            groups = informative_groups(exp.scores, exp.prompt_index)
            dropped += int(exp.prompt_index.unique().numel()) - len(groups)
            groups = groups[: want - found]
            rows, ids = rows_of(exp.prompt_index, groups)
            if rows.numel():
                part = exp.select(rows.to(exp.input_ids.device))
                part.prompt_index = (ids + found).to(part.prompt_index.device)
                kept.append(part)
            found += len(groups)
            if found >= want or draws >= self.max_extra_draws:
                break
            draws += 1
            exp = more.scored_rollout(self.extra_batch(more.items, more.step, draws))
        metrics.update({"dynamic_sampling/extra_draws": float(draws), "dynamic_sampling/dropped_groups": float(dropped),
                        "dynamic_sampling/kept_groups": float(found)})
        if not kept:
            raise RuntimeError(f"algorithm.dynamic_sampling: every prompt's samples scored the same in the step's "
                               f"batch and {draws} extra draws (algorithm.max_extra_draws); raise max_extra_draws "
                               "or rollout.n, or check the reward")
        return concat(kept)

    def extra_batch(self, items: Sequence[PromptRow], step: int, draw: int) -> List[PromptRow]:
        """The ``draw``-th extra batch of ``step``: ``batch_size`` of ``items`` drawn with a generator
        seeded by the seed, the step and the draw (a resumed run draws the same)."""
        if not items:
            raise RuntimeError("algorithm.dynamic_sampling draws its extra prompts from the dataset fit() trains on; "
                               "call fit(dataset)")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + draw)
        take = torch.randint(len(items), (self.batch_size,), generator=g).tolist()
        return [items[j] for j in take]
