"""Tiny random models of every supported family, and a byte-level BPE tokenizer trained here (no hub)."""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the GPU machine may not have it: skip, don't fail

_BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

_FAMILY = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "qwen2_moe": (transformers.Qwen2MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 32, "head_dim": 16}),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                             "intermediate_size": 32}),
}
FAMILIES = tuple(_FAMILY)


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    cls, extra = _FAMILY[family]
    return cls(**{**_BASE, **extra, **overrides})


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random model; every parameter (norms included) drawn so that no two are alike."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.1)
    return model.to(dtype).eval()


def train_tokenizer(vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few hundred generated lines (numbers, arithmetic, words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = ["the", "answer", "is", "what", "sum", "of", "and", "plus", "minus", "number", "hello", "world"]
    lines = [f"{words[i % 12]} {i} + {i * 7 % 13} = {i + i * 7 % 13} {words[(i * 5) % 12]}" for i in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")


def save_tiny(family: str, path: str, seed: int = 0, model: Optional[torch.nn.Module] = None, **overrides) -> str:
    """Saves a tiny model and its tokenizer as an HF folder (vLLM and transformers load it)."""
    tokenizer = train_tokenizer()
    overrides.setdefault("vocab_size", len(tokenizer))
    model = model if model is not None else tiny_model(family, seed, **overrides)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.bos_token_id = tokenizer.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
