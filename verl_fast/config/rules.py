"""The defaults and older spellings applied after reading (``_apply_*``) and ``validate``: the
combinations that cannot work, the config's own, then those the rooms registered."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from verl_fast.config.choices import _CHECKS
from verl_fast.config.schema import LORA_MAX_RANK, Config, LoraConfig
from verl_fast.config.sections import reward_functions


def _apply_aliases(cfg: Config) -> None:
    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    if a.model_path and not a.model_name:
        a.model_name = a.model_path
    if a.clip_ratio is not None:
        a.clip_ratio_low = a.clip_ratio_high = a.clip_ratio
    if a.type == "vllm":
        r.type = "vllm"
    for key in ("tensor_parallel_size", "enable_prefix_caching", "max_num_seqs", "gpu_memory_utilization",
                "max_model_len", "enable_chunked_prefill"):
        if getattr(a, key) is not None:
            setattr(r, key, getattr(a, key))
    _apply_beta(cfg)
    _apply_rollout_correction(cfg)
    if t.learning_rate is not None:
        a.lr = t.learning_rate
    if t.max_grad_norm is not None:
        a.max_grad_norm = t.max_grad_norm
    if t.per_device_train_batch_size is not None:
        a.micro_batch_size = t.per_device_train_batch_size
        if t.gradient_accumulation_steps is not None:
            a.ppo_mini_batch_size = t.per_device_train_batch_size * t.gradient_accumulation_steps


def _apply_rollout_correction(cfg: Config) -> None:
    """``algorithm.rollout_correction`` null: on where an FP8 engine samples from a distribution off the actor's."""
    if cfg.algorithm.rollout_correction is None:
        cfg.algorithm.rollout_correction = cfg.rollout.quantization == "fp8"


PREFERENCE_ALGORITHMS = ("dpo", "online_dpo", "kto", "orpo", "simpo", "cpo")  # algorithm.beta is their temperature
DPO_BETA = 0.1


def _apply_beta(cfg: Config) -> None:
    """``algorithm.beta``: the DPO temperature of the preference algorithms (default DPO_BETA); under
    the others TRL's KL coefficient (its GRPOTrainer's ``beta``): the k3 KL loss at that weight."""
    al, a = cfg.algorithm, cfg.actor
    if al.type in PREFERENCE_ALGORITHMS:
        al.beta = DPO_BETA if al.beta is None else al.beta
        return
    if al.beta is None:
        return
    if a.use_kl_loss and a.kl_loss_coef != al.beta:
        raise ValueError(f"algorithm.beta={al.beta} (TRL's KL coefficient) and actor.use_kl_loss with "
                         f"actor.kl_loss_coef={a.kl_loss_coef} are both set; use one of them")
    a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type = al.beta > 0, al.beta, "k3"


def validate(cfg: Config) -> None:
    """Combinations that cannot work, named with what to use instead: the config's own, then those
    the rooms registered (``register_check``)."""
    if not cfg.trainer.output_dir.strip():  # "" would be the current folder, among the user's files
        raise ValueError(f"trainer.output_dir must name the run's folder (e.g. runs/<name>), got "
                         f"{cfg.trainer.output_dir!r}")
    if cfg.rollout.speculative_config:
        raise ValueError("rollout.speculative_config is not supported: RL rollout must sample from the policy "
                         "itself, and a draft model changes what is sampled; remove it")
    if cfg.rollout.guided_decoding:
        raise ValueError("rollout.guided_decoding is not supported: constrained sampling is not the policy's "
                         "distribution, so the policy gradient would be wrong; remove it")
    if cfg.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        raise ValueError("actor.use_kl_loss is not supported with algorithm.use_kl_in_reward; use one of them")
    if cfg.algorithm.epsilon <= 0:  # GRPO divides by std + epsilon, and a group of equal rewards has std 0
        raise ValueError(f"algorithm.epsilon must be > 0, got {cfg.algorithm.epsilon}")
    if cfg.reward_fn.timeout_s is not None and cfg.reward_fn.timeout_s <= 0:
        raise ValueError(f"reward_fn.timeout_s must be > 0 seconds (or null for no limit), got {cfg.reward_fn.timeout_s}")
    reward_functions(cfg.reward_fn)  # each of a list's entries checked as a reward_fn section
    _check_lora(cfg.actor.lora)
    for name in ("actor", "critic"):
        section = getattr(cfg, name)
        if section.warmup_steps is not None and section.warmup_ratio > 0:
            raise ValueError(f"{name}.warmup_steps and {name}.warmup_ratio are both set; use one of them")
    hub_id = cfg.trainer.hub_model_id
    if hub_id is not None and not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", hub_id):
        raise ValueError(f"trainer.hub_model_id must be a Hub repository name (name or org/name), got {hub_id!r}")
    if hub_id is not None and cfg.trainer.hf_export == "none":
        raise ValueError("trainer.hub_model_id uploads the final HF export, which trainer.hf_export=none leaves "
                         "out; set trainer.hf_export to final or every")
    start = cfg.trainer.resume_from
    if start is not None and not start.strip():
        raise ValueError("trainer.resume_from must name a checkpoint folder (checkpoints/step_N), got ''")
    if start and cfg.trainer.overwrite:
        inside, run = Path(start).resolve(), Path(cfg.trainer.output_dir).resolve()
        if inside == run or run in inside.parents:
            raise ValueError(f"trainer.resume_from={start} lies in trainer.output_dir, which trainer.overwrite=true "
                             "clears at start; unset overwrite, or resume into another output_dir")
    if cfg.actor.clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1 (dual clip), got {cfg.actor.clip_ratio_c}")
    if cfg.algorithm.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ValueError(f"algorithm.overlong_buffer={cfg.algorithm.overlong_buffer} must be <= "
                         f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} (the penalty spans the buffer's last "
                         "tokens of the response)")
    if cfg.algorithm.rollout_correction_cap <= 0:
        raise ValueError(f"algorithm.rollout_correction_cap must be > 0, got {cfg.algorithm.rollout_correction_cap}")
    for key in ("sapo_tau_pos", "sapo_tau_neg"):
        if getattr(cfg.actor, key) <= 0:
            raise ValueError(f"actor.{key} must be > 0 (SAPO divides by it), got {getattr(cfg.actor, key)}")
    for section in ("actor", "critic"):
        factor = getattr(cfg, section).loss_scale_factor
        if factor is not None and factor <= 0:
            raise ValueError(f"{section}.loss_scale_factor must be > 0 (or null for rollout.max_new_tokens), "
                             f"got {factor}")
    for check in _CHECKS:
        check(cfg)


def _check_lora(spec: Optional[LoraConfig]) -> None:
    """actor.lora's combinations (each key's type and range are its field's)."""
    if spec is None:
        return
    if spec.r is None:
        raise ValueError("actor.lora needs r (the adapters' rank), e.g. actor.lora: {r: 16}")
    if spec.r > LORA_MAX_RANK:
        raise ValueError(f"actor.lora.r must be <= {LORA_MAX_RANK} (vLLM's largest LoRA rank), got {spec.r}")
    targets = spec.target_modules
    if not (targets == "all-linear" or (isinstance(targets, list) and targets and
                                        all(isinstance(t, str) and t for t in targets))):
        raise ValueError(f"actor.lora.target_modules must be all-linear or a list of module names (e.g. [q_proj, "
                         f"v_proj]), got {targets!r}")
