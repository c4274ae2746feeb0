"""One section read from a mapping and its values checked against their fields (type, finiteness,
range, choices): ``read_section`` / ``check_value``, for the config's sections and those other modules
declare with ``option()``; and the reward functions a ``reward_fn`` section names."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Dict, List, Tuple, Union

from verl_fast.config.choices import Choices
from verl_fast.config.schema import RewardConfig

FLOAT32_MAX = 3.4028234663852886e38


def check_value(value: Any, annotation: Any, meta: Dict[str, Any], key: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Union and type(None) in args:
        if value is None:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) > 1:  # e.g. a path or a list of paths: the first kind the value is
            for kind in kinds[1:]:
                try:
                    return check_value(value, kind, meta, key)
                except ValueError:
                    pass
        annotation = kinds[0]
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):  # a section within a section (actor.lora)
        return read_section(annotation, dataclasses.asdict(value) if isinstance(value, annotation) else value, key)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"{key} must fit in int64, got {value!r}")
    elif annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):  # NaN passes every range check below
            raise ValueError(f"{key} must be a finite number, got {value!r}")
        if abs(value) > FLOAT32_MAX:  # the trainer's tensors are float32 (or narrower): inf there
            raise ValueError(f"{key} must be within float32's range (|x| <= 3.4e38), got {value!r}")
    elif annotation is str:
        choices = meta.get("choices") or ()
        if isinstance(value, bool) and ("off" if not value else "on") in choices:
            value = "on" if value else "off"  # YAML 1.1 reads a bare off / on as a boolean
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
    elif origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
    elif origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list, got {value!r}")
        return [check_value(v, args[0], meta, f"{key}[{i}]") for i, v in enumerate(value)]
    choices = meta.get("choices")
    # a Choices no module has filled yet is checked where its value is looked up
    if choices is not None and (len(choices) or not isinstance(choices, Choices)) and value not in choices:
        raise ValueError(f"{key} must be one of {list(meta['choices'])}, got {value!r}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ValueError(f"{key} must be >= {meta['min']}, got {value!r}")
    if meta.get("above") is not None and value <= meta["above"]:
        raise ValueError(f"{key} must be > {meta['above']}, got {value!r}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ValueError(f"{key} must be <= {meta['max']}, got {value!r}")
    return value


# reward_fn.type whose reward is the weighted sum of reward_fn.functions (a list under reward_fn)
WEIGHTED_REWARD = "weighted"


def reward_functions(r: RewardConfig) -> List[RewardConfig]:
    """The reward functions a reward_fn section names: itself, or (type weighted) each of its
    ``functions``, checked as a reward_fn section (``on_error`` / ``timeout_s`` default to the
    section's)."""
    if r.type != WEIGHTED_REWARD:
        return [r]
    if not r.functions:
        raise ValueError(f"reward_fn.type={WEIGHTED_REWARD} needs reward_fn.functions (a list of reward functions)")
    out = []
    for i, entry in enumerate(r.functions):
        key = f"reward_fn[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{key} must be a mapping (type, path, weight, name, ...), got {entry!r}")
        if entry.get("type") == WEIGHTED_REWARD or "functions" in entry:
            raise ValueError(f"{key}: a reward function in the list cannot hold functions of its own")
        out.append(read_section(RewardConfig, {"on_error": r.on_error, "timeout_s": r.timeout_s, **entry}, key))
    return out


def keyed_reward_functions(r: RewardConfig) -> List[Tuple[str, RewardConfig]]:
    """``reward_functions(r)``, each with the key that names it in messages (``reward_fn``, or
    ``reward_fn[i]`` for a weighted section's functions)."""
    entries = reward_functions(r)
    several = len(entries) > 1 or r.type == WEIGHTED_REWARD
    return [(f"reward_fn[{i}]" if several else "reward_fn", e) for i, e in enumerate(entries)]


def read_section(cls, data: Any, name: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"{name} must be a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in fields:
            raise ValueError(f"unknown key {name}.{key}; allowed keys in {name}: {sorted(fields)}")
        values[key] = check_value(value, hints[key], dict(fields[key].metadata), f"{name}.{key}")
    return cls(**values)
