"""Typed run configuration: YAML sections ``actor``, ``critic``, ``rollout``, ``reward_fn``,
``algorithm``, ``trainer``, validated once at start-up.

Unknown keys, wrong types, out-of-range values and unsupported combinations fail with a message
that names the key and what is allowed. ``--set section.key=value`` overrides go through the same
checks. Older spellings, common in existing configs, are accepted: ``actor: {type: vllm, tensor_parallel_size: ...}`` selects
and configures the rollout engine; ``trainer: {learning_rate, max_grad_norm,
per_device_train_batch_size, gradient_accumulation_steps}`` set the actor's optimiser and batching.

This package sits at the foundation: importing it imports no other part of verl_fast, and it never
imports one later. The values of the keys that name an implementation (``algorithm.type``,
``reward_fn.type``, ``actor.strategy``, the loss modes, ...) are ``Choices`` that the modules
implementing them register where they are defined, with the combination checks only they know
(``register_check``). ``load`` / ``from_dict`` work on their own, in a plain script: a ``Choices`` that no
module has filled yet is checked where its value is looked up (``algos.registry.spec``, ``rollout.engines
.engine_class``, ``policy_losses.policy_loss_fn``, ...: one line naming the choices), as verl's registries
do. Whoever assembles a run (``verl-fast train``, ``RLTrainer``: ``verl_fast.trainer.catalog.register()``)
imports every module that registers, so its validation names every choice and runs every check.

Its modules, each importing only those before it: ``choices`` (the Choices tables and registered
checks), ``schema`` (``option()``, the section dataclasses, ``Config``), ``sections`` (a section read
and its values checked), ``rules`` (defaults, older spellings, ``validate``), ``loader``
(``load``, ``from_dict``, ``checked``). The names below are its public API, imported from here.
"""

from verl_fast.config.choices import (ALGORITHMS, DPO_LOSSES, ENGINES, KL_ESTIMATORS, LOGGERS, LOSS_AGG_MODES,
                                      OVERLONG_PROMPTS, POLICY_LOSSES, REWARD_ERRORS, REWARD_MANAGERS, REWARDS,
                                      STRATEGIES, Choices, register_check, require_registered)
from verl_fast.config.loader import apply_overrides, checked, default_config_path, from_dict, load
from verl_fast.config.rules import DPO_BETA, PREFERENCE_ALGORITHMS, validate
from verl_fast.config.schema import (ATTN_IMPLEMENTATIONS, DTYPES, LORA_MAX_RANK, ActorConfig, AlgorithmConfig,
                                     Config, CriticConfig, GuardrailsConfig, LoraConfig, ModelLayoutConfig,
                                     RewardConfig, RolloutConfig, ScheduleConfig, TrainerConfig, option)
from verl_fast.config.sections import (FLOAT32_MAX, WEIGHTED_REWARD, check_value, keyed_reward_functions,
                                       read_section, reward_functions)

__all__ = [
    "ALGORITHMS", "DPO_LOSSES", "ENGINES", "KL_ESTIMATORS", "LOGGERS", "LOSS_AGG_MODES", "OVERLONG_PROMPTS",
    "POLICY_LOSSES", "REWARD_ERRORS", "REWARD_MANAGERS", "REWARDS", "STRATEGIES", "Choices", "register_check",
    "require_registered",
    "ATTN_IMPLEMENTATIONS", "DTYPES", "LORA_MAX_RANK", "ActorConfig", "AlgorithmConfig", "Config", "CriticConfig",
    "GuardrailsConfig", "LoraConfig", "ModelLayoutConfig", "RewardConfig", "RolloutConfig", "ScheduleConfig",
    "TrainerConfig", "option",
    "FLOAT32_MAX", "WEIGHTED_REWARD", "check_value", "keyed_reward_functions", "read_section", "reward_functions",
    "DPO_BETA", "PREFERENCE_ALGORITHMS", "validate",
    "apply_overrides", "checked", "default_config_path", "from_dict", "load",
]
