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
            return scores_of(self.fn(list(samples)), len(samples), self.name)
        return [_as_score(self.fn(**{a: _PER_SAMPLE_ARGS[a](s) for a in self.args}), self.name) for s in samples]


def scores_of(out: Any, n: int, name: str) -> List[float]:
    """A batch reward's result as n finite floats (a list, tuple, numpy array or 1-D tensor)."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise TypeError(f"reward function {name} scored a batch of {n} samples and must return one score per "
                        f"sample (a list of {n} numbers), got {type(out).__name__}")
    if len(out) != n:
        raise ValueError(f"reward function {name} returned {len(out)} scores for {n} samples")
    return [_as_score(x, name) for x in out]


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


ON_ERROR = ("raise", "zero")


class GuardedReward(RewardFunction):
    """Checks what ``inner`` returns (one finite float per sample) and applies ``on_error``:
    ``"raise"`` lets a failure through; ``"zero"`` scores 0 for each sample whose scoring fails (a
    failing batch is scored again one sample at a time to find them), so that one bad sample does
    not stop a long run. ``last_errors`` counts the zeroed samples of the latest call."""

    def __init__(self, inner: RewardFunction, on_error: str = "raise"):
        if on_error not in ON_ERROR:
            raise ValueError(f"reward_fn.on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
        self.inner, self.on_error = inner, on_error
        self.name = getattr(inner, "name", type(inner).__name__)
        self.last_errors = 0

    def _score(self, samples: Sequence[RewardInput]) -> List[float]:
        return scores_of(self.inner(samples), len(samples), self.name)

    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        self.last_errors = 0
        if self.on_error == "raise":
            return self._score(samples)
        try:
            return self._score(samples)
        except Exception:  # noqa: BLE001 - on_error=zero: any failure of the user's scorer
            if len(samples) == 1:
                self.last_errors = 1
                return [0.0]
        out = []
        for s in samples:
            try:
                out.extend(self._score([s]))
            except Exception:  # noqa: BLE001
                self.last_errors += 1
                out.append(0.0)
        return out


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
