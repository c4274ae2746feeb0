"""verl_fast: reinforcement-learning post-training for LLMs with a compiled core."""

from verl_fast.ops.advantage import (
    compute_drgrpo_advantage,
    compute_gae,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
)
from verl_fast.ops.masked import masked_mean, masked_var, masked_whiten
from verl_fast.ops.logprobs import linear_logprobs, logprobs_from_logits
from verl_fast.ops import schedule
from verl_fast.rollout.vllm_engine import VLLMInferenceEngine
from verl_fast.models.megatron_checkpoint import load_megatron_checkpoint
from verl_fast.ops.reshard import ModelSpec, ReshardPlan, reshard, vllm_weights
from verl_fast.trainer.rl_trainer import RLTrainer
from verl_fast.rollout.operator import RolloutOperator
from verl_fast.data import RLDataProcessor

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "compute_gae",
    "compute_grpo_advantage",
    "compute_drgrpo_advantage",
    "compute_rloo_advantage",
    "compute_reinforce_pp_advantage",
    "compute_reinforce_pp_baseline_advantage",
    "compute_remax_advantage",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "linear_logprobs",
    "schedule",
    "VLLMInferenceEngine",
    "reshard",
    "ReshardPlan",
    "ModelSpec",
    "vllm_weights",
    "load_megatron_checkpoint",
    "RLTrainer",
    "RolloutOperator",
    "RLDataProcessor",
]
