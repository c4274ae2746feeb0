"""The reward interface: a batch of (prompt, response, ground truth) in, one float per sample out."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence


@dataclass
class RewardInput:
    prompt: str
    response: str
    ground_truth: Any = None
    data_source: str = ""
    extra_info: Dict[str, Any] = field(default_factory=dict)


class RewardFunction:
    """Scores a batch. Subclass it for batched scorers (reward models); plain callables are wrapped."""

    name: str = "reward"

    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        raise NotImplementedError


# verl's custom reward signature: compute_score(data_source, solution_str, ground_truth, extra_info)
_PER_SAMPLE_ARGS = {
    "data_source": lambda s: s.data_source,
    "solution_str": lambda s: s.response,
    "response": lambda s: s.response,
    "ground_truth": lambda s: s.ground_truth,
    "extra_info": lambda s: s.extra_info,
    "prompt": lambda s: s.prompt,
}


class CallableReward(RewardFunction):
    """Wraps a per-sample function with verl's signature (any subset of ``data_source``,
    ``solution_str``/``response``, ``ground_truth``, ``extra_info``, ``prompt``, by keyword), or a
    batch function taking one argument named ``samples``. The result may be a float or a dict with
    a ``score`` key (extra keys are ignored)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.name = getattr(fn, "__name__", type(fn).__name__)
        params = inspect.signature(fn).parameters
        self.batched = list(params) == ["samples"]
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.args = [a for a in _PER_SAMPLE_ARGS if accepts_any or a in params]
        if not self.batched and not self.args:
            raise TypeError(f"reward function {self.name} must take keyword arguments among "
                            f"{list(_PER_SAMPLE_ARGS)} (verl's compute_score signature) or one named 'samples'")

    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        if self.batched:
            out = [_as_score(x, self.name) for x in self.fn(list(samples))]
        else:
            out = [_as_score(self.fn(**{a: _PER_SAMPLE_ARGS[a](s) for a in self.args}), self.name) for s in samples]
        if len(out) != len(samples):
            raise ValueError(f"reward function {self.name} returned {len(out)} scores for {len(samples)} samples")
        return out


def _as_score(x: Any, name: str) -> float:
    if isinstance(x, dict):
        x = x.get("score")
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"reward function {name} must return a number (or a dict with 'score'), got {x!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"reward function {name} returned a non-finite score {value}")
    return value


def as_reward_function(obj: Any) -> RewardFunction:
    if isinstance(obj, RewardFunction):
        return obj
    if callable(obj):
        return CallableReward(obj)
    raise TypeError(f"reward_fn must be a RewardFunction or a callable, got {type(obj).__name__}")


def load_callable(path: str) -> Callable[..., Any]:
    """``'package.module:function'`` (or a file path ``'dir/file.py:function'``) -> the function."""
    if ":" not in path:
        raise ValueError(f"reward_fn.path must look like 'module:function', got {path!r}")
    module_name, attr = path.rsplit(":", 1)
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("verl_fast_user_reward", module_name)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load reward module file {module_name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name} has no attribute {attr!r} (from reward_fn.path={path!r})") from None
