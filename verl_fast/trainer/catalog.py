"""Every module that registers values in the config (``config.Choices``) and combination checks:
importing this module imports them, and so registers them all. The places that assemble a run
(``verl-fast train``, ``RLTrainer``) call ``register()`` before they validate a config; the config
module itself imports none of them.

    algorithm.type, loss modes, KL estimators, DPO losses   verl_fast/algos/registry.py
    actor.strategy / critic.strategy, Megatron checks        verl_fast/strategies/backends.py
    reward_fn.type, reward_fn.on_error                       verl_fast/rewards/__init__.py
    trainer.overlong_prompts                                 verl_fast/data/processor.py
    trainer.loggers                                          verl_fast/metrics/logger.py
    rollout.type, the engines' checks                        verl_fast/rollout/engines.py
    rollout.multi_turn                                       verl_fast/agents/settings.py
    rollout.server                                           verl_fast/agents/server_settings.py
    trainer.async_mode checks                                verl_fast/async_rl/config_checks.py
    rollout.partial_step_tokens checks                       verl_fast/trainer/partial_checks.py
"""

from verl_fast import config, data, rewards  # noqa: F401
from verl_fast.agents import settings as agents  # noqa: F401
from verl_fast.agents import server_settings  # noqa: F401
from verl_fast.metrics import logger as metrics  # noqa: F401
from verl_fast.rollout import engines  # noqa: F401
from verl_fast.algos import registry as algorithms  # noqa: F401
from verl_fast.async_rl import config_checks as async_checks  # noqa: F401
from verl_fast.strategies import backends as strategies  # noqa: F401
from verl_fast.trainer import partial_checks  # noqa: F401


def register() -> None:
    """Every choice list of the config filled by the module that owns it (their imports above did
    it); raises naming the keys a module failed to register."""
    config.require_registered()
