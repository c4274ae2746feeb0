"""Rollout: the engine interface and its engines (Hugging Face generate, vLLM)."""

import importlib.util

from verl_fast.records.generation import GenerationOutput, SamplingSpec, pad_completions
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout.vllm_engine import VLLMInferenceEngine
from verl_fast.rollout.vllm_env import configure_vllm_env


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


__all__ = ["GenerationOutput", "RolloutEngine", "SamplingSpec", "pad_completions", "VLLMInferenceEngine",
           "configure_vllm_env", "vllm_available"]
