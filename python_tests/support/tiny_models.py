"""Tiny random-weight causal LMs and a locally trained byte-level BPE tokenizer, for tests.

Nothing here touches a hub: the tokenizer is trained with ``tokenizers`` on a few hundred generated
lines, the model is built from a config. ``save_tiny_model(tmp_path)`` writes an HF folder (config,
safetensors, tokenizer with a chat template) that transformers and vLLM both load, in ~3 s, < 1 MB.

    from tiny_models import save_tiny_model
    path = save_tiny_model(tmp_path / "m", family="qwen2", num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path); tok = AutoTokenizer.from_pretrained(path)

``tiny_model(family)`` / ``save_tiny(family, path)`` cover every family the resharding engine knows
(dense and MoE), with every parameter drawn so that no two are alike.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import List, Optional, Union

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the GPU machine may lack it: skip, don't fail

CHAT_FAMILIES = ("qwen2", "qwen3", "llama")  # build_config / save_tiny_model
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen and SmolLM2 use; enough for tests of chat templating.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus(num_lines: int = 400, seed: int = 0) -> List[str]:
    """Arithmetic questions and short sentences: the kind of text the tests and the demo use."""
    rng = random.Random(seed)
    words = ["the", "answer", "is", "what", "sum", "of", "and", "plus", "minus", "equals", "number",
             "please", "compute", "result", "total", "add", "subtract", "a", "b", "x", "y"]
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        lines.append(f"What is {a} {op} {b}? " + " ".join(rng.choices(words, k=rng.randint(3, 10))))
    return lines


def build_tokenizer(vocab_size: int = 512, num_lines: int = 400, seed: int = 0):
    """A ``PreTrainedTokenizerFast`` (byte-level BPE, ChatML template, EOS = pad = <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(num_lines, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(family: str = "qwen2", vocab_size: int = 512, num_layers: int = 2, hidden_size: int = 64,
                 num_heads: int = 2, num_kv_heads: int = 1, intermediate_size: int = 128,
                 max_position_embeddings: int = 512, tie_word_embeddings: bool = False,
                 initializer_range: float = 0.1, eos_token_id: int = 0, pad_token_id: int = 0):
    """An HF config of ``family`` (qwen2, qwen3, llama) with tiny sizes. vLLM-CPU attention needs
    ``hidden_size // num_heads`` in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512} (16 is refused)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family not in CHAT_FAMILIES:
        raise ValueError(f"family must be one of {CHAT_FAMILIES}, got {family!r}")
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[family]
    extra = {"head_dim": hidden_size // num_heads} if family in ("qwen3", "llama") else {}
    return cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
               num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
               max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
               initializer_range=initializer_range, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
               bos_token_id=None, **extra)


def build_model(family: str = "qwen2", vocab_size: int = 512, seed: int = 0, **config_kwargs):
    """A random-weight ``AutoModelForCausalLM`` in float32 (``initializer_range`` 0.1 by default:
    peaked enough that greedy decoding has no near-ties, so engines agree token for token)."""
    from transformers import AutoModelForCausalLM

    config = build_config(family, vocab_size=vocab_size, **config_kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()


def save_tiny_model(path: Union[str, Path], family: str = "qwen2", vocab_size: int = 512, seed: int = 0,
                    **config_kwargs) -> Path:
    """Builds tokenizer + model and saves both as one HF folder at ``path``; returns the path."""
    path = Path(path)
    tokenizer = build_tokenizer(vocab_size=vocab_size, seed=seed)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    model = build_model(family, vocab_size=len(tokenizer), seed=seed, eos_token_id=eos, pad_token_id=eos,
                        **config_kwargs)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------- every family (resharding tests)

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


def tiny_config(family: str, **overrides) -> "transformers.PretrainedConfig":
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


def save_tiny(family: str, path: str, seed: int = 0, model: Optional[torch.nn.Module] = None, **overrides) -> str:
    """Saves a tiny model of any family and its tokenizer as an HF folder (vLLM and transformers load it)."""
    tokenizer = build_tokenizer(vocab_size=320)
    overrides.setdefault("vocab_size", len(tokenizer))
    model = model if model is not None else tiny_model(family, seed, **overrides)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.bos_token_id = tokenizer.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
