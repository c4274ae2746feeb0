"""Hydra's composition of a verl config, without Hydra or verl installed: ``--config-path`` /
``--config-name`` (or ``--config`` naming a file), the ``defaults:`` list of a config and of each config
it names, and the command line's ``key=value`` / ``+key=value`` / ``++key=value`` / ``~key``.

A defaults entry is looked up as Hydra does it, first in the config's own folder (``--config-path``, or the
folder of ``--config``), then in the folders of ``hydra.searchpath`` (``file://...`` relative to the
working folder), and last in the built-in description of verl's tree (``verl_defaults.BUILT_IN``): a user
with verl's ``verl/trainer/config`` folder composes its files, a user with only their own YAML (``defaults:
[ppo_trainer, _self_]``) composes onto the built-in one. Entries:

- ``_self_``: where the config's own keys merge (none listed: last, Hydra 1.1's rule);
- ``name``: the config ``name`` of the same group (``ppo_trainer`` at the top);
- ``group: option`` / ``group@package: option`` / ``../group@package: option``: ``group/option.yaml``
  merged at ``package`` (relative to the config's own package; the group's path by default);
  ``optional`` before the group skips a missing option, ``override`` replaces the option an inner
  defaults list names, a null option names nothing.

Values Hydra leaves MISSING (``???``) are dropped, so that verl's defaults and ours apply. Which tree the
config is (verl's PPO trainer or its SFT trainer) follows from the built-in configs it reached.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from verl_fast.config import verl_defaults, yaml_files

MISSING = "???"
MAX_CONFIGS = 200  # configs one composition may read: a defaults list that names itself stops here
_PACKAGE = re.compile(r"^#\s*@package\s+(\S+)\s*$", re.MULTILINE)


@dataclass
class Composed:
    """A composed config: the tree, the verl trainer it is (``ppo``, ``sft`` or None: not verl's), the
    keys ``~key`` removed (verl's defaults are not applied to them) and the configs read, in order."""

    data: Dict[str, Any]
    tree: Optional[str] = None
    deleted: Tuple[str, ...] = ()
    read: List[str] = field(default_factory=list)


def merge(base: Dict[str, Any], top: Dict[str, Any]) -> Dict[str, Any]:
    """``top`` over ``base``, mappings merged key by key (as OmegaConf merges)."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _at(package: str, data: Dict[str, Any]) -> Dict[str, Any]:
    for part in reversed([p for p in package.split(".") if p]):
        data = {part: data}
    return data


def _drop_missing(node: Any) -> Any:
    """``node`` without Hydra's MISSING values and the mappings left empty (a built-in group's)."""
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        v = _drop_missing(v)
        if v != MISSING and v != {}:
            out[k] = v
    return out


class _Composer:
    def __init__(self, folders: List[Path], where: str):
        self.folders = folders
        self.where = where  # names the primary config in errors
        self.read: List[str] = []
        self.trees: Set[str] = set()
        self.overrides: Dict[str, Optional[str]] = {}  # group -> option (``override`` entries)

    def find(self, name: str) -> Tuple[Optional[Path], Optional[Dict[str, Any]]]:
        """A config ``group/option`` as a file of the search folders, or built in."""
        for folder in self.folders:
            path = folder / f"{name}.yaml"
            if path.is_file():
                return path, None
        return None, verl_defaults.BUILT_IN.get(name)

    def load(self, name: str, optional: bool, entry: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        """The content of config ``name`` and the package its header names (None: the default)."""
        if len(self.read) >= MAX_CONFIGS:
            raise ValueError(f"{self.where}: the defaults lists name more than {MAX_CONFIGS} configs (a cycle?)")
        path, built_in = self.find(name)
        if path is not None:
            text = yaml_files.read_text(path, "the config")
            header = _PACKAGE.search("\n".join(text.splitlines()[:3]))
            data = yaml_files.loads(text, str(path)) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: a config must be a mapping of keys")
            self.read.append(str(path))
            return data, header.group(1) if header else None
        if built_in is not None:
            self.read.append(f"built-in {name}")
            if "/" not in name:
                self.trees.add(verl_defaults.TREE_OF.get(name, ""))
            return copy.deepcopy(built_in), None
        if optional:
            return None, None
        searched = ", ".join(str(f) for f in self.folders) or "no folder"
        raise ValueError(f"{self.where}: defaults entry {entry!r}: no config {name}.yaml in {searched}, and verl "
                         f"has no such built-in config (built in: {', '.join(verl_defaults.TOP_LEVEL)})")

    def compose(self, data: Dict[str, Any], group: str, package: str, depth: int = 0) -> Dict[str, Any]:
        """``data`` (a config of ``group``, merged at ``package``) with its defaults list applied."""
        if depth > 32:
            raise ValueError(f"{self.where}: the defaults lists nest more than 32 deep (a cycle?)")
        defaults = data.pop("defaults", None)
        if defaults is None:
            return _at(package, data)
        if not isinstance(defaults, list):
            raise ValueError(f"{self.where}: defaults must be a list, got {type(defaults).__name__}")
        entries = [e for e in defaults]
        for e in entries:  # ``override group: option`` entries change the inner lists' choices
            if isinstance(e, dict) and len(e) == 1 and str(next(iter(e))).startswith("override "):
                key, option = next(iter(e.items()))
                self.overrides[key[len("override "):].strip().split("@")[0]] = option
        if "_self_" not in entries:
            entries.append("_self_")
        out: Dict[str, Any] = {}
        for e in entries:
            if e == "_self_":
                out = merge(out, _at(package, data))
                continue
            part = self.entry(e, group, package, depth)
            if part is not None:
                out = merge(out, part)
        return out

    def entry(self, e: Any, group: str, package: str, depth: int) -> Optional[Dict[str, Any]]:
        if isinstance(e, str):  # a config of the same group, at the same package (``name@pkg`` moves it)
            name, _, pkg = e.partition("@")
            target = f"{group}/{name}" if group else name
            return self.one(target, group, pkg or None, "", package, False, e, depth)
        if not (isinstance(e, dict) and len(e) == 1):
            raise ValueError(f"{self.where}: defaults entry {e!r} must be a name or one group: option")
        key, option = next(iter(e.items()))
        key = str(key).strip()
        if key.startswith("override "):
            return None
        optional = key.startswith("optional ")
        key = key[len("optional "):].strip() if optional else key
        grp, _, pkg = key.partition("@")
        target = _normal(Path(group) / grp if group else Path(grp), self.where, e)
        option = self.overrides.get(target, option)
        if option is None:
            return None
        own = ".".join(p for p in Path(grp).parts if p not in ("..", "."))
        return self.one(f"{target}/{option}", target, pkg or None, own, package, optional, e, depth)

    def one(self, name: str, group: str, pkg: Optional[str], own: str, package: str, optional: bool, entry: Any,
            depth: int) -> Optional[Dict[str, Any]]:
        """Config ``name`` (of ``group``) composed at ``pkg`` (from the entry or the file's header), else
        at ``own`` (the group's path), under the including config's ``package``."""
        data, header = self.load(name, optional, str(entry))
        if data is None:
            return None
        pkg = pkg if pkg is not None else header
        if pkg == "_global_":
            where = ""
        elif pkg == "_group_" or pkg is None:
            where = ".".join(p for p in (package, own) if p)
        else:
            where = ".".join(p for p in (package, pkg) if p)
        return self.compose(data, group, where, depth + 1)


def _normal(path: Path, where: str, entry: Any) -> str:
    parts: List[str] = []
    for p in path.parts:
        if p == "..":
            if not parts:
                raise ValueError(f"{where}: defaults entry {entry!r} climbs above the config folder")
            parts.pop()
        elif p != ".":
            parts.append(p)
    return "/".join(parts)


def _search_folders(primary: Dict[str, Any], first: Optional[Path]) -> List[Path]:
    folders = [first] if first is not None else []
    hydra = primary.get("hydra") if isinstance(primary.get("hydra"), dict) else {}
    for item in hydra.get("searchpath") or []:
        text = str(item)
        if text.startswith("file://"):
            folders.append(Path(text[len("file://"):]).expanduser())
        # pkg://verl.trainer.config and other packages: verl's own tree, which is built in
    return folders


def compose(config_path: Optional[str], config_name: Optional[str], config_file: Optional[str]) -> Composed:
    """The config a verl / Hydra command line names: ``config_file`` (``--config``), or ``config_name``
    in ``config_path`` (``--config-name`` / ``--config-path``; no path: verl's built-in configs)."""
    if config_file is not None:
        path = Path(config_file)
        folder, name, where = path.parent, path.stem, str(path)
        data = yaml_files.load_file(path) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config must be a mapping of sections")
        read = [str(path)]
    else:
        name = str(config_name or "ppo_trainer")
        name = name[:-len(".yaml")] if name.endswith(".yaml") else name
        folder = Path(config_path).expanduser() if config_path else None
        if folder is not None and not folder.is_dir():
            if name not in verl_defaults.TOP_LEVEL:
                raise ValueError(f"--config-path {config_path}: no such folder (and {name} is no config of verl's "
                                 f"built in: {', '.join(verl_defaults.TOP_LEVEL)})")
            folder = None  # verl's scripts name verl's own folder (config, beside main_ppo.py): built in here
        where = f"--config-name {name}"
        path = folder / f"{name}.yaml" if folder is not None else None
        if path is not None and path.is_file():
            data = yaml_files.load_file(path) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: the config must be a mapping of sections")
            read = [str(path)]
        elif name in verl_defaults.BUILT_IN and "/" not in name:
            data, read = copy.deepcopy(verl_defaults.BUILT_IN[name]), [f"built-in {name}"]
        else:
            looked = f"{folder} holds no {name}.yaml and " if folder is not None else ""
            raise ValueError(f"--config-name {name}: {looked}verl has no such built-in config (built in: "
                             f"{', '.join(verl_defaults.TOP_LEVEL)})")
    composer = _Composer(_search_folders(data, folder), where)
    composer.read = read
    if read[0].startswith("built-in "):
        composer.trees.add(verl_defaults.TREE_OF.get(name, ""))
    hydra = data.get("hydra")
    if isinstance(hydra, dict):  # the search path is the composition's, not a setting of the run
        hydra.pop("searchpath", None)
    out = _drop_missing(composer.compose(data, "", ""))
    trees = composer.trees - {""}
    if len(trees) > 1:
        raise ValueError(f"{where}: composes verl's {' and '.join(sorted(trees))} trainers' configs; name one")
    return Composed(out, next(iter(trees), None), (), composer.read)


# ----------------------------------------------------------------------------- the command line


def split_overrides(overrides: List[str]) -> Tuple[List[str], List[str]]:
    """Hydra's forms as ``key=value`` overrides and ``~key`` deletions: ``+key=value`` (add) and
    ``++key=value`` (add or replace) are plain overrides here."""
    plain, deleted = [], []
    for item in overrides:
        if item.startswith("~"):
            key = item[1:].partition("=")[0].strip()
            if not key:
                raise ValueError(f"override {item!r}: ~ needs a key (~section.key)")
            deleted.append(key)
        else:
            plain.append(item.lstrip("+"))
    return plain, deleted


def delete(data: Dict[str, Any], key: str, known: bool) -> None:
    """``~key``: the key removed from ``data``; a key absent from the tree is an error unless it is one
    verl's tree holds (``known``), whose default is then not applied."""
    node: Any = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and parts[-1] in node:
        del node[parts[-1]]
    elif not known:
        raise ValueError(f"~{key}: the config has no key {key} to delete")
