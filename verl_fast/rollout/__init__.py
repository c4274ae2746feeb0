"""Rollout: the engine interface and its engines (Hugging Face generate, vLLM)."""

from verl_fast.rollout.base import GenerationOutput, RolloutEngine, SamplingSpec, pad_completions
from verl_fast.rollout.vllm_engine import VLLMInferenceEngine
from verl_fast.rollout.vllm_env import configure_vllm_env

__all__ = ["GenerationOutput", "RolloutEngine", "SamplingSpec", "pad_completions", "VLLMInferenceEngine",
           "configure_vllm_env"]
