"""The trainer: RLTrainer's loop, experience building, checkpoints, the DPO step."""
