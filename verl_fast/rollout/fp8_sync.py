"""The weight sync into a vLLM engine of block-FP8 linear layers (``rollout.quantization: fp8`` with a
full-weight actor): each decoder projection's weight quantised by the resharding engine's FP8 kernel
(``ops.reshard.fp8``, 128 x 128 blocks) into ``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32,
the multiplier that dequantises: vLLM's block-FP8 names), every other tensor in the engine's dtype, handed
to vLLM's reload path (which fuses q/k/v and gate/up and re-runs the layers' post-load processing).

The engine starts from a folder whose config.json declares that quantisation (``QUANTIZATION_CONFIG``) and
placeholder weights, which the first sync overwrites."""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

from verl_fast.models.wrapping import hf_module
from verl_fast.ops.reshard import fp8

# what vLLM reads from config.json to build block-FP8 linear layers (its Fp8Config)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(fp8.BLOCK)}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether the engine holds ``name`` as an FP8 weight: a decoder layer's projection."""
    parts = name.split(".")
    return tensor.dim() == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS


def fp8_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """HF names and tensors for vLLM's loader: projections as (``weight`` FP8, ``weight_scale_inv``), the rest
    in ``dtype``. ``model``: a whole (unsharded) HF model. Every projection is quantised in one call
    (``fp8.quantize_many``) before the first is handed over."""
    named = [(name, p.detach()) for name, p in hf_module(model).named_parameters()]
    projections = [(name, x) for name, x in named if quantized(name, x)]
    outs = [torch.empty(x.shape, dtype=fp8.FP8, device=x.device) for _, x in projections]
    scales = [torch.empty(fp8.scale_shape(tuple(x.shape), fp8.BLOCK), dtype=torch.float32, device=x.device)
              for _, x in projections]
    fp8.quantize_many([x for _, x in projections], outs, scales, fp8.BLOCK)
    done = {name: (q, s) for (name, _), q, s in zip(projections, outs, scales)}
    for name, x in named:
        if name in done:
            yield name, done[name][0]
            yield name[: -len("weight")] + "weight_scale_inv", done[name][1]
        else:
            yield name, x.to(dtype)
