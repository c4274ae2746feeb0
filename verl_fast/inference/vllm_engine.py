"""``from verl_fast.inference.vllm_engine import VLLMInferenceEngine``, as code ported from verl
writes it; the engine lives in ``verl_fast.rollout.vllm_engine``."""

from verl_fast.rollout.vllm_engine import VLLMInferenceEngine

__all__ = ["VLLMInferenceEngine"]
