"""The reward interface: a batch of (prompt, response, ground truth, dataset columns) in, one float per
sample out (NaN where a function said None: not applicable); user callables with verl's per-sample
signature or TRL's batch signature are wrapped."""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from verl_fast.rewards import deadline


@dataclass
class RewardInput:
    prompt: str
    response: str
    ground_truth: Any = None
    data_source: str = ""
    extra_info: Dict[str, Any] = field(default_factory=dict)
    columns: Dict[str, Any] = field(default_factory=dict)  # every field of the dataset row, as given
    completion_ids: Optional[List[int]] = None  # the response's token ids (TRL's completion_ids)
    trainer_state: Any = None  # the run's TrainerState when a trainer scores (TRL's trainer_state)
    images: Optional[Tuple[Any, ...]] = None  # the prompt's images (RGB PIL) when it has any


@dataclass
class TrainerState:
    """What TRL's reward functions read of ``trainer_state``: the optimiser steps done so far (0 while the
    first step scores, as TRL's ``global_step``) and the run's length."""

    global_step: int = 0
    max_steps: Optional[int] = None


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


# the arguments TRL's trainer gives every reward function itself (by keyword), beside the dataset's columns
TRL_ARGS = ("prompts", "completions", "completion_ids", "trainer_state")
# dataset columns TRL does not pass on (the prompt arrives as prompts)
_TRL_HELD = ("prompt", "completion")


def _takes_trl_signature(params: Dict[str, inspect.Parameter]) -> bool:
    """TRL's reward contract: a function that names any of ``TRL_ARGS`` (``f(completions, **kwargs)``,
    ``f(prompts, completions, solution, **kwargs)``, ...) is called once per batch, by keyword."""
    return any(name in params and params[name].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                            inspect.Parameter.VAR_KEYWORD) for name in TRL_ARGS)


class CallableReward(RewardFunction):
    """Wraps a user function, by its signature:

    - TRL's contract, a function naming any of ``prompts``, ``completions``, ``completion_ids``,
      ``trainer_state`` (``-> list[float | None]``): one call per batch, every argument by keyword:
      the prompts as the dataset gave them, the completions (chat messages, ``[{"role": "assistant",
      "content": ...}]``, when the prompt is a list of messages, as TRL's conversational format; else
      strings), the response token ids, a TrainerState, and every other dataset column as a list
      (``ground_truth`` too) — those the function names, or all with ``**kwargs``; None for a sample
      means not applicable; ``images``: each prompt's images as RGB PIL images (None for a text prompt);
    - verl's per-sample signature: any subset of ``data_source``, ``solution_str``/``response``,
      ``ground_truth``, ``extra_info``, ``prompt`` (the templated text), by keyword, plus the row's
      other columns it names (all of them with ``**kwargs``; ``images`` as the TRL contract gives them);
    - a batch function taking one argument named ``samples`` (RewardInput objects).

    A score may be a float, None (not applicable: NaN, left out of the weighted sum) or a dict with a
    ``score`` key, whose other numeric keys are kept in ``last_extras`` (key -> the values of the
    samples that returned it) for the metrics."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.name = getattr(fn, "__name__", type(fn).__name__)
        params = dict(inspect.signature(fn).parameters)
        self.batched = list(params) == ["samples"]
        self.trl = _takes_trl_signature(params)
        self.accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.params = set(params)
        self.required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                         and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        self.args = [a for a in _PER_SAMPLE_ARGS if self.accepts_any or a in params]
        self.last_extras: Dict[str, List[float]] = {}
        if not (self.batched or self.trl or self.args):
            raise TypeError(f"reward function {self.name} must take keyword arguments among "
                            f"{list(_PER_SAMPLE_ARGS)} (verl's compute_score signature), among {list(TRL_ARGS)} "
                            "and the dataset's columns (TRL's) or one argument named 'samples'")

    def missing(self, columns: Sequence[str]) -> List[str]:
        """The required parameters that neither the call nor a dataset column with these names fills."""
        if self.batched:
            return []
        given = set(columns) | {"ground_truth", "images"} | set(TRL_ARGS if self.trl else _PER_SAMPLE_ARGS)
        if self.trl:
            given -= set(_TRL_HELD)
        return [n for n in self.required if n not in given]

    def _wanted(self, key: str) -> bool:
        return self.accepts_any or key in self.params

    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        self.last_extras = {}
        if self.batched:
            return self._kept(scores_of(self.fn(list(samples)), len(samples), self.name, raw=True))
        if self.trl:
            return self._kept(scores_of(self._call_trl(samples), len(samples), self.name, raw=True))
        outs = []
        for s in samples:
            kwargs = {a: _PER_SAMPLE_ARGS[a](s) for a in self.args}
            if s.images is not None and self._wanted("images"):
                kwargs["images"] = list(s.images)
            kwargs.update({k: v for k, v in s.columns.items() if k not in kwargs and self._wanted(k)})
            outs.append(self.fn(**kwargs))
        return self._kept(outs)

    def _call_trl(self, samples: Sequence[RewardInput]) -> Any:
        prompts = [s.columns.get("prompt", s.prompt) for s in samples]
        chat = bool(prompts) and all(isinstance(p, list) for p in prompts)
        given: Dict[str, Any] = {
            "prompts": prompts,
            "completions": [[{"role": "assistant", "content": s.response}] if chat else s.response for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "trainer_state": samples[0].trainer_state if samples else None,
        }
        for k in sorted({k for s in samples for k in s.columns} - set(_TRL_HELD) - set(TRL_ARGS)):
            given[k] = [s.columns.get(k) for s in samples]
        given.setdefault("ground_truth", [s.ground_truth for s in samples])
        if any(s.images is not None for s in samples):  # decoded, in place of the column's raw values
            given["images"] = [None if s.images is None else list(s.images) for s in samples]
        return self.fn(**{k: v for k, v in given.items() if self._wanted(k)})

    def _kept(self, outs: Sequence[Any]) -> List[float]:
        """The scores of ``outs``; the extra numeric keys of dict results go to ``last_extras``."""
        # None (not applicable) stays None: GuardedReward makes it NaN, which only None may be
        scores = [None if x is None else _as_score(x, self.name, i) for i, x in enumerate(outs)]
        for x in outs:
            if isinstance(x, dict):
                for k, v in x.items():
                    if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v)):
                        self.last_extras.setdefault(str(k), []).append(float(v))
        return scores


def scores_of(out: Any, n: int, name: str, first: int = 0, raw: bool = False) -> List[Any]:
    """A batch reward's result as n finite floats (a list, tuple, numpy array or 1-D tensor);
    ``first``: the batch's first sample index, for messages; ``raw``: the n results as returned
    (their count checked only)."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise TypeError(f"reward function {name} scored a batch of {n} samples and must return one score per "
                        f"sample (a list of {n} numbers), got {type(out).__name__}")
    if len(out) != n:
        raise ValueError(f"reward function {name} returned {len(out)} scores for {n} samples")
    if raw:
        return list(out)
    return [_as_score(x, name, first + i) for i, x in enumerate(out)]


def _as_score(x: Any, name: str, index: int) -> float:
    """A score as a finite float: a real number (bools, numpy numbers and one-element tensors
    included), or a dict whose 'score' is one; never a string, which float() would also parse.
    None is "not applicable" (TRL's rule): NaN, which the weighted sum leaves out."""
    if x is None:
        return math.nan
    if isinstance(x, dict):
        x = x.get("score")
    if _one_element(x):
        x = x.item()
    if not isinstance(x, numbers.Real):
        raise TypeError(f"reward function {name} must return a number (or a dict with 'score') for each sample, "
                        f"got {_short(x)} for sample {index}")
    try:
        value = float(x)
    except OverflowError:
        raise ValueError(f"reward function {name} returned {_short(x)} for sample {index}, which overflows a "
                         "float") from None
    if not math.isfinite(value):
        raise ValueError(f"reward function {name} returned a non-finite score {value} for sample {index}")
    if abs(value) > _FLOAT32_MAX:  # the trainer's rewards are float32 tensors: inf there
        raise ValueError(f"reward function {name} returned {value:g} for sample {index}, beyond float32's range "
                         "(|score| <= 3.4e38) in which the trainer keeps rewards")
    return value


_FLOAT32_MAX = 3.4028234663852886e38


def _one_element(x: Any) -> bool:
    """A one-element torch tensor, numpy array or numpy scalar (its ``.item()`` is the score)."""
    numel = getattr(x, "numel", None)
    if callable(numel):
        return numel() == 1
    return getattr(x, "size", None) == 1 and hasattr(x, "item")


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


ON_ERROR = ("raise", "zero")


class GuardedReward(RewardFunction):
    """Checks what ``inner`` returns (one finite float per sample) and applies ``on_error``:
    ``"raise"`` lets a failure through; ``"zero"`` scores 0 for each sample whose scoring fails (a
    failing batch is scored again one sample at a time to find them), so that one bad sample does
    not stop a long run. ``last_errors`` counts the zeroed samples of the latest call. The whole
    batch runs under ``timeout_s`` and stop requests (``rewards.deadline``): a timeout, a stop, or
    SystemExit / KeyboardInterrupt in the scorer are never zeroed."""

    def __init__(self, inner: RewardFunction, on_error: str = "raise", timeout_s: Optional[float] = None):
        if on_error not in ON_ERROR:
            raise ValueError(f"reward_fn.on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
        self.inner, self.on_error, self.timeout_s = inner, on_error, timeout_s
        self.name = getattr(inner, "name", type(inner).__name__)
        self.last_errors = 0
        self._extras: Dict[str, List[float]] = {}

    @property
    def last_extras(self) -> Dict[str, float]:
        """The mean of each extra numeric key the scorer's dict results held in the latest call."""
        return {k: sum(v) / len(v) for k, v in self._extras.items() if v}

    def _score(self, samples: Sequence[RewardInput], first: int = 0) -> List[float]:
        scores = scores_of(self.inner(samples), len(samples), self.name, first)
        for k, v in getattr(self.inner, "last_extras", {}).items():  # only of calls that scored
            self._extras.setdefault(k, []).extend(v)
        return scores

    def __call__(self, samples: Sequence[RewardInput], stop: Optional[threading.Event] = None) -> List[float]:
        """The batch's scores; ``stop``: set by the trainer's first SIGTERM / Ctrl-C."""
        return deadline.score(lambda: self._guarded(samples), self.name, len(samples), self.timeout_s, stop)

    def _guarded(self, samples: Sequence[RewardInput]) -> List[float]:
        self.last_errors, self._extras = 0, {}
        if self.on_error == "raise":
            return self._score(samples)
        try:
            return self._score(samples)
        except Exception:  # noqa: BLE001 - on_error=zero: any failure of the user's scorer
            if len(samples) == 1:
                self.last_errors = 1
                return [0.0]
        out = []
        for i, s in enumerate(samples):
            try:
                out.extend(self._score([s], i))
            except Exception:  # noqa: BLE001
                self.last_errors += 1
                out.append(0.0)
        return out


def as_reward_function(obj: Any) -> RewardFunction:
    if isinstance(obj, RewardFunction):
        return obj
    if hasattr(obj, "parameters") and hasattr(obj, "forward"):  # a torch module: calling it is not scoring
        raise TypeError(f"reward_fn got a {type(obj).__name__}, a model that is not a transformers "
                        "...ForSequenceClassification one: load the reward model with "
                        "AutoModelForSequenceClassification (num_labels=1) or wrap it in a RewardFunction")
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
