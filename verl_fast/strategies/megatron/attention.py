"""Core attention for megatron-core's local layer spec through torch's ``scaled_dot_product_attention``.

megatron-core's own ``DotProductAttention`` (the local spec's choice without Transformer Engine) writes the
``[b, heads, s, s]`` scores, masks them and runs an unfused softmax. This module takes its place in the
layer spec with the same constructor and forward, and lets torch pick a fused kernel: with a causal layer
and no explicit mask it asks for ``is_causal`` (flash attention on the GPU); an explicit boolean mask
(``True`` = masked out, megatron-core's convention) is passed on inverted.

What the local spec's attention supports and this module does not (it says so at construction):
attention dropout, sliding windows, softmax offsets, attention biases and packed sequences.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPAttention(MegatronModule):
    """``core_attention`` of a megatron-core attention layer: ``forward(query [sq, b, np, hn],
    key / value [sk, b, ng, hn], attention_mask)`` returns ``[sq, b, np * hn]``. Heads arrive already
    split per tensor-parallel rank, so the head counts are read from the tensors."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = [(dropout, "attention_dropout"), (config.window_size, "window_size"),
                       (config.softmax_type != "vanilla", "softmax_type"),
                       (config.context_parallel_size != 1, "context_parallel_size")]
        for value, name in unsupported:
            if value:
                raise ValueError(f"SDPAttention: TransformerConfig.{name}={getattr(config, name)!r} is not supported")
        self.attn_mask_type = attn_mask_type
        # query-key layer scaling divides the scale by the layer number and the softmax multiplies it
        # back: the same attention, so only the plain scale matters here
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention: attention_bias and packed_seq_params are not supported")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, heads, hn = query.shape
        groups = key.shape[2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        if attention_mask is None:
            # as megatron-core's: causal only for the causal type, and a one-token query sees every key
            causal = mask_type == AttnMaskType.causal and sq > 1
            if causal and key.shape[0] != sq:
                raise ValueError(f"SDPAttention: a causal layer without a mask needs as many keys as queries, "
                                 f"got {sq} queries and {key.shape[0]} keys")
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=groups != heads)
        else:
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"SDPAttention: attention_mask must be boolean (True = masked out), "
                                 f"got {attention_mask.dtype}")
            if groups != heads:  # the kernels that take a mask want equal head counts
                k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)  # [sq, b, np * hn]


def with_sdpa(layer_spec):
    """``layer_spec`` (a layer's ``ModuleSpec`` or a block's ``TransformerBlockSubmodules``) with every
    self-attention's core attention replaced by ``SDPAttention``, in place; returns it."""
    layers = getattr(layer_spec, "layer_specs", None) or [layer_spec]
    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = SDPAttention
    return layer_spec
