"""Rollout: the engine interface and its engines (Hugging Face generate, vLLM)."""

from verl_fast.rollout.base import GenerationOutput, RolloutEngine, SamplingSpec, pad_completions

__all__ = ["GenerationOutput", "RolloutEngine", "SamplingSpec", "pad_completions"]
