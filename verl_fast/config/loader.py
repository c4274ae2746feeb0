"""A Config from a YAML file, a mapping or Python objects: ``load`` (with ``section.key=value``
overrides), ``from_dict``, ``checked``; and the embedded default run's path."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from verl_fast.config.schema import Config
from verl_fast.config.sections import WEIGHTED_REWARD, check_value, read_section
from verl_fast.config.rules import _apply_aliases, _apply_beta, _apply_rollout_correction, validate


def checked(cfg: Config) -> Config:
    """A Config built in Python (not from YAML or a dict) checked as from_dict checks one: every
    field's type, finiteness and range, then the combinations."""
    if not isinstance(cfg, Config):
        raise TypeError(f"config must be a Config, a mapping of sections or None, got {type(cfg).__name__}")
    hints = typing.get_type_hints(Config)
    for name in hints:
        section = getattr(cfg, name)
        if not isinstance(section, hints[name]):
            raise ValueError(f"{name} must be a {hints[name].__name__}, got {type(section).__name__}")
        types = typing.get_type_hints(hints[name])
        for f in dataclasses.fields(section):
            value = check_value(getattr(section, f.name), types[f.name], dict(f.metadata), f"{name}.{f.name}")
            setattr(section, f.name, value)
    _apply_beta(cfg)
    _apply_rollout_correction(cfg)
    validate(cfg)
    return cfg


def from_dict(data: Optional[Dict[str, Any]]) -> Config:
    data = dict(data or {})
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(f"unknown section {unknown[0]!r}; allowed sections: {sorted(sections)}")
    if isinstance(data.get("reward_fn"), list):  # several reward functions, each named and weighted
        data["reward_fn"] = {"type": WEIGHTED_REWARD, "functions": data["reward_fn"]}
    hints = typing.get_type_hints(Config)
    cfg = Config(**{name: read_section(hints[name], data.get(name), name) for name in sections})
    _apply_aliases(cfg)
    validate(cfg)
    return cfg


def load(path: Union[str, Path], overrides: Optional[List[str]] = None) -> Config:
    """A YAML file plus ``section.key=value`` overrides (values parsed as YAML)."""
    from verl_fast.config import yaml_files

    data = yaml_files.load_file(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping of sections")
    return from_dict(apply_overrides(data, overrides or []))


def apply_overrides(data: Dict[str, Any], overrides: List[str]) -> Dict[str, Any]:
    """``section.key=value`` items applied to a copy of ``data``; the dotted key may go any depth
    into mapping values (``trainer.dataset_kwargs.size=10``). Values are parsed as YAML; an empty
    value is null."""
    import copy

    from verl_fast.config import yaml_files

    data = copy.deepcopy(data)
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        parts = dotted.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. actor.lr=1e-5)")
        value = yaml_files.loads(raw, f"override {item!r}") if raw != "" else None
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:  # an empty YAML section (``trainer:``) or a null mapping value
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ValueError(f"override {item!r}: {where} is {child!r}, not a mapping of keys")
            node = child
        node[parts[-1]] = value
    return data


def default_config_path() -> Path:
    """The embedded default run: GRPO on SmolLM2-135M-Instruct with reasoning-gym chain_sum."""
    return Path(__file__).resolve().parent.parent / "presets" / "default.yaml"
