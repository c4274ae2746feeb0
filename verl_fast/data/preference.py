"""Preference rows in TRL's formats split into (prompt, chosen, rejected): ``preference_parts``."""

from __future__ import annotations

from typing import Any, Optional, Tuple


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "content" in m for m in x)


def _common_prefix(chosen: Any, rejected: Any) -> int:
    """Where chosen and rejected part (TRL's implicit prompt: whole messages, or characters, a space
    at the parting left to the responses)."""
    n = min(len(chosen), len(rejected))
    cut = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if isinstance(chosen, str) and cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    return cut


def preference_parts(row: Any) -> Optional[Tuple[Any, Any, Any]]:
    """(prompt, chosen, rejected) of a preference row in TRL's formats: explicit prompt
    (``prompt`` / ``chosen`` / ``rejected``) or implicit (``chosen`` / ``rejected`` as whole texts or
    conversations: their common start is the prompt), plain or conversational, with optional
    ``score_chosen`` / ``score_rejected``; or two scored answers (webgpt_comparisons: ``question``,
    ``answer_0`` / ``answer_1``, ``score_0`` / ``score_1``; also ``answer_1`` / ``answer_2``). None for a
    tie (left out); ValueError naming the keys for anything else."""
    keys = set(row) if isinstance(row, dict) else set()
    if {"chosen", "rejected"} <= keys:
        chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
        # TRL reads the prompt column unless the pairs are whole conversations (their first turn not the
        # assistant's) and the prompt is not a conversation too
        whole = _is_chat(chosen) and chosen[0].get("role", "assistant") != "assistant"
        if prompt is not None and (not whole or _is_chat(prompt)):
            return prompt, chosen, rejected
        if _is_chat(chosen) != _is_chat(rejected):
            raise ValueError("chosen and rejected must both be texts or both be chat messages")
        cut = _common_prefix(chosen, rejected)
        if cut == 0:
            raise ValueError("chosen and rejected share no prompt (implicit-prompt rows start with the same "
                             "prompt); give a prompt column")
        return chosen[:cut], chosen[cut:], rejected[cut:]
    for a, b in (("0", "1"), ("1", "2")):
        if {"question", f"answer_{a}", f"answer_{b}", f"score_{a}", f"score_{b}"} <= keys:
            if row[f"score_{a}"] == row[f"score_{b}"]:
                return None
            first = row[f"score_{a}"] > row[f"score_{b}"]
            question = row["question"]
            prompt = question["full_text"] if isinstance(question, dict) else question
            pair = (row[f"answer_{a}"], row[f"answer_{b}"])
            return (prompt,) + (pair if first else pair[::-1])
    raise ValueError("a preference row needs chosen/rejected (with or without prompt), or question/answer_0/"
                     f"answer_1/score_0/score_1, got keys {sorted(keys) if keys else type(row).__name__}")
