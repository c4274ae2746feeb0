"""Online DPO's pairs: the rollout samples ``rollout.n >= 2`` responses per prompt, the reward
function (or reward model) scores them, and each prompt's best and worst response form a
chosen/rejected pair that trains DPO in the same step (``dpo.py``). A prompt whose samples
all score the same says nothing about preference and gives no pair.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from verl_fast.data import PreferencePair, PromptRow
from verl_fast.rollout.base import GenerationOutput


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
