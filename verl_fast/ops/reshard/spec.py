"""The shape of a decoder-only model, and its parameters as the *logical* tensors every layout maps to.

Logical tensors carry the Hugging Face names of the model as transformers (>= 5) holds it in
memory: dense layers as ``model.layers.N.{self_attn,mlp}.*``; MoE experts fused per layer as
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj``
``[E, H, I]``. Older checkpoints' per-expert names are a layout of their own (``hf.py``).
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Sequence, Tuple

import torch

#: Families and the transformers ``model_type`` that names them.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class ModelSpec:
    """What the layouts need to know about a model (build it with :meth:`from_hf_config`)."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    sparse_layers: Tuple[bool, ...] = field(default=())  # per layer: MoE block (True) or dense MLP
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.is_moe:
            if len(self.sparse_layers) != self.num_layers:
                raise ValueError(f"sparse_layers must have one entry per layer ({self.num_layers}), "
                                 f"got {len(self.sparse_layers)}")
            if self.num_experts < 1 or self.moe_intermediate_size < 1:
                raise ValueError(f"{self.family} needs num_experts >= 1 and moe_intermediate_size >= 1")

    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    def is_sparse(self, layer: int) -> bool:
        return self.is_moe and self.sparse_layers[layer]

    @property
    def has_shared_expert(self) -> bool:
        return self.family == "qwen2_moe" and self.shared_expert_intermediate_size > 0

    @staticmethod
    def from_hf_config(config, dtype: torch.dtype = None) -> "ModelSpec":
        """From a transformers ``PretrainedConfig`` (or anything with its attributes)."""
        family = getattr(config, "model_type", None)
        if family not in FAMILIES:
            raise ValueError(f"unsupported model_type {family!r}; supported: {FAMILIES}")
        g = lambda key, default=None: getattr(config, key, default)  # noqa: E731
        positive_ints(config, ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
                      ("num_key_value_heads", "head_dim"), "the model config")
        heads = g("num_attention_heads")
        head_dim = g("head_dim") or g("hidden_size") // heads
        kw = dict(
            family=family, hidden_size=g("hidden_size"), num_layers=g("num_hidden_layers"), num_heads=heads,
            num_kv_heads=g("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=g("intermediate_size"), vocab_size=g("vocab_size"),
            tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        )
        if family == "llama":
            kw.update(qkv_bias=bool(g("attention_bias", False)), o_bias=bool(g("attention_bias", False)),
                      mlp_bias=bool(g("mlp_bias", False)))
        elif family == "qwen2":
            kw.update(qkv_bias=True)
        elif family == "qwen3":
            kw.update(qkv_bias=bool(g("attention_bias", False)), o_bias=bool(g("attention_bias", False)), qk_norm=True)
        elif family == "qwen2_moe":
            kw.update(qkv_bias=bool(g("qkv_bias", True)), shared_expert_intermediate_size=g("shared_expert_intermediate_size", 0))
        elif family == "qwen3_moe":
            kw.update(qkv_bias=bool(g("attention_bias", False)), o_bias=bool(g("attention_bias", False)), qk_norm=True)
        if family in ("qwen2_moe", "qwen3_moe"):
            only = set(g("mlp_only_layers", None) or [])
            step = g("decoder_sparse_step", 1) or 1
            experts = g("num_experts")
            kw.update(num_experts=experts, moe_intermediate_size=g("moe_intermediate_size"),
                      sparse_layers=tuple(i not in only and experts > 0 and (i + 1) % step == 0
                                          for i in range(kw["num_layers"])))
        elif family == "mixtral":
            kw.update(num_experts=g("num_local_experts"), moe_intermediate_size=g("intermediate_size"),
                      sparse_layers=(True,) * kw["num_layers"])
        if dtype is None:
            dtype = g("dtype") if hasattr(config, "dtype") else g("torch_dtype")
            dtype = dtype or torch.float32
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
        return ModelSpec(dtype=dtype, **kw)


def positive_ints(config, required: Sequence[str], optional: Sequence[str], what: str) -> None:
    """Each ``required`` attribute of ``config`` is an int >= 1, and each ``optional`` one too
    unless it is missing or None (a ValueError naming the key, before anything divides by it)."""
    for key in list(required) + list(optional):
        value = getattr(config, key, None)
        if value is None and key in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{what}: {key} must be an integer >= 1, got {value!r}")


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def logical_shapes(spec: ModelSpec) -> "OrderedDict[str, Tuple[int, ...]]":
    """Every parameter of the model in transformers' in-memory naming, with its full shape."""
    H, d, nq, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    out: Dict[str, Tuple[int, ...]] = OrderedDict()
    out["model.embed_tokens.weight"] = (spec.vocab_size, H)
    for i in range(spec.num_layers):
        p = layer_prefix(i)
        out[p + "input_layernorm.weight"] = (H,)
        for proj, rows in (("q_proj", nq * d), ("k_proj", nkv * d), ("v_proj", nkv * d)):
            out[f"{p}self_attn.{proj}.weight"] = (rows, H)
            if spec.qkv_bias:
                out[f"{p}self_attn.{proj}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (H, nq * d)
        if spec.o_bias:
            out[p + "self_attn.o_proj.bias"] = (H,)
        if spec.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if spec.is_sparse(i):
            E, I = spec.num_experts, spec.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (E, H)
            out[p + "mlp.experts.gate_up_proj"] = (E, 2 * I, H)
            out[p + "mlp.experts.down_proj"] = (E, H, I)
            if spec.has_shared_expert:
                Is = spec.shared_expert_intermediate_size
                out[p + "mlp.shared_expert.gate_proj.weight"] = (Is, H)
                out[p + "mlp.shared_expert.up_proj.weight"] = (Is, H)
                out[p + "mlp.shared_expert.down_proj.weight"] = (H, Is)
                out[p + "mlp.shared_expert_gate.weight"] = (1, H)
        else:
            I = spec.intermediate_size
            out[p + "mlp.gate_proj.weight"] = (I, H)
            out[p + "mlp.up_proj.weight"] = (I, H)
            out[p + "mlp.down_proj.weight"] = (H, I)
            if spec.mlp_bias:
                out[p + "mlp.gate_proj.bias"] = (I,)
                out[p + "mlp.up_proj.bias"] = (I,)
                out[p + "mlp.down_proj.bias"] = (H,)
    out["model.norm.weight"] = (H,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, H)
    return out


def as_2d(shape: Tuple[int, ...]) -> Tuple[int, int]:
    """The [rows, cols] view of a shape: the last dimension is cols; 1-D is [n, 1]; 0-D is [1, 1]."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return int(shape[0]), 1
    cols = int(shape[-1])
    rows = 1
    for s in shape[:-1]:
        rows *= int(s)
    return rows, cols
