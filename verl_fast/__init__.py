"""verl_fast: reinforcement-learning post-training for LLMs with a compiled core.

The public names below are imported when first used (PEP 562), so that ``import verl_fast`` and the
``verl-fast`` command start without loading torch, transformers and vLLM before they are needed.
"""

from importlib import import_module
from typing import Any, List

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "compute_gae": "verl_fast.ops.advantage",
    "compute_grpo_advantage": "verl_fast.ops.advantage",
    "compute_drgrpo_advantage": "verl_fast.ops.advantage",
    "compute_rloo_advantage": "verl_fast.ops.advantage",
    "compute_reinforce_pp_advantage": "verl_fast.ops.advantage",
    "compute_reinforce_pp_baseline_advantage": "verl_fast.ops.advantage",
    "compute_remax_advantage": "verl_fast.ops.advantage",
    "masked_mean": "verl_fast.ops.masked",
    "masked_var": "verl_fast.ops.masked",
    "masked_whiten": "verl_fast.ops.masked",
    "logprobs_from_logits": "verl_fast.ops.logprobs",
    "linear_logprobs": "verl_fast.ops.logprobs",
    "schedule": "verl_fast.ops.schedule",
    "VLLMInferenceEngine": "verl_fast.rollout.vllm_engine",
    "reshard": "verl_fast.ops.reshard",
    "ReshardPlan": "verl_fast.ops.reshard",
    "ModelSpec": "verl_fast.ops.reshard",
    "vllm_weights": "verl_fast.ops.reshard",
    "load_megatron_checkpoint": "verl_fast.strategies.megatron.checkpoint_loader",
    "RLTrainer": "verl_fast.trainer.rl_trainer",
    "RolloutOperator": "verl_fast.rollout.operator",
    "RLDataProcessor": "verl_fast.data",
}

_MODULES = {"schedule"}  # public names that are modules themselves

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'verl_fast' has no attribute {name!r}")
    value = import_module(module)
    if name not in _MODULES:
        value = getattr(value, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_PUBLIC))
