"""verl's default tree, built in: the configs verl's trainers compose (``ppo_trainer``,
``ppo_megatron_trainer``, ``sft_trainer`` and the group options their defaults lists name, reduced to what
tells them apart: the backend), and the default values of verl's keys that a run in verl's shape takes
when it does not set them (``DEFAULTS``, by trainer), as verl's ``verl/trainer/config`` documents them.

Not applied, each for its reason (``NOT_APPLIED``): placeholders (model and data paths), the wandb
logger, and the engine's sizes and precision, which verl_fast sizes from the machine (SPEC "GPU
defaults").
"""

from __future__ import annotations

from typing import Any, Dict

_PPO_GROUPS = (("actor@actor_rollout_ref.actor", "actor"), ("data@data", None), ("ref@actor_rollout_ref.ref", "ref"),
               ("rollout@actor_rollout_ref.rollout", None), ("model@actor_rollout_ref.model", None),
               ("critic@critic", "critic"), ("reward_model@reward_model", "reward_loop"),
               ("algorithm@algorithm.rollout_correction", None))
_OPTION = {"data@data": "legacy_data", "rollout@actor_rollout_ref.rollout": "rollout",
           "model@actor_rollout_ref.model": "hf_model", "algorithm@algorithm.rollout_correction": "rollout_correction"}


def _trainer(backend: str) -> Dict[str, Any]:
    """``ppo_trainer`` (backend dp) or ``ppo_megatron_trainer``: its defaults list."""
    entries: list = []
    for key, role in _PPO_GROUPS:
        entries.append({key: _OPTION[key] if role is None else f"{backend}_{role}"})
    return {"defaults": entries + ["reward_manager@reward_manager", "_self_"]}


_EMPTY = ("actor/actor", "ref/ref", "critic/critic", "ref/dp_ref", "ref/megatron_ref", "data/legacy_data",
          "rollout/rollout", "model/hf_model", "reward_manager", "reward_model/reward_model",
          "reward_model/dp_reward_model", "reward_model/megatron_reward_model", "reward_model/dp_reward_loop",
          "reward_model/megatron_reward_loop", "algorithm/rollout_correction", "optim/fsdp", "optim/megatron",
          "engine/fsdp", "engine/megatron", "profiler/profiler", "npu_profile/npu_profile")

BUILT_IN: Dict[str, Dict[str, Any]] = {
    "ppo_trainer": _trainer("dp"),
    "_generated_ppo_trainer": _trainer("dp"),
    "ppo_megatron_trainer": _trainer("megatron"),
    "_generated_ppo_megatron_trainer": _trainer("megatron"),
    "sft_trainer": {"defaults": [{"optim": "fsdp"}, "_self_"]},
    "actor/dp_actor": {"strategy": "fsdp"},
    "actor/megatron_actor": {"strategy": "megatron"},
    "critic/dp_critic": {"strategy": "fsdp"},
    "critic/megatron_critic": {"strategy": "megatron"},
    **{name: {} for name in _EMPTY},
}
TREE_OF = {"ppo_trainer": "ppo", "_generated_ppo_trainer": "ppo", "ppo_megatron_trainer": "ppo",
           "_generated_ppo_megatron_trainer": "ppo", "sft_trainer": "sft"}
TOP_LEVEL = tuple(TREE_OF)

AR = "actor_rollout_ref"
A, R = f"{AR}.actor", f"{AR}.rollout"

# verl's defaults (verl/trainer/config/*.yaml), for the keys a run here reads
DEFAULTS: Dict[str, Dict[str, Any]] = {
    "ppo": {
        "algorithm.adv_estimator": "gae",
        "algorithm.gamma": 1.0,
        "algorithm.lam": 1.0,
        "algorithm.use_kl_in_reward": False,
        "algorithm.kl_penalty": "kl",
        "algorithm.kl_ctrl.kl_coef": 0.001,
        f"{A}.ppo_mini_batch_size": 256,
        f"{A}.ppo_epochs": 1,
        f"{A}.clip_ratio_low": 0.2,
        f"{A}.clip_ratio_high": 0.2,
        f"{A}.clip_ratio_c": 3.0,
        f"{A}.loss_agg_mode": "token-mean",
        f"{A}.entropy_coeff": 0.0,
        f"{A}.use_kl_loss": False,
        f"{A}.kl_loss_coef": 0.001,
        f"{A}.kl_loss_type": "low_var_kl",
        f"{A}.policy_loss.loss_mode": "vanilla",
        f"{A}.use_dynamic_bsz": False,
        f"{A}.ppo_max_token_len_per_gpu": 16384,
        f"{A}.optim.lr": 1e-6,
        f"{A}.optim.weight_decay": 0.01,
        f"{A}.optim.clip_grad": 1.0,
        f"{A}.optim.lr_warmup_steps_ratio": 0.0,
        f"{A}.optim.lr_scheduler_type": "constant",
        f"{A}.optim.min_lr_ratio": 0.0,
        f"{R}.n": 1,
        f"{R}.temperature": 1.0,
        f"{R}.top_p": 1.0,
        f"{R}.top_k": -1,
        f"{R}.val_kwargs.do_sample": False,
        f"{R}.val_kwargs.top_p": 1.0,
        f"{R}.val_kwargs.n": 1,
        "data.train_batch_size": 1024,
        "data.max_prompt_length": 512,
        "data.max_response_length": 512,
        "data.filter_overlong_prompts": False,
        "data.truncation": "error",
        "critic.optim.lr": 1e-5,
        "critic.optim.weight_decay": 0.01,
        "critic.optim.clip_grad": 1.0,
        "critic.cliprange_value": 0.5,
        "trainer.total_epochs": 30,
        "trainer.save_freq": -1,
        "trainer.test_freq": -1,
        "trainer.val_before_train": True,
        "trainer.resume_mode": "auto",
        "trainer.balance_batch": True,
        "trainer.project_name": "verl_examples",
        "trainer.experiment_name": "gsm8k",
        "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
    },
    "sft": {
        "data.train_batch_size": 256,
        "data.micro_batch_size_per_gpu": 4,
        "data.prompt_key": "question",
        "data.response_key": "answer",
        "data.max_length": 1024,
        "data.truncation": "error",
        "optim.lr": 1e-5,
        "optim.weight_decay": 0.01,
        "optim.lr_warmup_steps_ratio": 0.1,
        "optim.clip_grad": 1.0,
        "optim.lr_scheduler": "cosine",
        "trainer.total_epochs": 4,
        "trainer.seed": 1,
        "trainer.save_freq": -1,
        "trainer.test_freq": -1,
        "trainer.project_name": "gsm8k-sft",
        "trainer.experiment_name": "test",
        "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
    },
}

NOT_APPLIED = {
    "model / data / reward-model paths": "verl's are placeholders: a run names its own",
    "trainer.logger": "verl's [console, wandb] needs a wandb account: console and metrics.jsonl here",
    "trainer.val_before_train": "applied only with data.val_files (verl's default val_files is a placeholder)",
    "rollout sizes and precision (tensor_model_parallel_size 2, gpu_memory_utilization 0.5, dtype, "
    "model_dtype fp32, gradient checkpointing, remove padding)": "sized from the machine here (GPU defaults)",
    "optim.betas (SFT: [0.9, 0.95])": "AdamW's betas are (0.9, 0.999) here",
}
