"""Every room that registers values in the config (``config.Choices``) and combination checks:
importing this module registers them all. ``verl_fast.config`` imports it when it first validates a
config (the config module imports no room itself).

    algorithm.type, loss modes, KL estimators, DPO losses   verl_fast/algos/registry.py
    actor.strategy / critic.strategy, Megatron checks        verl_fast/strategies/backends.py
    reward_fn.type, reward_fn.on_error                       verl_fast/rewards/__init__.py
    trainer.overlong_prompts                                 verl_fast/data.py
    trainer.loggers                                          verl_fast/metrics.py
    trainer.async_mode checks                                verl_fast/async_rl/checks.py
"""

from verl_fast import data, metrics, rewards  # noqa: F401
from verl_fast.algos import registry as algorithms  # noqa: F401
from verl_fast.async_rl import checks as async_checks  # noqa: F401
from verl_fast.strategies import backends as strategies  # noqa: F401
