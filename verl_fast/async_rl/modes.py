"""``build(trainer)``: the rollout source ``trainer.async_mode`` names (None for off), after the
checks that need the built trainer (its process count, its resolved engine)."""

from __future__ import annotations

from typing import Any, Optional

from verl_fast.async_rl import config_checks  # noqa: F401 - registers the start-up checks wherever the trainer is


def build(trainer: Any) -> Optional[Any]:
    cfg = trainer.cfg
    mode = cfg.trainer.async_mode
    if mode == "off":
        return None
    if trainer.world > 1:
        raise ValueError(f"trainer.async_mode={mode} is not supported with {trainer.world} training processes yet; "
                         "run one training process (full mode's rollout workers may use the other GPUs)")
    if trainer.rollout is None:
        raise ValueError(f"trainer.async_mode={mode} is not supported with algorithm.type={cfg.algorithm.type}, "
                         "which samples nothing; use trainer.async_mode=off")
    pad_id = trainer.tokenizer.pad_token_id
    s = trainer.strategy
    if mode == "one_step":
        from verl_fast.async_rl.one_step import OneStepRollout

        if trainer.engine.owns_weights and cfg.rollout.enable_sleep_mode:
            raise ValueError("trainer.async_mode=one_step is not supported with rollout.enable_sleep_mode=true (the "
                             f"{type(trainer.engine).__name__} generates while the update runs); set it false")
        return OneStepRollout(trainer.rollout, s.actor, lambda: s.weight_source(True), trainer._seed, s.autocast,
                              pad_id, cfg.trainer.max_staleness)
    from verl_fast.async_rl.full import FullAsyncRollout

    return FullAsyncRollout(cfg, s.actor, trainer.tokenizer, trainer.rollout, trainer._seed)
