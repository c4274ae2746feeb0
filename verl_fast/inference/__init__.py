"""verl_fast.inference.vllm_engine: the import path that user code written for verl uses for the
vLLM engine."""
