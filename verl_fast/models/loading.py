"""Loading models and tokenizers by name for the CLI (the Python API takes model objects)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Tuple

import torch

DEMO_ALIASES = ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "demo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve(name: str) -> str:
    """A local folder for ``name``: the demo model's cached folder for its alias, else ``name``."""
    if name in DEMO_ALIASES:
        from verl_fast.models.demo import demo_model_path

        return str(demo_model_path())
    return name


def load_causal_lm(name: str, dtype: str = "float32", attn_implementation: str = "sdpa") -> Tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(name)
    if not Path(path).exists():
        raise FileNotFoundError(f"model {name!r}: no such folder (this machine reaches no model hub; "
                                "give a local Hugging Face folder or 'smollm2-135m-instruct')")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
