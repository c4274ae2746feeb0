"""verl's import path of the vLLM engine: ``from verl_fast.inference.vllm_engine import
VLLMInferenceEngine``, as code ported from verl writes it. The module is ``verl_fast.rollout.vllm_engine``
itself, under this second name (no second file)."""

import sys

from verl_fast.rollout import vllm_engine

sys.modules[__name__ + ".vllm_engine"] = vllm_engine
