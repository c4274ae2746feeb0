"""The compiled decode step's projections merged: a layer's query, key and value projections run as
one matrix product, and its MLP's gate and up projections as one.

A decode step multiplies [B, 1, hidden] activations by every weight once: at B = 128 each product
is a small-M GEMM that costs cuBLAS a few microseconds however few bytes it reads, so a Qwen2 layer's
seven GEMMs (q, k, v, o, gate, up, down) cost about seven launches' latency per token, several times
what reading the weights takes at the 0.5B shape. Stacking q/k/v
and gate/up (the weights' rows concatenated, as vLLM's QKVParallelLinear and MergedColumnParallelLinear
hold them) leaves four. The merged weights are copies, refreshed from the parameters at every rollout
by ``hf_decode.CompiledForward.weights``; the model's own modules are left as they are outside it. A
module given a ``merged_product`` submodule (the FP8 decode's stacked FP8 copies) computes its merged
product with it instead, and gets no copies.

The forwards below restate the attention and MLP of the Llama family (Llama, Mistral, Qwen2, Qwen3,
and the language models of Qwen2-VL / Qwen2.5-VL) with the merged products: the same operations in
the same order as transformers' modules, the rotary embedding taken from the model's own modeling
module, the attention from the interface the config names (sdpa for the prefill, ``grouped_attention``
for the decode steps). Other architectures keep their modules' forwards (and unmerged products).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# the modules whose forward ``attention_forward`` / ``mlp_forward`` restate (transformers 5.x); Qwen2-VL's and
# Qwen2.5-VL's language-model attention is Qwen2's (their M-RoPE is in the cos / sin tables they are given)
ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention", "Qwen2VLAttention",
                        "Qwen2_5_VLAttention"})
MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
PARTS = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def kind(module: torch.nn.Module) -> Optional[str]:
    """"attention" or "mlp" for a module whose products can be merged, else None."""
    name = type(module).__name__
    if name in ATTENTIONS:
        if getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None) is None:
            return None
        found = "attention"
    elif name in MLPS:
        found = "mlp"
    else:
        return None
    if "merged_product" in module._modules:  # an engine computes the merged product itself (FP8)
        return found
    layers = [getattr(module, part, None) for part in PARTS[found]]
    # plain linear layers of float weights only: a LoRA or a quantized layer (some subclass nn.Linear)
    # computes more than its weight's product
    if not all(type(layer) is torch.nn.Linear and layer.weight.is_floating_point() for layer in layers):
        return None
    if len({layer.bias is None for layer in layers}) != 1:  # some with a bias, some without
        return None
    return found


def merged_copy(layers: List[torch.nn.Linear], attr: str, dtype: torch.dtype,
                kept: Optional[torch.Tensor]) -> Optional[torch.nn.Parameter]:
    """The layers' ``attr`` ("weight" / "bias") stacked along the output dimension, in ``dtype``, written
    into ``kept`` when it still fits (no new allocation from one rollout to the next)."""
    tensors = [getattr(layer, attr) for layer in layers]
    if tensors[0] is None:
        return None
    shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
    if kept is None or kept.shape != shape or kept.dtype != dtype or kept.device != tensors[0].device:
        kept = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=tensors[0].device), requires_grad=False)
    row = 0
    with torch.no_grad():
        for t in tensors:
            kept[row : row + t.shape[0]].copy_(t.detach())
            row += t.shape[0]
    return kept


def merged(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The merged layers' product: ``module.merged_product`` where an engine holds the weights in a form of
    its own (the FP8 decode's stacked copies, ``fp8_linear.FP8Decode``), else the merged copies'."""
    product = module._modules.get("merged_product")
    return product(x) if product is not None else F.linear(x, module.merged_weight, module.merged_bias)


def attention_forward(attn, hidden_states: torch.Tensor, position_embeddings: Tuple[torch.Tensor, torch.Tensor],
                      attention_mask: Optional[torch.Tensor], past_key_values=None, **kwargs):
    """The Llama-family attention with q/k/v as one product (``attn.merged_weight`` / ``merged_bias``)."""
    batch_shape = hidden_states.shape[:-1]
    shape = (*batch_shape, -1, attn.head_dim)
    q_size, kv_size = attn.q_proj.out_features, attn.k_proj.out_features
    qkv = merged(attn, hidden_states)
    cos, sin = position_embeddings
    q = None
    if getattr(past_key_values, "fused", False) and getattr(attn, "q_norm", None) is None:
        # a decode step of ``hf_decode``'s cache: rotary and cache write in one kernel (None: not this step)
        q = past_key_values.write_rotated(attn.layer_idx, qkv, cos, sin, q_size // attn.head_dim)
    if q is not None:
        k, v = past_key_values.keys[attn.layer_idx], past_key_values.values[attn.layer_idx]
    else:
        q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before the rotary embedding
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attn.layer_idx)
    interface: Callable = ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]
    # Qwen2/3 keep a per-layer window (None on full-attention layers), Mistral reads its config's
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(attn.config, "sliding_window", None)
    out, weights = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, sliding_window=window,
                             **kwargs)
    return attn.o_proj(out.reshape(*batch_shape, -1).contiguous()), weights


def mlp_forward(mlp, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP, down(act(gate(x)) * up(x)), with gate/up as one product."""
    gate, up = merged(mlp, x).chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


FORWARDS = {"attention": attention_forward, "mlp": mlp_forward}


class Merged:
    """The merged copies and the forwards that use them, kept from one rollout to the next (the
    compiled step's guards see the same objects every time, so it is not compiled again)."""

    def __init__(self) -> None:
        self.copies: Dict[str, Optional[torch.nn.Parameter]] = {}
        self.forwards: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = weakref.WeakKeyDictionary()

    def install(self, module: torch.nn.Module, dtype: Optional[torch.dtype],
                done: List[Tuple[torch.nn.Module, List[torch.nn.Linear]]]) -> None:
        """Every mergeable attention / MLP of ``module`` given its merged copies (in ``dtype``, or the
        parameters' own) and its merged forward, each appended to ``done`` with the layers it merges
        (what ``remove`` undoes). Those q/k/v and gate/up layers are left as they are (the merged
        forward does not call them)."""
        for name, sub in module.named_modules():
            found = kind(sub)
            if found is None:
                continue
            layers = [getattr(sub, part) for part in PARTS[found]]
            done.append((sub, layers))
            for attr in ("weight", "bias") if "merged_product" not in sub._modules else ():
                key = f"{name}.merged_{attr}"
                self.copies[key] = merged_copy(layers, attr, dtype or layers[0].weight.dtype, self.copies.get(key))
                sub._parameters[f"merged_{attr}"] = self.copies[key]
            if sub not in self.forwards:
                self.forwards[sub] = functools.partial(FORWARDS[found], sub)
            sub.forward = self.forwards[sub]

    @staticmethod
    def remove(done: List[Tuple[torch.nn.Module, List[torch.nn.Linear]]]) -> None:
        for sub, _ in done:
            sub._parameters.pop("merged_weight", None)
            sub._parameters.pop("merged_bias", None)
            sub.__dict__.pop("forward", None)  # the class's forward again
