"""A format reward in TRL's signature (``f(prompts, completions, **kwargs) -> list[float]``): 1 for a
completion that is a bare number, 0.5 for one that holds a number, else 0. Every dataset column
arrives as a keyword list (here ``data_source`` and ``reward_model`` among them, unused)."""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def short_answer(prompts, completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]  # chat or plain prompts
    return [1.0 if NUMBER.fullmatch(t.strip()) else 0.5 if NUMBER.search(t) else 0.0 for t in texts]
