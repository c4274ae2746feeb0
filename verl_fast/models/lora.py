"""LoRA adapters from the config (``actor.lora``, a ``LoraConfig``) through peft,
and what the HF export of a LoRA actor is made of.

The export is the merged model, which transformers loads as the base family with no missing or
unexpected keys: each adapted Linear's weight is ``W + s * B @ A`` (transposed for peft's
``fan_in_fan_out`` layers), ``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), computed in float32
and stored in W's dtype; every other tensor is the base's under its own name (peft's
``base_model.model.`` prefix and ``.base_layer`` cut). It is computed from the checkpoint's tensors
and its ``adapter/adapter_config.json`` alone, so ``verl-fast export`` of a checkpoint merges too.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

from verl_fast.config import LoraConfig
from verl_fast.models.vision import VISION_MODULES, is_vision_model

ADAPTER = "adapter"  # the adapter folder in a checkpoint and in its export (peft's save_pretrained)
PREFIX = "base_model.model."


def apply(model: torch.nn.Module, spec: LoraConfig) -> torch.nn.Module:
    """``model`` with fresh LoRA adapters as ``spec`` (``actor.lora``, checked at start-up) says;
    ``all-linear`` targets every Linear but the output head, and a vision-language model's vision
    tower never. The base weights are frozen."""
    try:
        from peft import LoraConfig as PeftLoraConfig, get_peft_model
    except ImportError as e:
        raise ImportError("actor.lora needs peft: pip install peft") from e
    config = PeftLoraConfig(r=spec.r, lora_alpha=spec.scale_alpha, lora_dropout=spec.dropout,
                            target_modules=spec.target_modules, task_type="CAUSAL_LM",
                            exclude_modules=VISION_MODULES if is_vision_model(model) else None)  # the LM only
    return get_peft_model(model, config)


def is_peft(model: Any) -> bool:
    """Whether ``model`` carries PEFT adapters: the one place that asks."""
    return hasattr(model, "peft_config")


@torch.no_grad()
def starts_as_base(model: Any) -> bool:
    """Whether a peft model computes exactly what its base does: plain LoRA adapters whose B matrices
    are all zero (peft's fresh adapters), so that the model with its adapters disabled is the model as
    training starts -- the reference a KL term needs, without a copy of the base. Adapters given
    trained, DoRA and modules_to_save keep a copy."""
    if not is_peft(model):
        return False
    config = model.peft_config[model.active_adapter]
    if getattr(config, "use_dora", False) or getattr(config, "modules_to_save", None):
        return False
    named = list(model.named_parameters())
    return (any(".lora_B." in n for n, _ in named)
            and all(not bool(p.any()) for n, p in named if "lora_B" in n or "lora_embedding_B" in n))


def export_plan(names: List[str], adapter_config: Dict[str, Any]) -> Dict[str, Tuple[str, ...]]:
    """HF export name -> the checkpoint tensors it is made of: ``(name,)``, or ``(base weight,
    lora_A, lora_B)`` for an adapted layer's merged weight. Raises for what the merge does not cover
    (DoRA, embedding adapters, modules_to_save, per-module alpha)."""
    if adapter_config.get("use_dora") or adapter_config.get("alpha_pattern") or adapter_config.get("modules_to_save"):
        raise ValueError("the LoRA export merges plain LoRA adapters; DoRA, alpha_pattern and modules_to_save are "
                         "not supported")
    adapters: Dict[str, Dict[str, str]] = {}
    plan: Dict[str, Tuple[str, ...]] = {}
    for name in names:
        short = name[len(PREFIX):] if name.startswith(PREFIX) else name
        for part in (".lora_A.", ".lora_B."):
            if part in short:
                module = short.split(part)[0]
                adapters.setdefault(module, {})[part[1:7]] = name
                break
        else:
            if "lora_" in short:
                raise ValueError(f"the LoRA export cannot merge {name!r} (only Linear adapters lora_A / lora_B)")
            plan[short.replace(".base_layer.", ".")] = (name,)
    for module, ab in adapters.items():
        weight = f"{module}.weight"
        if set(ab) != {"lora_A", "lora_B"} or weight not in plan:
            raise ValueError(f"the LoRA layer {module} has no base weight or misses lora_A / lora_B")
        plan[weight] = plan[weight] + (ab["lora_A"], ab["lora_B"])
    return plan


def exported(sources: Tuple[str, ...], tensors: Dict[str, torch.Tensor], adapter_config: Dict[str, Any]) -> torch.Tensor:
    """The export tensor made of ``sources`` (an ``export_plan`` value) from the loaded ``tensors``."""
    base = tensors[sources[0]]
    if len(sources) == 1:
        return base
    a, b = tensors[sources[1]].float(), tensors[sources[2]].float()  # [r, in], [out, r]
    r = a.shape[0]
    alpha = float(adapter_config["lora_alpha"])
    scaling = alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r
    delta = scaling * (b @ a)  # [out, in], float32 whatever the weights' dtype
    if adapter_config.get("fan_in_fan_out"):  # GPT-2's Conv1D stores the weight as [in, out]
        delta = delta.T
    return (base.float() + delta).to(base.dtype)
