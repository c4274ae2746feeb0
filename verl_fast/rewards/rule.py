"""Rule-based scorers: reasoning-gym's answer checkers and a GSM8K-style ``####`` extractor."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence

from verl_fast.rewards.interface import RewardFunction, RewardInput

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> Optional[str]:
    """The last number in ``text`` (commas dropped), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k_answer(text: str) -> Optional[str]:
    """The answer after GSM8K's ``####`` marker, else the last number of the text."""
    if "####" in text:
        tail = text.split("####")[-1]
        number = last_number(tail)
        if number is not None:
            return number
    return last_number(text)


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a.strip() == b.strip()


class GSM8KReward(RewardFunction):
    """1.0 when the response's answer (after ``####``, else its last number) equals the ground truth
    (itself a number or a GSM8K solution ending in ``#### n``), else 0.0."""

    name = "gsm8k"

    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        out = []
        for s in samples:
            truth = gsm8k_answer(str(s.ground_truth)) if s.ground_truth is not None else None
            answer = gsm8k_answer(s.response)
            out.append(1.0 if truth is not None and answer is not None and _same_number(answer, truth) else 0.0)
        return out


class ReasoningGymReward(RewardFunction):
    """reasoning-gym's own checker for the entry's task, on the response's extracted answer.

    ``ground_truth`` is the reasoning-gym entry (``question``, ``answer``, ``metadata``). The answer
    scored is the last number of the response (``answer="last_number"``: small instruct models rarely
    answer with the bare number, and scoring the raw text gives 0 everywhere) or the whole response
    (``answer="raw"``). Only a full score counts: some tasks give partial credit, and a 0/1 reward is
    what GRPO's group statistics expect.
    """

    name = "reasoning_gym"

    def __init__(self, answer: str = "last_number"):
        if answer not in ("last_number", "raw"):
            raise ValueError(f"answer must be 'last_number' or 'raw', got {answer!r}")
        self.answer = answer
        self._scorers: Dict[str, Any] = {}

    def _scorer(self, entry: Dict[str, Any]):
        import reasoning_gym

        task = entry.get("metadata", {}).get("source_dataset")
        if task is None:
            raise ValueError("reasoning_gym reward needs the entry's metadata.source_dataset in ground_truth")
        if task not in self._scorers:
            self._scorers[task] = reasoning_gym.get_score_answer_fn(task)
        return self._scorers[task]

    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        out = []
        for s in samples:
            entry = s.ground_truth
            if not isinstance(entry, dict):
                raise ValueError("reasoning_gym reward needs the reasoning-gym entry (a dict) as ground_truth")
            answer = last_number(s.response) if self.answer == "last_number" else s.response
            score = self._scorer(entry)(answer, entry) if answer is not None else 0.0
            out.append(1.0 if score == 1.0 else 0.0)
        return out
