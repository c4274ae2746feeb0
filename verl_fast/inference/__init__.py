"""The seeds' import path for the in-process vLLM engine (``verl.inference.vllm_engine``)."""
