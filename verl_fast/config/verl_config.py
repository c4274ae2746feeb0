"""verl's configuration tree read as ours: ``ppo_trainer.yaml``'s layout (``actor_rollout_ref.{model,
actor,rollout,ref}``, ``data``, ``algorithm``, ``critic``, ``reward_model``, ``custom_reward_function``,
``trainer``, ...) in a YAML file or as ``key=value`` overrides (Hydra's ``+key=value`` too), beside
or instead of our own sections.

Every key is looked up once: our own key as it is; verl's key through the table in
``verl_fast.config.verl_keys`` (verl's units converted: mini-batches in prompts x rollout.n, micro-batches per
GPU, epochs or steps, ...), or noted in one line when it has no meaning here; anything else is unknown,
with the closest key named. Every problem of the config is reported at once, one line each
(``ConfigProblems``), before the combination checks of ``config.validate``. Values may use verl's
interpolations (``${key}``, ``${oc.select:key,default}``, ``${.sibling}``).

``python -m verl_fast.config.verl_config --markdown`` prints the table of verl keys (docs/verl_and_trl.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from verl_fast import config as config_mod
from verl_fast.config.verl_keys import KEYS, SKIP, R, VerlKey

EXACT: Dict[str, VerlKey] = {k.verl: k for k in KEYS if not k.subtree}
SUBTREES: Dict[str, VerlKey] = {k.verl: k for k in KEYS if k.subtree}
HIDDEN = ("_target_",)  # Hydra's instantiation marker: not a setting


class ConfigProblems(ValueError):
    """Everything wrong with a config, one line each."""

    def __init__(self, lines: List[str]):
        self.lines = lines
        super().__init__("\n".join(lines))


def native_keys() -> Dict[str, Tuple[type, Any, Dict[str, Any]]]:
    """Our dotted keys -> (section class, type hint, field metadata)."""
    out = {}
    for section in dataclasses.fields(config_mod.Config):
        cls = typing.get_type_hints(config_mod.Config)[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[f"{section.name}.{f.name}"] = (cls, hints[f.name], dict(f.metadata))
    return out


NATIVE = native_keys()
SECTIONS = {k.split(".")[0] for k in NATIVE}


def _covering(key: str) -> Optional[VerlKey]:
    """The deepest subtree entry that ``key`` lies in (or is)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        entry = SUBTREES.get(".".join(parts[:n]))
        if entry is not None:
            return entry
    return None


def _native_leaf(key: str, value: Any) -> bool:
    """Whether ``key`` is one of ours holding ``value`` whole: a mapping only where ours takes one
    (``algorithm.rollout_correction`` is our switch, and verl's section of the same name)."""
    if key not in NATIVE:
        return False
    hint = NATIVE[key][1]
    takes_mapping = hint is dict or typing.get_origin(hint) is dict or dict in typing.get_args(hint) or any(
        typing.get_origin(a) is dict for a in typing.get_args(hint))
    return not isinstance(value, dict) or takes_mapping


def _has_keys_under(key: str) -> bool:
    prefix = key + "."
    return any(k.startswith(prefix) for k in EXACT) or any(k.startswith(prefix) for k in NATIVE)


def _leaves(node: Dict[str, Any], path: str, out: Dict[str, Any], full: bool) -> None:
    """The config's keys, dotted: down to our keys, verl's exact keys and (``full=False``) the
    subtrees noted whole; ``full``: every leaf (what interpolations may name)."""
    for k, v in node.items():
        key = f"{path}.{k}" if path else str(k)
        if k in HIDDEN:
            continue
        stop = _native_leaf(key, v) or key in EXACT or (not full and _covering(key) is not None
                                                        and not _has_keys_under(key))
        if isinstance(v, dict) and v and not stop:
            _leaves(v, key, out, full)
        else:
            out[key] = v


_INTERPOLATION = re.compile(r"\$\{(?:oc\.select:)?\s*([^,}]+?)\s*(?:,\s*([^}]*))?\}")


class _Values:
    """The config's leaves, with verl's interpolations resolved on reading."""

    def __init__(self, data: Dict[str, Any]):
        self.flat: Dict[str, Any] = {}
        _leaves(data, "", self.flat, full=True)

    def get(self, key: str, default: Any = None, depth: int = 0) -> Any:
        if key not in self.flat or self.flat[key] is None:
            return default
        return self.resolve(key, self.flat[key], depth)

    def resolve(self, key: str, value: Any, depth: int = 0) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value
        if depth > 16:
            raise ValueError(f"{key}: interpolations nest more than 16 deep (a cycle?)")

        def one(m: "re.Match[str]") -> Any:
            ref, default = m.group(1), m.group(2)
            if ref.startswith("."):
                ref = key.rsplit(".", 1)[0] + ref
            if ref in self.flat:
                return self.get(ref, None, depth + 1)
            if default is not None:
                import yaml

                return yaml.safe_load(default)
            raise ValueError(f"{key}: {m.group(0)} names no key of the config")

        whole = _INTERPOLATION.fullmatch(value.strip())
        if whole:
            return one(whole)
        return _INTERPOLATION.sub(lambda m: str(one(m)), value)


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, list(EXACT) + list(NATIVE) + list(SUBTREES), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]}?"
    section = key.split(".")[0]
    if section in SECTIONS:
        names = sorted(k.split(".", 1)[1] for k in NATIVE if k.startswith(section + "."))
        return f"; {section}'s keys: {', '.join(names)}"
    verl_sections = sorted({k.split(".")[0] for k in EXACT} | set(SECTIONS))
    return f"; sections: {', '.join(verl_sections)}"


class _Translation:
    def __init__(self, data: Dict[str, Any], overridden: Tuple[str, ...] = ()):
        self.values = _Values(data)
        self.overridden = overridden  # keys the command line set: they win over the file's
        self.ours: Dict[str, Tuple[Any, str]] = {}  # our key -> (value, the key that set it)
        self.notes: List[str] = []
        self.problems: List[str] = []

    def _from_command_line(self, key: str) -> bool:
        return any(o == key or o.startswith(key + ".") or key.startswith(o + ".") for o in self.overridden)

    def set(self, ours: str, value: Any, source: str) -> None:
        if ours in self.ours and self.ours[ours][0] != value:
            before, by = self.ours[ours]
            new_wins, old_wins = self._from_command_line(source), self._from_command_line(by)
            if new_wins and not old_wins:
                self.ours[ours] = (value, source)
            elif new_wins == old_wins:
                self.problems.append(f"{ours} is set twice: {by}={before!r} and {source}={value!r}; keep one")
            return
        self.ours.setdefault(ours, (value, source))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def leaf(self, key: str, raw: Any) -> None:
        entry = EXACT.get(key)
        if entry is not None:
            self.mapped(entry, raw)
        elif _native_leaf(key, raw):
            self.set(key, self.values.resolve(key, raw), key)
        elif _covering(key) is not None:
            covering = _covering(key)
            self.note(f"{covering.verl}.*: {covering.how} (no meaning here; accepted)")
        elif key in SECTIONS and raw is None:
            return  # an empty section
        else:
            self.problems.append(f"unknown key {key}{_suggest(key)}")

    def mapped(self, entry: VerlKey, raw: Any) -> None:
        key = entry.verl
        try:
            value = self.values.resolve(key, raw)
            out = entry.convert(value, self.values.get) if entry.convert else value
        except ValueError as e:
            self.problems.append(str(e) if str(e).startswith(key) or key in str(e) else f"{key}: {e}")
            return
        if not entry.ours:
            self.note(f"{key}: {entry.how} (no meaning here; accepted)")
            return
        if out is SKIP:
            return
        outs = out if len(entry.ours) > 1 else (out,)
        for ours, v in zip(entry.ours, outs):
            if v is None and not _optional(ours):
                if key in self.overridden and raw is None:  # ``key=`` on the command line: a value forgotten
                    self.problems.append(f"{key}= gives no value (null), and {ours} needs one; give it, or drop "
                                         f"the override for the default")
                continue  # verl's null in a file: our default
            self.set(ours, v, key)

    def check_values(self) -> None:
        for ours, (value, source) in self.ours.items():
            _, hint, meta = NATIVE[ours]
            name = ours if source == ours else f"{source} (as {ours})"
            try:
                value = config_mod.check_value(value, hint, meta, name)
            except ValueError as e:
                self.problems.append(str(e))
                continue
            self.ours[ours] = (value, source)

    def nested(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for ours, (value, _) in self.ours.items():
            section, name = ours.split(".", 1)
            out.setdefault(section, {})[name] = value
        return out


def _optional(ours: str) -> bool:
    hint = NATIVE[ours][1]
    return typing.get_origin(hint) is Union and type(None) in typing.get_args(hint)


def translate(data: Dict[str, Any], overridden: Tuple[str, ...] = ()) -> Tuple[Dict[str, Any], List[str]]:
    """``data`` (our sections, verl's, or both) as our sections, and the notes of verl keys with
    no meaning here; ConfigProblems lists everything wrong. Two keys that set one of ours differently
    are a problem, unless one of them is in ``overridden`` (the command line's), which wins."""
    t = _Translation(data, overridden)
    passed: Dict[str, Any] = {}
    leaves: Dict[str, Any] = {}
    for section, value in data.items():
        if section in SECTIONS and value is not None and not isinstance(value, dict):
            passed[section] = value  # reward_fn: [...] and other non-mapping sections: from_dict decides
        elif isinstance(value, dict):
            _leaves(value, str(section), leaves, full=False)
        else:
            leaves[str(section)] = value
    for key, raw in leaves.items():
        t.leaf(key, raw)
    mini = f"{R.rsplit('.', 1)[0]}.actor.ppo_mini_batch_size"
    if mini in t.values.flat and f"{R}.n" not in t.values.flat and "rollout.n" not in t.ours:
        t.set("rollout.n", 1, f"{R}.n")  # verl's default, which the mini-batch (in prompts) was sized with
        t.note(f"{R}.n: not set, so verl's default 1 (samples per prompt), as ppo_mini_batch_size counts them")
    t.check_values()
    if t.problems:
        raise ConfigProblems(t.problems)
    out = t.nested()
    for section, value in passed.items():
        if section in out:
            raise ConfigProblems([f"{section} is given both as a list and as keys; keep one"])
        out[section] = value
    return out, t.notes


def strip_hydra(overrides: List[str]) -> List[str]:
    """Hydra's ``+key=value`` / ``++key=value`` (add / force-add) are plain overrides here."""
    return [o.lstrip("+") for o in overrides]


def is_verl_layout(overrides: List[str]) -> bool:
    """Whether the command line is written in verl's tree (a key of verl's that is none of ours)."""
    keys = [o.partition("=")[0].strip() for o in strip_hydra(overrides)]
    return any(k.split(".")[0] not in SECTIONS or (k in EXACT and k not in NATIVE) for k in keys)


def from_dict(data: Optional[Dict[str, Any]], overridden: Tuple[str, ...] = ()) -> Tuple[config_mod.Config, List[str]]:
    """A Config from our sections and / or verl's tree, and the notes to show."""
    if data is None:
        return config_mod.from_dict({}), []
    if not isinstance(data, dict):
        raise ValueError(f"the config must be a mapping of sections, got {type(data).__name__}")
    config_mod.require_registered()
    ours, notes = translate(data, overridden)
    return config_mod.from_dict(ours), notes


def load(path: Optional[Union[str, Path]], overrides: Optional[List[str]] = None
         ) -> Tuple[config_mod.Config, List[str]]:
    """A YAML file (ours or verl's layout; None: nothing) plus ``key=value`` overrides (either layout),
    which win over the file's keys, whichever layout each is written in."""
    from verl_fast.config import yaml_files

    data: Any = {}
    if path is not None:
        data = yaml_files.load_file(path) or {}  # size, alias and duplicate-key limits
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config must be a mapping of sections")
    overrides = strip_hydra(overrides or [])
    overridden = tuple(o.partition("=")[0].strip() for o in overrides)
    return from_dict(config_mod.apply_overrides(data, overrides), overridden)


# ----------------------------------------------------------------------------- the table, for the docs


def markdown() -> str:
    """The table of verl keys: verl key | here | how."""
    rows = ["| verl key | here | meaning here |", "|---|---|---|"]
    for k in KEYS:
        verl = f"`{k.verl}.*`" if k.subtree else f"`{k.verl}`"
        ours = ", ".join(f"`{o}`" for o in k.ours) if k.ours else "noted"
        rows.append(f"| {verl} | {ours} | {k.how.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m verl_fast.config.verl_config --markdown")
    print(markdown())
