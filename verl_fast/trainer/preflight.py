"""The data, the reward and their fit, checked on the dataset's first rows before any model loads:
each problem one line naming the file (and line, for JSONL) or row, the key, or the function.

- prompts: every row has a ``prompt`` (text or chat messages); preference algorithms: every row is
  a preference pair in one of TRL's formats (``data.preference_parts``);
- ``reward_fn.type: auto``: every row's ``data_source`` has a scorer (``rewards.by_source``);
- a reward function: its required parameters are among what the call passes and the rows' columns
  (TRL's ``accuracy_reward(completions, solution, **kwargs)`` needs a ``solution`` column);
- reasoning_gym / gsm8k: the rows carry the ground truth they score against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from verl_fast import config as config_mod
from verl_fast.algos import registry as algorithms
from verl_fast.data import preference_parts
from verl_fast.records.prompts import PreferencePair, PromptRow
from verl_fast.data.readers import ground_truth
from verl_fast.rewards import verl_managers
from verl_fast.rewards.interface import CallableReward, RewardFunction
from verl_fast.rewards.by_source import DataSourceReward, check_source
from verl_fast.rewards.rule import GSM8KReward, ReasoningGymReward

FIRST_ROWS = 8


def where(source: Any, index: int) -> str:
    """``file.jsonl:line`` for a JSONL file, else ``<source> row <index>``."""
    if isinstance(source, (str, Path)) and str(source).endswith(".jsonl") and Path(source).is_file():
        with open(source) as f:
            seen = -1
            for number, line in enumerate(f, start=1):
                seen += bool(line.strip())
                if seen == index:
                    return f"{source}:{number}"
    name = source if isinstance(source, (str, Path)) else "the dataset"
    return f"{name} row {index}"


def check_rows(rows: Sequence[Any], source: Any, preference: bool) -> None:
    """Prompt rows (or preference rows) in a form the trainer reads."""
    for i, row in enumerate(rows[:FIRST_ROWS]):
        if preference:
            try:
                preference_parts(row)
            except ValueError as e:
                raise ValueError(f"{where(source, i)}: {e}") from None
            continue
        if not isinstance(row, dict) or "prompt" not in row:
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{where(source, i)}: a row needs a 'prompt' column (text or chat messages), got {got}")
        prompt = row["prompt"]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt))):
            raise ValueError(f"{where(source, i)}: prompt must be a text or a list of chat messages "
                             f"({{'role': ..., 'content': ...}}), got {str(prompt)[:80]!r}")


def check_reward(parts: Sequence[tuple], rows: Sequence[Any], source: Any) -> None:
    """``parts``: (name, reward function) pairs, as the run scores with them."""
    rows = [r for r in rows[:FIRST_ROWS] if isinstance(r, dict)]
    for name, reward in parts:
        for i, row in enumerate(rows):
            _check_one(name, reward, row, where(source, i))


def _check_one(name: str, reward: RewardFunction, row: Dict[str, Any], at: str) -> None:
    if isinstance(reward, DataSourceReward):
        check_source(str(row.get("data_source", "")), f"{at} (reward_fn.type=auto)")
    elif isinstance(reward, CallableReward):
        missing = reward.missing(list(row))
        if missing:
            raise ValueError(f"{at}: reward function {reward.name} needs {', '.join(map(repr, missing))}, which the "
                             f"row does not have (its columns: {', '.join(sorted(row))})")
    elif isinstance(reward, ReasoningGymReward):
        truth = ground_truth(row)
        if not (isinstance(truth, dict) and isinstance(truth.get("metadata"), dict)
                and "source_dataset" in truth["metadata"]):
            raise ValueError(f"{at}: reward_fn.type=reasoning_gym needs the reasoning-gym entry as the ground "
                             "truth (reward_model.ground_truth with metadata.source_dataset); for other data set "
                             "reward_fn.type=auto or a reward function")
    elif isinstance(reward, GSM8KReward) and ground_truth(row) is None:
        raise ValueError(f"{at}: reward_fn.type=gsm8k needs a ground truth (reward_model.ground_truth, "
                         "ground_truth or answer)")


def config_parts(reward_cfg: Any) -> List[tuple]:
    """The reward functions a reward_fn section names, built where that is cheap (a reward model is
    not loaded here: it is checked when it loads)."""
    cheap = {"auto": DataSourceReward, "reasoning_gym": ReasoningGymReward, "gsm8k": GSM8KReward}
    parts = []
    for i, entry in enumerate(config_mod.reward_functions(reward_cfg)):
        if entry.type in cheap:
            parts.append((entry.name or entry.type, cheap[entry.type]()))
        elif entry.type == "callable":
            try:
                parts.append((entry.name or entry.path, verl_managers.callable_reward(entry.path, entry.manager,
                                                                                       entry.kwargs)))
            except (TypeError, ImportError, OSError, SyntaxError) as e:
                raise ValueError(f"reward_fn.path={entry.path}: {' '.join(str(e).split())}") from None
    return parts


def built_parts(reward: Optional[Any]) -> List[tuple]:
    """The (name, reward function) pairs of a built reward (``rewards.WeightedRewards``)."""
    return [(name, guarded.inner) for name, _, guarded in getattr(reward, "parts", [])]


def check(cfg: config_mod.Config, rows: Sequence[Any], source: Any, reward: Optional[Any] = None) -> None:
    """Everything above for a run of ``cfg`` on ``rows`` (read from ``source``); ``reward``: the
    built reward (else the config's reward functions)."""
    if rows and not isinstance(rows[0], dict):
        return  # prepared items (PromptRow / PreferencePair, from a .pt): the trainer checks their type
    items = algorithms.spec(cfg).item_type
    if items not in (PromptRow, PreferencePair):
        return  # rows read by their algorithm's own loader (sft_data, algos/kto), which names the row; no reward
    preference = items is PreferencePair  # dpo and the reference-free pair losses
    check_rows(rows, source, preference)
    if preference:
        return  # DPO scores nothing: the pairs carry their ranking
    check_reward(built_parts(reward) if reward is not None else config_parts(cfg.reward_fn), rows, source)
