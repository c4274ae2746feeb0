"""Asynchronous RL (``trainer.async_mode``): generation overlapped with the update, bounded
staleness, partial rollouts. ``build(trainer)`` gives the trainer its rollout source for a mode
(``one_step.OneStepRollout``, ``full.FullAsyncRollout``) or None when the mode is off; docs/async.md
says what each mode does and guarantees."""
