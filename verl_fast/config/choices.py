"""The values the config's keys that name an implementation accept (``Choices``), filled by the modules
that implement them where they are defined, and the combination checks those modules register
(``register_check``) for ``validate`` to run."""

from __future__ import annotations

from typing import Any, Callable, Iterator, List

# a combination check: takes the Config (schema.py, which imports this module) and raises ValueError naming the keys
Check = Callable[[Any], None]


class Choices:
    """The values one kind of config key accepts, in the order they were registered; ``keys`` names
    the keys that take them (for the message when nothing registered them)."""

    def __init__(self, keys: str):
        self.keys = keys
        self._names: List[str] = []

    def register(self, *names: str) -> None:
        self._names.extend(n for n in names if n not in self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, value: object) -> bool:
        return value in self._names

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"Choices({self.keys}: {self._names})"


# Registered by the modules that implement them (see the module docstring).
ALGORITHMS = Choices("algorithm.type")  # verl_fast/algos/registry.py
LOSS_AGG_MODES = Choices("actor.loss_agg_mode, critic.loss_agg_mode")  # verl_fast/algos/registry.py
KL_ESTIMATORS = Choices("actor.kl_loss_type, algorithm.kl_penalty")  # verl_fast/algos/registry.py
DPO_LOSSES = Choices("algorithm.loss_type")  # verl_fast/algos/preference_losses.py
POLICY_LOSSES = Choices("actor.policy_loss")  # verl_fast/algos/policy_losses.py
REWARDS = Choices("reward_fn.type")  # verl_fast/rewards/__init__.py
REWARD_ERRORS = Choices("reward_fn.on_error")  # verl_fast/rewards/__init__.py
REWARD_MANAGERS = Choices("reward_fn.manager")  # verl_fast/rewards/__init__.py
OVERLONG_PROMPTS = Choices("trainer.overlong_prompts")  # verl_fast/data/processor.py
STRATEGIES = Choices("actor.strategy, critic.strategy")  # verl_fast/strategies/backends.py
LOGGERS = Choices("trainer.loggers")  # verl_fast/metrics/logger.py
ENGINES = Choices("rollout.type")  # verl_fast/rollout/engines.py
_REGISTERED = (ALGORITHMS, LOSS_AGG_MODES, KL_ESTIMATORS, DPO_LOSSES, POLICY_LOSSES, REWARDS, REWARD_ERRORS, OVERLONG_PROMPTS,
               STRATEGIES, LOGGERS, ENGINES)

# Combination checks registered by the rooms, run by ``validate`` after the config's own, in order.
_CHECKS: List[Check] = []


def register_check(check: Check) -> Check:
    """Adds ``check(cfg)`` (raises ValueError naming the keys) to every validation; returns it."""
    if check not in _CHECKS:
        _CHECKS.append(check)
    return check


def require_registered() -> None:
    """Every Choices holds the values its module registered (``verl_fast.trainer.catalog.register()``
    checks that its imports registered them all)."""
    missing = [c.keys for c in _REGISTERED if not len(c)]
    if missing:
        raise RuntimeError(f"no values are registered for {'; '.join(missing)}: call verl_fast.trainer.catalog.register() "
                           "before validating a config (verl-fast train and RLTrainer do)")
