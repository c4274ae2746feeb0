"""verl's configuration tree read as ours: ``ppo_trainer.yaml``'s layout (``actor_rollout_ref.{model,
actor,rollout,ref}``, ``data``, ``algorithm``, ``critic``, ``reward_model``, ``custom_reward_function``,
``trainer``, ...) in a YAML file or as ``key=value`` overrides (Hydra's ``+key=value`` / ``~key`` too), beside
or instead of our own sections; verl's SFT trainer's tree (``sft_trainer.yaml``) where the run is
``verl-fast sft``. A file's ``defaults:`` list and Hydra's ``--config-path`` / ``--config-name`` are
composed by ``hydra_compose``; a config in verl's tree takes verl's defaults (``verl_defaults``) for
the keys it does not set, and the notes name those that differ from ours.

Every key is looked up once: our own key as it is; verl's key through the table in
``verl_fast.config.verl_keys`` (verl's units converted: mini-batches in prompts x rollout.n, micro-batches per
GPU, epochs or steps, ...), or noted in one line when it has no meaning here; anything else is unknown,
with the closest key named. Every problem of the config is reported at once, one line each
(``ConfigProblems``), before the combination checks of ``config.validate``. Values may use verl's
interpolations (``${key}``, ``${oc.select:key,default}``, ``${oc.env:NAME,default}``, ``${.sibling}``),
measured before any is expanded (MAX_EXPANDED_CHARS, MAX_REFERENCES, MAX_DEPTH).

``python -m verl_fast.config.verl_config --markdown`` prints the table of verl keys (docs/verl_and_trl.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from verl_fast import config as config_mod
from verl_fast.config import hydra_compose, verl_defaults, verl_keys, verl_sft_keys, yaml_files
from verl_fast.config.verl_keys import SKIP, VerlKey

HIDDEN = ("_target_",)  # Hydra's instantiation marker: not a setting
# interpolations are measured before any is expanded (a "billion laughs" of ${...} refused up front)
MAX_EXPANDED_CHARS = 1 << 20  # a value's text with every ${...} expanded
MAX_REFERENCES = 10_000  # references one value expands, counted through the values it names
MAX_DEPTH = 16  # references that name references


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


class Table:
    """One of verl's trainers' key tables: its exact keys and the subtrees noted whole."""

    def __init__(self, name: str, entry: str, keys: List[VerlKey]):
        self.name, self.entry = name, entry  # "PPO", "verl-fast train"
        self.exact: Dict[str, VerlKey] = {k.verl: k for k in keys if not k.subtree}
        self.subtrees: Dict[str, VerlKey] = {k.verl: k for k in keys if k.subtree}

    def covering(self, key: str) -> Optional[VerlKey]:
        """The deepest subtree entry that ``key`` lies in (or is)."""
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            entry = self.subtrees.get(".".join(parts[:n]))
            if entry is not None:
                return entry
        return None

    def has_keys_under(self, key: str) -> bool:
        prefix = key + "."
        return any(k.startswith(prefix) for k in self.exact) or any(k.startswith(prefix) for k in NATIVE)

    def knows(self, key: str) -> bool:
        return key in self.exact or self.covering(key) is not None or key in NATIVE or self.has_keys_under(key)


TABLES = {"ppo": Table("PPO", "verl-fast train", verl_keys.KEYS),
          "sft": Table("SFT", "verl-fast sft", verl_sft_keys.KEYS)}
EXACT = TABLES["ppo"].exact
SUBTREES = TABLES["ppo"].subtrees


def _covering(key: str) -> Optional[VerlKey]:
    return TABLES["ppo"].covering(key)


def _native_leaf(key: str, value: Any) -> bool:
    """Whether ``key`` is one of ours holding ``value`` whole: a mapping only where ours takes one
    (``algorithm.rollout_correction`` is our switch, and verl's section of the same name)."""
    if key not in NATIVE:
        return False
    hint = NATIVE[key][1]
    kinds = (hint, *typing.get_args(hint))  # a section within a section (actor.lora) takes a mapping too
    takes_mapping = any(k is dict or typing.get_origin(k) is dict or dataclasses.is_dataclass(k) for k in kinds)
    return not isinstance(value, dict) or takes_mapping


def _leaves(node: Dict[str, Any], path: str, out: Dict[str, Any], full: bool, table: Table) -> None:
    """The config's keys, dotted: down to our keys, verl's exact keys and (``full=False``) the
    subtrees noted whole; ``full``: every leaf (what interpolations may name)."""
    for k, v in node.items():
        key = f"{path}.{k}" if path else str(k)
        if k in HIDDEN:
            continue
        stop = _native_leaf(key, v) or key in table.exact or (
            not full and table.covering(key) is not None and not table.has_keys_under(key))
        if isinstance(v, dict) and v and not stop:
            _leaves(v, key, out, full, table)
        else:
            out[key] = v


# ${key}, ${.sibling}, ${..uncle}, ${oc.select:key,default}, ${oc.env:NAME,default}
_INTERPOLATION = re.compile(r"\$\{\s*(?:([A-Za-z_][\w.]*):)?\s*([^,}]*?)\s*(?:,\s*([^}]*))?\}")
RESOLVERS = (None, "oc.select", "oc.env")


def _target(key: str, ref: str) -> str:
    """The key ``ref`` names from ``key`` (``.x``: a sibling; ``..x``: the parent's sibling)."""
    if not ref.startswith("."):
        return ref
    dots = len(ref) - len(ref.lstrip("."))
    parts = key.split(".")[:-dots]
    return ".".join(parts + [ref[dots:]]) if ref[dots:] else ".".join(parts)


class _Values:
    """The config's leaves, with verl's interpolations resolved on reading; their expanded size,
    count and depth measured first (``check``), before anything is expanded."""

    def __init__(self, data: Dict[str, Any], table: Table):
        self.flat: Dict[str, Any] = {}
        _leaves(data, "", self.flat, full=True, table=table)

    def check(self) -> None:
        measured: Dict[str, Tuple[int, int, int]] = {}
        for key in self.flat:
            self._measure(key, measured, ())

    def _measure(self, key: str, measured: Dict[str, Tuple[int, int, int]], stack: Tuple[str, ...]
                 ) -> Tuple[int, int, int]:
        """(characters, references, depth) of ``key``'s value with every reference expanded."""
        if key in measured:
            return measured[key]
        if key in stack:
            raise ValueError(f"{stack[0]}: its interpolations name each other in a cycle ({' -> '.join(stack[-4:])} "
                             f"-> {key})")
        value = self.flat[key]
        if not isinstance(value, str) or "${" not in value:
            measured[key] = (len(str(value)), 0, 0)
            return measured[key]
        chars, refs, depth = len(value), 0, 0
        for m in _INTERPOLATION.finditer(value):
            resolver, ref, default = m.group(1), m.group(2), m.group(3)
            chars -= len(m.group(0))
            refs += 1
            target = _target(key, ref)
            if resolver in (None, "oc.select") and target in self.flat:
                if len(stack) >= MAX_DEPTH:
                    raise ValueError(f"{stack[0] if stack else key}: interpolations nest more than {MAX_DEPTH} deep")
                c, r, d = self._measure(target, measured, stack + (key,))
                chars, refs, depth = chars + c, refs + r, max(depth, d + 1)
            else:
                chars += len(default or "") + (len(os.environ.get(ref, "")) if resolver == "oc.env" else 0)
            if chars > MAX_EXPANDED_CHARS or refs > MAX_REFERENCES:
                raise ValueError(f"{key}: its ${{...}} interpolations would expand to more than "
                                 f"{MAX_EXPANDED_CHARS:,} characters or {MAX_REFERENCES:,} references; refused "
                                 "before expanding (docs/faults.md)")
        measured[key] = (chars, refs, depth)
        return measured[key]

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self.flat or self.flat[key] is None:
            return default
        return self.resolve(key, self.flat[key])

    def resolve(self, key: str, value: Any) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value

        def one(m: "re.Match[str]") -> Any:
            resolver, ref, default = m.group(1), m.group(2), m.group(3)
            if resolver not in RESOLVERS:
                raise ValueError(f"{key}: {m.group(0)} uses the resolver {resolver}, which is not available here "
                                 "(oc.select, oc.env)")
            if resolver == "oc.env":
                if ref in os.environ:
                    return os.environ[ref]
                if default is None:
                    raise ValueError(f"{key}: {m.group(0)}: the environment variable {ref} is not set")
                return _yaml_value(default)
            target = _target(key, ref)
            if target in self.flat:
                return self.get(target, None)
            if default is not None:
                return _yaml_value(default)
            if resolver == "oc.select":
                return None
            raise ValueError(f"{key}: {m.group(0)} names no key of the config")

        whole = _INTERPOLATION.fullmatch(value.strip())
        if whole:
            return one(whole)
        return _INTERPOLATION.sub(lambda m: str(one(m)), value)


def _yaml_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def _suggest(key: str, table: Table) -> str:
    """A hint for an unknown key: the key of verl's other trainer it is, a close key of the same
    section, the same name under another section, or the section's keys."""
    for other in TABLES.values():
        if other is not table and (key in other.exact or other.covering(key) is not None):
            return f"; this is a key of verl's {other.name} trainer: run it with {other.entry}"
    known = list(table.exact) + list(NATIVE) + list(table.subtrees)
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.75)
    if close:
        return f"; did you mean {siblings[close[0]]}?"
    elsewhere = difflib.get_close_matches(key, [k for k in known if k.rpartition(".")[2] == leaf], n=1, cutoff=0.5)
    if elsewhere:
        return f"; did you mean {elsewhere[0]}?"
    section = key.split(".")[0]
    if section in SECTIONS and parent == section:
        names = sorted(k.split(".", 1)[1] for k in NATIVE if k.startswith(section + "."))
        return f"; {section}'s keys: {', '.join(names)}"
    verl_sections = sorted({k.split(".")[0] for k in table.exact} | set(SECTIONS))
    if section not in verl_sections:
        return f"; sections: {', '.join(verl_sections)}"
    return ""


class _Translation:
    def __init__(self, data: Dict[str, Any], overridden: Tuple[str, ...], table: Table):
        self.table = table
        self.values = _Values(data, table)
        self.overridden = overridden  # keys the command line set: they win over the file's
        self.defaulted: Dict[str, Any] = {}  # verl's defaults the run takes (verl key -> value)
        self.ours: Dict[str, Tuple[Any, str]] = {}  # our key -> (value, the key that set it)
        self.notes: List[str] = []
        self.problems: List[str] = []

    def _rank(self, key: str) -> int:
        """Who set ``key``: 2 the command line, 1 the file, 0 verl's default."""
        if key in self.defaulted:
            return 0
        return 2 if any(o == key or o.startswith(key + ".") or key.startswith(o + ".") for o in self.overridden) else 1

    def set(self, ours: str, value: Any, source: str) -> None:
        if ours in self.ours and self.ours[ours][0] != value:
            before, by = self.ours[ours]
            new, old = self._rank(source), self._rank(by)
            if new > old:
                self.ours[ours] = (value, source)
            elif new == old and new > 0:
                self.problems.append(f"{ours} is set twice: {by}={before!r} and {source}={value!r}; keep one")
            return
        self.ours.setdefault(ours, (value, source))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def leaf(self, key: str, raw: Any) -> None:
        entry = self.table.exact.get(key)
        if entry is not None:
            self.mapped(entry, raw)
        elif _native_leaf(key, raw):
            self.set(key, self.values.resolve(key, raw), key)
        elif self.table.covering(key) is not None:
            covering = self.table.covering(key)
            self.note(f"{covering.verl}.*: {covering.how} (no meaning here; accepted)")
        elif key in SECTIONS and raw is None:
            return  # an empty section
        else:
            self.problems.append(f"unknown key {key}{_suggest(key, self.table)}")

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

    def applied_defaults(self) -> Optional[str]:
        """The note of verl's defaults that set a key of ours to other than its own default."""
        ours_default = config_mod.Config().to_dict()
        differ = []
        for ours, (value, source) in self.ours.items():
            section, name = ours.split(".", 1)
            if source in self.defaulted and ours_default.get(section, {}).get(name) != value:
                differ.append(f"{source}={self.values.get(source)} (verl_fast's {ours}: "
                              f"{ours_default[section][name]})")
        if not differ:
            return None
        return "verl's defaults applied, where verl_fast's own differ: " + "; ".join(sorted(set(differ)))

    def nested(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for ours, (value, _) in self.ours.items():
            section, name = ours.split(".", 1)
            out.setdefault(section, {})[name] = value
        return out


def _optional(ours: str) -> bool:
    hint = NATIVE[ours][1]
    return typing.get_origin(hint) is Union and type(None) in typing.get_args(hint)


def verl_tree(data: Dict[str, Any]) -> Optional[str]:
    """``ppo`` where ``data`` holds a key of verl's tree that is none of ours (None: our own layout)."""
    flat: Dict[str, Any] = {}
    _leaves(data, "", flat, full=False, table=TABLES["ppo"])
    return "ppo" if any(k.split(".")[0] not in SECTIONS or (k in EXACT and k not in NATIVE) for k in flat) else None


def _defaults(t: _Translation, tree: str, deleted: Tuple[str, ...]) -> Dict[str, Any]:
    """verl's defaults of ``tree`` for the keys the config does not set (nor ``~key`` removed)."""
    out = {}
    for key, value in verl_defaults.DEFAULTS[tree].items():
        if key in t.values.flat or any(key == d or key.startswith(d + ".") for d in deleted):
            continue
        if key == "trainer.val_before_train" and t.values.get("data.val_files") is None:
            continue  # verl's default val_files is a placeholder: no validation set, no validation
        out[key] = value
    return out


def translate(data: Dict[str, Any], overridden: Tuple[str, ...] = (), tree: Optional[str] = None,
              deleted: Tuple[str, ...] = ()) -> Tuple[Dict[str, Any], List[str]]:
    """``data`` (our sections, verl's, or both) as our sections, and the notes of verl keys with
    no meaning here; ConfigProblems lists everything wrong. ``tree``: the verl trainer whose keys and
    defaults apply (``ppo``, ``sft``; None: ``ppo`` where data holds a key of verl's, else none). Two
    keys that set one of ours differently are a problem, unless one of them is in ``overridden`` (the
    command line's), which wins; verl's defaults lose to either."""
    tree = tree or verl_tree(data)
    table = TABLES[tree or "ppo"]
    t = _Translation(data, overridden, table)
    passed: Dict[str, Any] = {}
    leaves: Dict[str, Any] = {}
    for section, value in data.items():
        if section in SECTIONS and value is not None and not isinstance(value, dict):
            passed[section] = value  # reward_fn: [...] and other non-mapping sections: from_dict decides
        elif isinstance(value, dict):
            _leaves(value, str(section), leaves, full=False, table=table)
        else:
            leaves[str(section)] = value
    if tree is not None:
        t.defaulted = _defaults(t, tree, deleted)
        t.values.flat.update(t.defaulted)
        leaves.update(t.defaulted)
    try:
        t.values.check()  # before any value is expanded
    except ValueError as e:
        raise ConfigProblems([str(e)]) from None
    if tree == "sft":
        t.set("algorithm.type", "sft", "verl-fast sft")
    for key, raw in leaves.items():
        t.leaf(key, raw)
    t.check_values()
    if t.problems:
        raise ConfigProblems(t.problems)
    out = t.nested()
    for section, value in passed.items():
        if section in out:
            raise ConfigProblems([f"{section} is given both as a list and as keys; keep one"])
        out[section] = value
    applied = t.applied_defaults()
    return out, t.notes + ([applied] if applied else [])


def is_verl_layout(overrides: List[str]) -> bool:
    """Whether the command line is written in verl's tree (a key of verl's that is none of ours)."""
    plain, deleted = hydra_compose.split_overrides(overrides)
    keys = [o.partition("=")[0].strip() for o in plain] + deleted
    return any(k.split(".")[0] not in SECTIONS or (k in EXACT and k not in NATIVE) for k in keys)


def from_dict(data: Optional[Dict[str, Any]], overridden: Tuple[str, ...] = (), tree: Optional[str] = None,
              deleted: Tuple[str, ...] = ()) -> Tuple[config_mod.Config, List[str]]:
    """A Config from our sections and / or verl's tree, and the notes to show."""
    if data is None:
        return config_mod.from_dict({}), []
    if not isinstance(data, dict):
        raise ValueError(f"the config must be a mapping of sections, got {type(data).__name__}")
    config_mod.require_registered()
    ours, notes = translate(data, overridden, tree, deleted)
    return config_mod.from_dict(ours), notes


def load(path: Optional[Union[str, Path]], overrides: Optional[List[str]] = None, config_path: Optional[str] = None,
         config_name: Optional[str] = None, tree: Optional[str] = None) -> Tuple[config_mod.Config, List[str]]:
    """A config (``path``: a YAML file, ours or verl's layout, its ``defaults:`` list composed;
    ``config_path`` / ``config_name``: Hydra's; ``tree="sft"``: verl's SFT trainer; none of them: a
    command line in verl's tree composes onto verl's ``ppo_trainer``) plus ``key=value`` overrides
    (either layout, Hydra's ``+`` / ``++`` / ``~key`` too), which win over the file's keys."""
    plain, deleted = hydra_compose.split_overrides(overrides or [])
    data: Dict[str, Any] = {}
    if path is not None or config_name is not None or config_path is not None or tree is not None:
        name = config_name or ("sft_trainer" if tree == "sft" and path is None else None)
        composed = hydra_compose.compose(config_path, name, str(path) if path is not None else None)
        data, tree = composed.data, tree or composed.tree
    elif is_verl_layout(overrides or []):
        tree = "ppo"
    table = TABLES[tree or "ppo"]
    for key in deleted:
        hydra_compose.delete(data, key, known=table.knows(key) or key in verl_defaults.DEFAULTS.get(tree or "", {}))
    overridden = tuple(o.partition("=")[0].strip() for o in plain)
    top = [o for o in plain if "=" in o and "." not in o.partition("=")[0]]
    if tree is not None:  # verl's trees have top-level keys (the SFT trainer's ulysses_sequence_parallel_size)
        data = dict(data)
        for item in top:
            key, _, raw = item.partition("=")
            data[key.strip()] = yaml_files.loads(raw, f"override {item!r}") if raw != "" else None
        plain = [o for o in plain if o not in top]
    return from_dict(config_mod.apply_overrides(data, plain), overridden, tree, tuple(deleted))


# ----------------------------------------------------------------------------- the table, for the docs


def _default_cell(tree: str, key: str) -> str:
    if key not in verl_defaults.DEFAULTS[tree]:
        return ""
    value = verl_defaults.DEFAULTS[tree][key]
    return f"`{value}`".replace("|", "/") if not isinstance(value, bool) else f"`{str(value).lower()}`"


def markdown(tree: str = "ppo") -> str:
    """The table of verl's keys of one trainer: verl key | here | meaning here | verl's default (the
    ones a run in verl's shape takes)."""
    keys = verl_keys.KEYS if tree == "ppo" else verl_sft_keys.KEYS
    rows = ["| verl key | here | meaning here | verl's default, applied |", "|---|---|---|---|"]
    for k in keys:
        verl = f"`{k.verl}.*`" if k.subtree else f"`{k.verl}`"
        ours = ", ".join(f"`{o}`" for o in k.ours) if k.ours else "noted"
        rows.append(f"| {verl} | {ours} | {k.how.replace('|', '/')} | {_default_cell(tree, k.verl)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:] not in (["--markdown"], ["--markdown", "sft"]):
        raise SystemExit("usage: python -m verl_fast.config.verl_config --markdown [sft]")
    print(markdown(sys.argv[2] if len(sys.argv) > 2 else "ppo"))
