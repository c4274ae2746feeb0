"""A Qwen2-VL / Qwen2.5-VL actor's weights as a vLLM engine holds them.

vLLM's ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` keep the language
model under ``language_model.`` (a ``Qwen2ForCausalLM``: ``model.layers...``, ``lm_head``) and the vision
tower under ``visual.``, with projections fused: the language model's ``q/k/v_proj`` into ``qkv_proj`` and
``gate/up_proj`` into ``gate_up_proj``, Qwen2.5-VL's vision MLP ``gate/up_proj`` into ``gate_up_proj``
(both towers' attention ``qkv`` is fused in the HF checkpoint already). The sync hands vLLM the HF-named
tensors and its own loader maps them; ``vllm_name`` is that mapping written out, so that the engine's
tensors can be checked against the actor's (``engine_tensors``: what each engine parameter must hold).

    vllm_name("model.language_model.layers.0.self_attn.k_proj.weight")
    # ("language_model.model.layers.0.self_attn.qkv_proj.weight", "k")
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch

Shard = Union[str, int, None]

# HF prefix -> vLLM prefix (transformers >= 4.52 names: the language model under model.language_model)
PREFIXES = (("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
            ("lm_head.", "language_model.lm_head."))
VISION_PREFIX = PREFIXES[1][0]
# a projection module's name -> (the fused module it joins, its part), by tower
LANGUAGE_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
VISION_FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
PART_ORDER = ("q", "k", "v", 0, 1)  # a fused tensor's parts, first rows first


def vllm_name(hf_name: str) -> Tuple[str, Shard]:
    """``(vLLM parameter name, part)`` of an HF Qwen2-VL / Qwen2.5-VL parameter; ``part`` None for an
    unfused one. ValueError (one line) for a name outside both models."""
    for old, new in PREFIXES:
        if hf_name.startswith(old):
            parts = hf_name[len(old):].split(".")
            break
    else:
        raise ValueError(f"{hf_name!r} is not a Qwen2-VL / Qwen2.5-VL parameter (expected a name under "
                         f"{', '.join(p for p, _ in PREFIXES)})")
    fused = VISION_FUSED if old == VISION_PREFIX else LANGUAGE_FUSED
    if len(parts) >= 2 and parts[-2] in fused:
        parts[-2], part = fused[parts[-2]]
        return new + ".".join(parts), part
    return new + ".".join(parts), None


def is_vision(hf_name: str) -> bool:
    """Whether an HF parameter belongs to the vision tower (its blocks, patch embedding and merger)."""
    return hf_name.startswith(VISION_PREFIX)


def engine_tensors(named: Iterable[Tuple[str, torch.Tensor]]) -> "OrderedDict[str, torch.Tensor]":
    """What each vLLM parameter holds for HF tensors ``named`` (one process, no tensor parallelism): fused
    parts concatenated along rows in vLLM's order (q, k, v; gate, up). ValueError when a fused parameter
    misses a part or gets one twice."""
    groups: "OrderedDict[str, Dict[Shard, torch.Tensor]]" = OrderedDict()
    for hf_name, tensor in named:
        name, part = vllm_name(hf_name)
        group = groups.setdefault(name, {})
        if part in group:
            raise ValueError(f"{hf_name!r}: vLLM's {name} gets part {part!r} twice")
        group[part] = tensor
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, group in groups.items():
        if None in group:
            out[name] = group[None]
            continue
        order: List[Shard] = [p for p in PART_ORDER if p in group]
        wanted = [p for p in PART_ORDER if (p in ("q", "k", "v")) == (order[0] in ("q", "k", "v"))]
        if order != wanted:
            raise ValueError(f"vLLM's {name} needs parts {wanted}, the actor gives {order}")
        out[name] = torch.cat([group[p] for p in order])
    return out


def fit_to_engine(expected: torch.Tensor, engine: torch.Tensor) -> Optional[torch.Tensor]:
    """``expected`` as the engine parameter lays it out: vocabulary rows padded (the engine's first rows
    compared), a patch embedding's convolution kernel flattened; None where the shapes cannot match."""
    if expected.shape == engine.shape:
        return expected
    if expected.dim() == engine.dim() and expected.shape[1:] == engine.shape[1:] and expected.shape[0] < engine.shape[0]:
        return torch.cat([expected, engine[expected.shape[0]:].to(expected.device, expected.dtype)])
    if expected.numel() == engine.numel() and expected.shape[0] == engine.shape[0]:
        return expected.reshape(engine.shape)
    return None
