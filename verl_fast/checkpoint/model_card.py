"""The model card (``README.md``) of every HF export: what was trained from what (the config), on
which data, the final metrics and the reward curve, with the Hub's metadata header, built from the
trainer state a checkpoint holds (``{"step", "history", "config", ...}``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

from verl_fast.files import hub

CARD = "README.md"
_BARS = "▁▂▃▄▅▆▇█"
_CURVE_ROWS = 20  # the reward table's rows at most (evenly spaced steps, the last one always)


def reward_key(history: List[Dict[str, Any]]) -> str:
    """The curve's metric: the mean reward, or DPO's reward margin when no step has a reward."""
    return "reward/mean" if any("reward/mean" in h for h in history) or not history else "dpo/reward_margin"


def sparkline(values: List[float]) -> str:
    """One bar per value, scaled between the smallest and the largest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low
    return "".join(_BARS[0 if span == 0 else round((v - low) / span * (len(_BARS) - 1))] for v in values)


def _hub_name(name: Any) -> bool:
    return isinstance(name, str) and "/" in name and hub.is_repo_id(name) and not os.path.exists(name)


def render(state: Dict[str, Any]) -> str:
    cfg: Dict[str, Any] = state.get("config") or {}
    actor, trainer, algorithm = cfg.get("actor", {}), cfg.get("trainer", {}), cfg.get("algorithm", {})
    history: List[Dict[str, Any]] = list(state.get("history") or [])
    step = int(state.get("step", len(history)))
    model, dataset = actor.get("model_name"), trainer.get("dataset")
    name = trainer.get("run_name") or Path(str(trainer.get("output_dir", "run"))).name
    header = ["---", "library_name: transformers", "tags:", "- verl_fast", f"- {algorithm.get('type', 'rl')}",
              "- reinforcement-learning"]
    if _hub_name(model):
        header.append(f"base_model: {model}")
    if _hub_name(dataset):
        header += ["datasets:", f"- {dataset}"]
    lines = header + ["---", "", f"# {name}", "",
                      f"Trained with verl_fast ({algorithm.get('type', '?')}) for {step} steps from "
                      f"`{model}`.", "", "## Data", "",
                      f"- dataset: `{dataset}`" + (f", with `{json.dumps(trainer.get('dataset_kwargs'))}`"
                                                   if trainer.get("dataset_kwargs") else ""),
                      f"- {trainer.get('train_batch_size')} prompts per step, "
                      f"{cfg.get('rollout', {}).get('n')} samples each; reward: "
                      f"`{cfg.get('reward_fn', {}).get('type')}`", ""]
    final = history[-1] if history else {}
    numbers = {k: v for k, v in final.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    lines += [f"## Final metrics (step {final.get('step', step)})", ""]
    if numbers:
        lines += ["| metric | value |", "|---|---|"] + [f"| {k} | {v:.6g} |" for k, v in sorted(numbers.items())]
    else:
        lines.append("No step was logged.")
    key = reward_key(history)
    points = [(h.get("step", i + 1), float(h[key])) for i, h in enumerate(history) if key in h]
    lines += ["", f"## Reward curve ({key})", ""]
    if points:
        every = max(1, -(-len(points) // _CURVE_ROWS))
        shown = points[::every] if points[::every][-1] == points[-1] else points[::every] + [points[-1]]
        lines += [f"`{sparkline([v for _, v in points])}` {points[0][1]:.4g} -> {points[-1][1]:.4g}", "",
                  f"| step | {key} |", "|---|---|"] + [f"| {s} | {v:.4g} |" for s, v in shown]
    else:
        lines.append("No reward was logged.")
    import yaml

    lines += ["", "## Config", "", "```yaml", yaml.safe_dump(cfg, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def write(folder: Path, state: Dict[str, Any]) -> Path:
    """``folder/README.md`` from ``state``; returns its path."""
    path = Path(folder) / CARD
    path.write_text(render(state), encoding="utf-8")
    return path
