"""Hugging Face layouts: the whole model on each of some ranks.

``names="module"``: transformers' in-memory names (the logical tensors themselves).
``names="checkpoint"``: the names on disk, which differ only for MoE experts: one 2-D tensor per
expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``; Mixtral's
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` and ``block_sparse_moe.gate.weight``), the
layout of transformers < 5 and of every MoE checkpoint file.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import torch

from verl_fast.ops.reshard.layout import Layout, PhysTensor, Piece, replicated
from verl_fast.ops.reshard.spec import ModelSpec, layer_prefix, logical_shapes

NAMINGS = ("module", "checkpoint")


def _expert_tensors(spec: ModelSpec, layer: int, rank: int, dtype: torch.dtype) -> List[PhysTensor]:
    p = layer_prefix(layer)
    E, I, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    gate_up, down = p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
    if spec.family == "mixtral":
        base, names = p + "block_sparse_moe.experts.", ("w1", "w3", "w2")
        out = [replicated(p + "block_sparse_moe.gate.weight", p + "mlp.gate.weight", (E, H), rank, dtype)]
    else:
        base, names = p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj")
        out = [replicated(p + "mlp.gate.weight", p + "mlp.gate.weight", (E, H), rank, dtype)]
    for e in range(E):
        for k in range(2):  # gate, up: rows of the fused [E*2I, H] view
            out.append(PhysTensor(f"{base}{e}.{names[k]}.weight", rank, (I, H), dtype,
                                  [Piece(gate_up, e * 2 * I + k * I, I, 0, H, 0, H)]))
        out.append(PhysTensor(f"{base}{e}.{names[2]}.weight", rank, (H, I), dtype,
                              [Piece(down, e * H, H, 0, I, 0, I)]))
    return out


def hf_layout(spec: ModelSpec, ranks: Sequence[int] = (0,), world_size: Optional[int] = None,
              names: str = "module", dtype: Optional[torch.dtype] = None) -> Layout:
    """The full model replicated on each rank of ``ranks`` (of ``world_size``, default max + 1)."""
    if names not in NAMINGS:
        raise ValueError(f"names must be one of {NAMINGS}, got {names!r}")
    dtype = dtype or spec.dtype
    shapes = logical_shapes(spec)
    world = world_size if world_size is not None else max(ranks) + 1
    expert_names = set()
    if names == "checkpoint" and spec.is_moe:
        for i in range(spec.num_layers):
            if spec.is_sparse(i):
                expert_names.update(layer_prefix(i) + s for s in ("mlp.gate.weight", "mlp.experts.gate_up_proj",
                                                                  "mlp.experts.down_proj"))
    tensors: List[PhysTensor] = []
    for r in ranks:
        for name, shape in shapes.items():
            if name not in expert_names:
                tensors.append(replicated(name, name, shape, r, dtype))
            elif name.endswith("mlp.gate.weight"):
                tensors.extend(_expert_tensors(spec, int(name.split(".")[2]), r, dtype))
    aliases = ("lm_head.weight",) if spec.tie_word_embeddings else ()
    return Layout(shapes, tensors, world, kind=f"hf[{names}]", aliases=aliases)


def detect_naming(spec: ModelSpec, keys: Iterable[str]) -> str:
    """``"checkpoint"`` if a state dict's keys name experts one by one, else ``"module"``."""
    if spec.is_moe and any(".experts.0." in k for k in keys):
        return "checkpoint"
    return "module"
