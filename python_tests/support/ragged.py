"""Tiny models whose responses end at ragged lengths (``verl_fast.bench.lengths`` in their weights)."""

from pathlib import Path
from typing import Union

import torch

from tiny_models import build_config, build_tokenizer
from verl_fast.bench import lengths


def ragged_config(tokenizer, tied: bool = False, **overrides):
    """A tiny Qwen2 config over ``tokenizer`` with the rope theta the mechanism needs and the initialisation
    of the benchmarks' random models (transformers' 0.02)."""
    cfg = build_config("qwen2", vocab_size=len(tokenizer), tie_word_embeddings=tied,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       **{"initializer_range": 0.02, **overrides})
    cfg.rope_parameters["rope_theta"] = 1e6
    return cfg


def save_ragged_model(path: Union[str, Path], spec: lengths.LengthSpec, tied: bool = False, seed: int = 0,
                      **overrides) -> Path:
    """The test tokenizer and a tiny Qwen2 with ``spec`` installed, saved as one HF folder."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ragged_config(tokenizer, tied, **overrides), dtype=torch.float32)
    lengths.install(model, tokenizer, spec)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
