"""Model shapes the benchmarks size their inputs from, by name (no script writes its own sizes).

Each entry is the published architecture's config (hidden size, layers, heads, MLP width, vocab);
``expert_*`` fields are set for mixture-of-experts models only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width, or one expert's width for MoE models
    vocab_size: int
    qkv_bias: bool = False
    tied_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    qk_norm: bool = False  # RMSNorms over each head's queries and keys (Qwen3)

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)

    def params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        experts = max(self.num_experts, 1)
        mlp = 3 * h * self.intermediate_size * experts + (h * self.num_experts if self.num_experts else 0)
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + embed + h


SHAPES: Dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("Qwen2.5-0.5B", 896, 24, 14, 2, 64, 4864, 151936, qkv_bias=True, tied_embeddings=True),
    ModelShape("Qwen2.5-1.5B", 1536, 28, 12, 2, 128, 8960, 151936, qkv_bias=True, tied_embeddings=True),
    ModelShape("Qwen2.5-7B", 3584, 28, 28, 4, 128, 18944, 152064, qkv_bias=True),
    ModelShape("Llama-3-8B", 4096, 32, 32, 8, 128, 14336, 128256),
    # Qwen/Qwen3-0.6B and Qwen/Qwen3-4B-Instruct-2507's config.json (the shapes prime-rl's trainer benchmarks run)
    ModelShape("Qwen3-0.6B", 1024, 28, 16, 8, 128, 3072, 151936, tied_embeddings=True, qk_norm=True),
    ModelShape("Qwen3-4B", 2560, 36, 32, 8, 128, 9728, 151936, tied_embeddings=True, qk_norm=True),
    ModelShape("Qwen3-30B-A3B", 2048, 48, 32, 4, 128, 768, 151936, num_experts=128, experts_per_token=8),
    # the embedded default run's model
    ModelShape("SmolLM2-135M", 576, 30, 9, 3, 64, 1536, 49152, tied_embeddings=True),
)}


def shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}") from None
