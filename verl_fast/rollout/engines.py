"""The rollout engines by ``rollout.type``: a name and the path of the engine's class, imported when the
name is looked up (an engine's libraries load only for a run that asks for it).

A new engine is a subclass of ``RolloutEngine`` (``base.py``) in one module and one line here, or a
``register(name, path)`` call from outside the package (``docs/add_an_engine.md``). The engine class
answers for its kind: its checks, the process set-up, its construction, its memory (``owns_weights``) and
its weight sync; nothing outside ``rollout/`` tests an engine's name or class.

``rollout.type: auto`` is not an engine: ``factory.resolve_type`` picks one of these for the actor.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Optional, Tuple, Type, Union

from verl_fast import config, extras
from verl_fast.rollout.base import RolloutEngine

AUTO = "auto"

# rollout.type -> "module:Class"
_ENGINES: Dict[str, Union[str, Type[RolloutEngine]]] = {
    "hf": "verl_fast.rollout.hf_engine:HFGenerateEngine",
    "vllm": "verl_fast.rollout.vllm_engine:VLLMInferenceEngine",
}


def register(name: str, engine: Union[str, Type[RolloutEngine]]) -> None:
    """``rollout.type: name`` builds ``engine``: a ``RolloutEngine`` subclass or its ``"module:Class"`` path."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"an engine's name must be a non-empty string other than {AUTO!r}, got {name!r}")
    _ENGINES[name] = engine
    config.ENGINES.register(name)


def names() -> tuple:
    """The registered engines' names, in the order they were registered."""
    return tuple(_ENGINES)


def engine_class(name: str) -> Type[RolloutEngine]:
    """The class ``rollout.type: name`` builds, imported now; one line naming the choices otherwise."""
    entry = _ENGINES.get(name)
    if entry is None:
        raise ValueError(f"rollout.type must be one of {[AUTO, *_ENGINES]}, got {name!r}")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        if not (isinstance(entry, type) and issubclass(entry, RolloutEngine)):
            raise TypeError(f"rollout.type={name}: {module}:{attr} is not a RolloutEngine subclass")
        _ENGINES[name] = entry
    entry.name = name
    return entry


def named(cfg: Any) -> Optional[Type[RolloutEngine]]:
    """The engine class ``cfg.rollout.type`` names, or None for ``auto`` (chosen beside the actor)."""
    return None if cfg.rollout.type == AUTO else engine_class(cfg.rollout.type)


def owns_weights(cfg: Any) -> bool:
    """Whether the engine the config names holds a copy of the weights of its own (``auto``: not
    counted on, it may decode with the actor itself)."""
    cls = named(cfg)
    return cls is not None and cls.owns_weights


def unused(cfg: Any, algorithm: str) -> Optional[str]:
    """The warning for a config that names an engine of its own for an algorithm that generates nothing."""
    cls = named(cfg)
    if cls is None or not cls.owns_weights:
        return None
    return (f"rollout.type={cls.name} does not apply to algorithm.type={algorithm}, which generates nothing (it "
            f"trains on the dataset's rows): no {cls.__name__} is started")


def prepare_process(cfg: Any) -> None:
    """The process set up for the engine ``cfg`` may use (every engine ``auto`` may pick), before any
    of their libraries is imported: the launcher calls this first."""
    for cls in ([named(cfg)] if cfg.rollout.type != AUTO else [engine_class(n) for n in _ENGINES]):
        cls.prepare_process(cfg)


def check(cfg: Any) -> None:
    """The named engine's own checks of ``cfg`` (registered with the config's validation)."""
    cls = named(cfg)
    if cls is not None:
        cls.check_config(cfg)


def _packages(cfg: Any) -> List[Tuple[str, str, str]]:
    """The optional packages the engine ``cfg`` names imports (``extras.register_provider``)."""
    cls = named(cfg)
    return [] if cls is None else [(module, extra, f"rollout.type={cls.name}") for module, extra in cls.packages]


config.ENGINES.register(AUTO, *_ENGINES)
config.register_check(check)
extras.register_provider(_packages)
