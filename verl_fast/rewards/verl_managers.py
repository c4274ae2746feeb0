"""A custom reward function as verl's reward managers call it (``reward_fn.manager``, verl's
``reward_model.reward_manager``), with verl's ``custom_reward_function.reward_kwargs`` (``reward_fn.kwargs``)
passed on every call:

- ``naive`` and ``dapo``: one call per sample, ``compute_score(data_source, solution_str, ground_truth,
  extra_info, **kwargs)``; a dict result's ``score`` is the reward and its other numeric keys are logged.
  DAPO's overlong penalty is ``algorithm.overlong_buffer`` here (verl's dapo manager adds it to the score).
- ``batch``: one call per batch, ``compute_score(data_sources, solution_strs, ground_truths, extra_infos,
  **kwargs)`` returning one score (or dict) per sample.
- ``prime``: per sample as ``naive``; a sample whose scoring raises scores 0 (verl's prime manager runs each
  sample in a process pool and scores failures and timeouts 0): ``reward_fn.on_error`` zero.

The reward file is loaded with ``verl.utils.reward_score`` served where verl is absent (``verl_shim``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Sequence

from verl_fast.rewards import verl_shim
from verl_fast.rewards.interface import CallableReward, RewardInput, load_callable

MANAGERS = ("naive", "dapo", "batch", "prime")


def _batched(fn: Callable[..., Any], kwargs: Dict[str, Any]) -> Callable[[Sequence[RewardInput]], Any]:
    def samples_call(samples: Sequence[RewardInput]) -> Any:
        return fn(data_sources=[s.data_source for s in samples], solution_strs=[s.response for s in samples],
                  ground_truths=[s.ground_truth for s in samples], extra_infos=[s.extra_info for s in samples],
                  **kwargs)

    samples_call.__name__ = getattr(fn, "__name__", "compute_score")
    return samples_call


def callable_reward(path: str, manager: str = "naive", kwargs: Dict[str, Any] = None) -> CallableReward:
    """The function ``path`` names, called as ``manager`` calls it, ``kwargs`` given each call."""
    with verl_shim.loading_user_code():
        fn = load_callable(path)
    kwargs = dict(kwargs or {})
    if manager == "batch":
        return CallableReward(_batched(fn, kwargs))
    if not kwargs:
        return CallableReward(fn)
    reward = CallableReward(functools.partial(fn, **kwargs))  # the bound parameters then have defaults
    reward.name = getattr(fn, "__name__", reward.name)
    return reward


def check(manager: str, reward_type: str, key: str) -> List[str]:
    """The config problems of ``manager`` with a reward of ``reward_type``."""
    if manager == "batch" and reward_type != "callable":
        return [f"{key}.manager=batch (verl's reward_manager=batch) calls a batched function: set "
                f"{key}.type=callable with {key}.path (verl: custom_reward_function.path)"]
    return []
