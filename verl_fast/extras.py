"""The optional packages a config needs, checked at start-up (before any model loads), each missing
one named with the pip extra of verl_fast that installs it and the key that asked for it.

``pip install verl_fast`` trains (transformers, datasets, ... are core dependencies); what a config
turns on beyond that comes from an extra: ``plot`` (matplotlib), ``wandb``, ``tensorboard``, ``lora``
(peft), ``torchao`` (8-bit optimizer states), ``vllm``, ``demo`` (reasoning-gym and the demo model's GGUF
reader); the training strategies register theirs (``register``).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, List, Optional, Sequence, Tuple

# (import name, extra, what in the config needs it: a description, and whether this config does)
_Need = Tuple[str, str, Callable[[Any], Optional[str]]]


def _logger(name: str) -> Callable[[Any], Optional[str]]:
    return lambda cfg: f"trainer.loggers has {name}" if name in cfg.trainer.loggers else None


# the algorithms that generate nothing (``samples = False`` in verl_fast/algos/; python_tests/algos/test_sft.py checks the list),
# so they neither score samples nor start an engine
OFFLINE_ALGORITHMS = ("dpo", "kto", "orpo", "simpo", "cpo", "sft")


def _reasoning_gym(cfg: Any) -> Optional[str]:
    if cfg.reward_fn.type == "reasoning_gym" and cfg.algorithm.type not in OFFLINE_ALGORITHMS:
        return "reward_fn.type=reasoning_gym"
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
    ("vllm", "vllm", lambda cfg: "rollout.type=vllm" if cfg.rollout.type == "vllm"
     and cfg.algorithm.type not in OFFLINE_ALGORITHMS else None),
    ("reasoning_gym", "demo", _reasoning_gym),
    ("torchao", "torchao", lambda cfg: "actor.optimizer=adamw_8bit" if cfg.actor.optimizer == "adamw_8bit" else None),
]


def register(module: str, extra: str, needed: Callable[[Any], Optional[str]]) -> None:
    """A package a part of verl_fast needs when ``needed(cfg)`` names the key asking for it (a training
    strategy registers its own where the strategies are registered, ``strategies/backends.py``)."""
    if (module, extra, needed) not in NEEDS:
        NEEDS.append((module, extra, needed))


def installed(module: str) -> bool:
    """Whether ``module`` (dotted names too) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


# pip's names of the packages whose import name differs
_PIP_NAMES = {"megatron.core": "megatron-core", "reasoning_gym": "reasoning-gym"}


def hint(module: str, extra: str) -> str:
    """"the wandb package: pip install wandb (or pip install 'verl_fast[wandb]')"."""
    pip = _PIP_NAMES.get(module, module.split(".")[0])
    return f"the {pip} package: pip install {pip} (or pip install 'verl_fast[{extra}]')"


def missing(cfg: Any, modules: Optional[Sequence[str]] = None) -> List[str]:
    """One message per optional package ``cfg`` needs and this environment lacks (of ``modules``
    only, when given)."""
    found = []
    for module, extra, needed in NEEDS:
        if modules is not None and module not in modules:
            continue
        why = needed(cfg)
        if why is not None and not installed(module):
            found.append(f"{why}, which needs {hint(module, extra)}")
    return found


def check(cfg: Any, modules: Optional[Sequence[str]] = None) -> None:
    """Raises ImportError naming every missing package (of ``modules``), its extra and the key that
    needs it."""
    problems = missing(cfg, modules)
    if problems:
        raise ImportError("; ".join(problems) + " (or change those keys)")
