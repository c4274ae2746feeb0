"""The optional packages a config needs, checked at start-up (before any model loads), each missing
one named with the pip extra of verl_fast that installs it and the key that asked for it.

``pip install verl_fast`` trains (transformers, datasets, ... are core dependencies); what a config
turns on beyond that comes from an extra: ``plot`` (matplotlib), ``wandb``, ``tensorboard``, ``lora``
(peft), ``torchao`` (8-bit optimizer states), ``vllm``, ``demo`` (reasoning-gym and the demo model's GGUF
reader); the training strategies and the rollout engines register theirs (``register``). What only a run
that generates needs (its engine, the reward's package) is not asked of an offline algorithm's run.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, List, Optional, Sequence, Tuple

# (import name, extra, what in the config needs it: a description, and whether this config does)
_Need = Tuple[str, str, Callable[[Any], Optional[str]]]
# what a config needs, computed from it: (import name, extra, the key asking) each
_Provider = Callable[[Any], List[Tuple[str, str, str]]]


def _logger(name: str) -> Callable[[Any], Optional[str]]:
    return lambda cfg: f"trainer.loggers has {name}" if name in cfg.trainer.loggers else None


def _reasoning_gym_data(cfg: Any) -> Optional[str]:
    if isinstance(cfg.trainer.dataset, str) and cfg.trainer.dataset.startswith("reasoning_gym:"):
        return f"trainer.dataset={cfg.trainer.dataset}"
    return None


def _lora(cfg: Any) -> Optional[str]:
    # actor.lora: the LoRA section of the config (absent from a config without LoRA support)
    return "actor.lora" if getattr(cfg.actor, "lora", None) else None


NEEDS: List[_Need] = [
    ("matplotlib", "plot", lambda cfg: "trainer.plot=true (the reward-curve PNG)" if cfg.trainer.plot else None),
    ("wandb", "wandb", _logger("wandb")),
    ("tensorboard", "tensorboard", _logger("tensorboard")),
    ("peft", "lora", _lora),
    ("reasoning_gym", "demo", _reasoning_gym_data),
    ("torchao", "torchao", lambda cfg: "actor.optimizer=adamw_8bit" if cfg.actor.optimizer == "adamw_8bit" else None),
]
# needed by a run that generates (and scores) samples only
GENERATING: List[_Need] = [
    ("reasoning_gym", "demo", lambda cfg: "reward_fn.type=reasoning_gym" if cfg.reward_fn.type == "reasoning_gym"
     else None),
]
PROVIDERS: List[_Provider] = []  # a generating run's needs that a room computes (the rollout engine's)


def register(module: str, extra: str, needed: Callable[[Any], Optional[str]]) -> None:
    """A package a part of verl_fast needs when ``needed(cfg)`` names the key asking for it (a training
    strategy registers its own where the strategies are registered, ``strategies/backends.py``)."""
    if (module, extra, needed) not in NEEDS:
        NEEDS.append((module, extra, needed))


def register_provider(provider: _Provider) -> None:
    """``provider(cfg)``: the packages a generating run of ``cfg`` needs, as (import name, extra, key) each
    (the rollout engines', ``rollout/registry.py``)."""
    if provider not in PROVIDERS:
        PROVIDERS.append(provider)


def installed(module: str) -> bool:
    """Whether ``module`` (dotted names too) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


# pip's names of the packages whose import name differs
_PIP_NAMES = {"megatron.core": "megatron-core", "reasoning_gym": "reasoning-gym"}
# packages installed without their own requirements (which pin older releases of packages verl_fast's
# other extras need): the release, beside the extra that installs what it imports
NO_DEPS = {"verifiers": "verifiers==0.3.1"}  # its mcp<2 (vLLM 0.32 and the agents extra need mcp 2)


def hint(module: str, extra: str) -> str:
    """"the wandb package: pip install wandb (or pip install 'verl_fast[wandb]')"."""
    pip = _PIP_NAMES.get(module, module.split(".")[0])
    if pip in NO_DEPS:
        return (f"the {pip} package: pip install --no-deps {NO_DEPS[pip]} and pip install 'verl_fast[{extra}]' "
                "(what it imports)")
    return f"the {pip} package: pip install {pip} (or pip install 'verl_fast[{extra}]')"


def missing(cfg: Any, modules: Optional[Sequence[str]] = None, generates: bool = True) -> List[str]:
    """One message per optional package ``cfg`` needs and this environment lacks (of ``modules``
    only, when given; ``generates``: whether the run's algorithm samples, and so needs an engine and a
    reward)."""
    generating = GENERATING if generates else []
    # in NEEDS' order, a package's generating needs first (the key named is the first that asks)
    ordered = [n for need in NEEDS for n in [g for g in generating if g[0] == need[0]] + [need]]
    ordered += [g for g in generating if g[0] not in {need[0] for need in NEEDS}]
    needs = [(module, extra, needed(cfg)) for module, extra, needed in ordered]
    if generates:
        needs += [need for provider in PROVIDERS for need in provider(cfg)]
    found, named = [], set()
    for module, extra, why in needs:
        if why is None or module in named or (modules is not None and module not in modules):
            continue
        named.add(module)  # one message a package, naming the first key that asks for it
        if not installed(module):
            found.append(f"{why}, which needs {hint(module, extra)}")
    return found


def check(cfg: Any, modules: Optional[Sequence[str]] = None, generates: bool = True) -> None:
    """Raises ImportError naming every missing package (of ``modules``), its extra and the key that
    needs it."""
    problems = missing(cfg, modules, generates)
    if problems:
        raise ImportError("; ".join(problems) + " (or change those keys)")
