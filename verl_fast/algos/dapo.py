"""DAPO's (Yu et al., 2025) two sampling-side changes, for any policy-gradient algorithm whose baseline
is the other samples of the same prompt.

- Dynamic sampling (``algorithm.dynamic_sampling``): a prompt whose samples all score the same has
  advantage 0 on every sample and teaches nothing; its group is dropped and more prompts are drawn
  and sampled, up to ``algorithm.max_extra_draws`` extra draws of ``train_batch_size`` prompts,
  until the step holds ``train_batch_size`` prompts with differing scores (fewer if the draws run
  out; counted in the metrics).
- Overlong reward shaping (``algorithm.overlong_buffer``, DAPO eq. 13): with ``L_max`` =
  ``rollout.max_new_tokens`` and ``L_cache`` = the buffer, a response of ``|y|`` tokens gets
  ``0`` when ``|y| <= L_max - L_cache``, ``((L_max - L_cache) - |y|) / L_cache`` up to ``L_max`` and
  ``-1`` beyond, times ``algorithm.overlong_penalty_factor``, added to its reward.
"""

from __future__ import annotations

from typing import List, Tuple

import torch


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
