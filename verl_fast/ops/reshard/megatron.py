"""Megatron-core layouts (GPTModel), per tensor-parallel / pipeline-parallel rank, and the global
layout of its ``torch_dist`` checkpoints.

Read from megatron-core's transformer code:
- ``self_attention.linear_qkv`` (column parallel) interleaves per query group ``[q heads of the group;
  its k head; its v head]``; TP rank t holds rows ``[t*R/T, (t+1)*R/T)`` of the whole interleaved
  tensor (with T > groups a rank holds part of a group, as megatron-core does).
- ``self_attention.linear_proj`` / ``mlp.linear_fc2`` (row parallel): columns of t, biases whole.
- ``mlp.linear_fc1`` (gated): ``[gate rows of t; up rows of t]``.
- ``embedding.word_embeddings`` / ``output_layer``: the padded vocabulary split evenly; rows past
  the real vocabulary are padding (zeros when written). ``output_layer`` is absent with shared
  embeddings, except on the last stage of a pipeline.
- Pipeline stage p holds layers ``[offset_p, offset_p + count_p)`` renumbered from 0.
- MoE: ``mlp.router.weight``; experts as ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``
  (SequentialMLP) or ``mlp.experts.linear_fc{1,2}.weight{e}`` (TE grouped), each expert TP-split
  like a dense MLP; shared experts as ``mlp.shared_experts.*`` and ``mlp.shared_experts.gate_weight``.
- Norms: ``input_layernorm`` / ``pre_mlp_layernorm`` with the local spec; with Transformer Engine
  fused into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` (dense layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_fast.ops import arguments as V
from verl_fast.ops.reshard.layout import (Band, Layout, PhysTensor, Piece, col_slice, even_split, replicated,
                                         row_bands, slice_bands)
from verl_fast.ops.reshard.spec import ModelSpec, layer_prefix, logical_shapes


@dataclass(frozen=True)
class MegatronNames:
    norms: str = "local"  # "local": input_layernorm / pre_mlp_layernorm; "te": fused into linear_qkv / linear_fc1
    experts: str = "sequential"  # "sequential": local_experts.{e}.linear_fc1.weight; "grouped": linear_fc1.weight{e}


def default_padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by * tp``."""
    m = divisible_by * tp
    return -(-vocab_size // m) * m


def stage_layers(num_layers: int, pp: int, p: int, per_stage: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """``(first global layer, number of layers)`` of pipeline stage ``p``."""
    if per_stage is None:
        return even_split(num_layers, pp, p, "num_layers over pipeline stages")
    if len(per_stage) != pp or sum(per_stage) != num_layers:
        raise ValueError(f"num_layers_per_stage {list(per_stage)} must have {pp} entries summing to {num_layers}")
    return sum(per_stage[:p]), per_stage[p]


def qkv_bands(spec: ModelSpec, kind: str, i: int) -> List[Band]:
    """The whole interleaved QKV of layer i: per group, q heads then its k head and v head."""
    d, ng = spec.head_dim, spec.num_kv_heads
    per = spec.num_heads // ng
    p = f"{layer_prefix(i)}self_attn."
    bands: List[Band] = []
    for g in range(ng):
        bands += [(p + f"q_proj.{kind}", g * per * d, per * d), (p + f"k_proj.{kind}", g * d, d),
                  (p + f"v_proj.{kind}", g * d, d)]
    return bands


def _vocab(name: str, logical: str, spec: ModelSpec, padded: int, tp: int, t: int, rank: int, dtype) -> PhysTensor:
    start, per = even_split(padded, tp, t, "padded vocabulary")
    real = max(0, min(spec.vocab_size, start + per) - start)
    return row_bands(name, rank, dtype, spec.hidden_size, [(logical, start, real), (None, 0, per - real)])


Rows = Tuple[str, int]  # (logical name, first row of the matrix inside it)


def _gated(prefix: str, gate: Rows, up: Rows, down: Rows, inter: int, spec: ModelSpec, tp: int, t: int, rank: int,
           dtype, fc1: str = "linear_fc1.weight", fc2: str = "linear_fc2.weight") -> List[PhysTensor]:
    """linear_fc1 ``[gate rows of t; up rows of t]`` and linear_fc2 (columns of t) of one gated MLP."""
    H = spec.hidden_size
    r0, n = even_split(inter, tp, t, "ffn size")
    return [row_bands(prefix + fc1, rank, dtype, H, [(gate[0], gate[1] + r0, n), (up[0], up[1] + r0, n)]),
            PhysTensor(prefix + fc2, rank, (H, n), dtype, [Piece(down[0], down[1], H, r0, n, 0, n)])]


def _dense_mlp(mp: str, lp: str, spec: ModelSpec, tp: int, t: int, rank: int, dtype) -> List[PhysTensor]:
    I, H = spec.intermediate_size, spec.hidden_size
    out = _gated(mp + "mlp.", (lp + "mlp.gate_proj.weight", 0), (lp + "mlp.up_proj.weight", 0),
                 (lp + "mlp.down_proj.weight", 0), I, spec, tp, t, rank, dtype)
    if spec.mlp_bias:
        r0, n = even_split(I, tp, t, "ffn size")
        out.append(row_bands(mp + "mlp.linear_fc1.bias", rank, dtype, 1,
                             [(lp + "mlp.gate_proj.bias", r0, n), (lp + "mlp.up_proj.bias", r0, n)]))
        out.append(replicated(mp + "mlp.linear_fc2.bias", lp + "mlp.down_proj.bias", (H,), rank, dtype))
    return out


def _layer(spec: ModelSpec, shapes, i: int, j: int, tp: int, t: int, rank: int, dtype, names: MegatronNames,
           pre: str, experts: Optional[Tuple[int, int]] = None) -> List[PhysTensor]:
    """Layer i as stage-local layer j; ``experts``: ``(first, count)`` of the experts held (default all),
    numbered from 0 locally."""
    lp, mp = layer_prefix(i), f"{pre}decoder.layers.{j}."
    H, d = spec.hidden_size, spec.head_dim
    sparse = spec.is_sparse(i)
    te = names.norms == "te"
    in_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te and not sparse else "pre_mlp_layernorm.weight"
    out = [replicated(mp + in_norm, lp + "input_layernorm.weight", (H,), rank, dtype),
           replicated(mp + mlp_norm, lp + "post_attention_layernorm.weight", (H,), rank, dtype)]
    rows = (spec.num_heads + 2 * spec.num_kv_heads) * d
    r0, n = even_split(rows, tp, t, "QKV rows")
    for kind, cols in (("weight", H), ("bias", 1)):
        if kind == "weight" or spec.qkv_bias:
            out.append(row_bands(f"{mp}self_attention.linear_qkv.{kind}", rank, dtype, cols,
                                 slice_bands(qkv_bands(spec, kind, i), r0, n)))
    c0, nc = even_split(spec.num_heads * d, tp, t, "attention width")
    out.append(col_slice(mp + "self_attention.linear_proj.weight", rank, dtype, lp + "self_attn.o_proj.weight",
                         shapes[lp + "self_attn.o_proj.weight"], c0, nc, (H, nc)))
    if spec.o_bias:
        out.append(replicated(mp + "self_attention.linear_proj.bias", lp + "self_attn.o_proj.bias", (H,), rank, dtype))
    if spec.qk_norm:
        out += [replicated(f"{mp}self_attention.{a}_layernorm.weight", f"{lp}self_attn.{a}_norm.weight", (d,), rank,
                           dtype) for a in "qk"]
    if not sparse:
        return out + _dense_mlp(mp, lp, spec, tp, t, rank, dtype)
    E, I = spec.num_experts, spec.moe_intermediate_size
    out.append(replicated(mp + "mlp.router.weight", lp + "mlp.gate.weight", (E, H), rank, dtype))
    gate_up, down = lp + "mlp.experts.gate_up_proj", lp + "mlp.experts.down_proj"
    first, count = experts or (0, E)
    for e in range(first, first + count):
        local = e - first
        if names.experts == "grouped":
            prefix, fc1, fc2 = mp + "mlp.experts.", f"linear_fc1.weight{local}", f"linear_fc2.weight{local}"
        else:
            prefix, fc1, fc2 = f"{mp}mlp.experts.local_experts.{local}.", "linear_fc1.weight", "linear_fc2.weight"
        out += _gated(prefix, (gate_up, e * 2 * I), (gate_up, e * 2 * I + I), (down, e * H), I, spec, tp, t, rank,
                      dtype, fc1, fc2)
    if spec.has_shared_expert:
        sp = lp + "mlp.shared_expert."
        out += _gated(mp + "mlp.shared_experts.", (sp + "gate_proj.weight", 0), (sp + "up_proj.weight", 0),
                      (sp + "down_proj.weight", 0), spec.shared_expert_intermediate_size, spec, tp, t, rank, dtype)
        out.append(replicated(mp + "mlp.shared_experts.gate_weight", lp + "mlp.shared_expert_gate.weight", (1, H),
                              rank, dtype))
    return out


def megatron_stage_tensors(spec: ModelSpec, tp: int, pp: int, t: int, p: int, rank: int, dtype,
                           padded_vocab: int, names: MegatronNames = MegatronNames(), prefix: str = "",
                           num_layers_per_stage: Optional[Sequence[int]] = None, ep: int = 1,
                           ep_rank: int = 0) -> List[PhysTensor]:
    """The parameters of TP rank ``t``, pipeline stage ``p``, expert-parallel rank ``ep_rank`` of ``ep``
    (its ``num_experts / ep`` consecutive experts, each split over the TP ranks), held by process ``rank``."""
    shapes = logical_shapes(spec)
    experts = even_split(spec.num_experts, ep, ep_rank, "num_experts over expert-parallel ranks") if ep > 1 else None
    first, count = stage_layers(spec.num_layers, pp, p, num_layers_per_stage)
    out: List[PhysTensor] = []
    if p == 0:
        out.append(_vocab(prefix + "embedding.word_embeddings.weight", "model.embed_tokens.weight", spec,
                          padded_vocab, tp, t, rank, dtype))
    for j in range(count):
        out += _layer(spec, shapes, first + j, j, tp, t, rank, dtype, names, prefix, experts)
    if p == pp - 1:
        out.append(replicated(prefix + "decoder.final_layernorm.weight", "model.norm.weight", (spec.hidden_size,),
                              rank, dtype))
        if not spec.tie_word_embeddings or pp > 1:
            logical = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
            out.append(_vocab(prefix + "output_layer.weight", logical, spec, padded_vocab, tp, t, rank, dtype))
    return out


def shard_prefix(t: int, p: int, pp: int) -> str:
    """The checkpoint directory of a shard: ``mp_rank_TT`` (no pipeline) or ``mp_rank_TT_PPP``."""
    return f"mp_rank_{t:02d}/" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}/"


def megatron_layout(spec: ModelSpec, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                    rank_of: Optional[Callable[[int, int], int]] = None, world_size: Optional[int] = None,
                    padded_vocab_size: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                    names: MegatronNames = MegatronNames(), num_layers_per_stage: Optional[Sequence[int]] = None,
                    in_one_process: bool = False) -> Layout:
    """Megatron-core's parameters over TP x PP ranks. ``rank_of(t, p)`` gives the process holding a
    shard (default ``t + T*p``, Megatron's order without data parallelism). ``in_one_process=True``
    puts every shard on rank 0, each name prefixed by its checkpoint directory (``mp_rank_TT_PPP/``)."""
    tp = V.size(tensor_parallel_size, "tensor_parallel_size", 1)
    pp = V.size(pipeline_parallel_size, "pipeline_parallel_size", 1)
    dtype = dtype or spec.dtype
    padded = padded_vocab_size or default_padded_vocab(spec.vocab_size, tp)
    if padded < spec.vocab_size:
        raise ValueError(f"padded_vocab_size {padded} < vocab_size {spec.vocab_size}")
    rank_of = rank_of or (lambda t, p: t + tp * p)
    tensors: List[PhysTensor] = []
    for p in range(pp):
        for t in range(tp):
            rank = 0 if in_one_process else rank_of(t, p)
            prefix = shard_prefix(t, p, pp) if in_one_process else ""
            tensors += megatron_stage_tensors(spec, tp, pp, t, p, rank, dtype, padded, names, prefix,
                                              num_layers_per_stage)
    world = world_size if world_size is not None else max(t.rank for t in tensors) + 1
    return Layout(logical_shapes(spec), tensors, world, kind=f"megatron[tp={tp},pp={pp}]")


# ---- torch_dist (dist_checkpointing) ----------------------------------------------------------


def torch_dist_tensors(spec: ModelSpec, padded_vocab: int, dtype, keys: Sequence[str] = ()) -> List[PhysTensor]:
    """Global tensors of a ``torch_dist`` checkpoint: the TP=1 layout with TE norm names, each
    per-layer parameter stacked over layers (``decoder.layers.<name>`` ``[L, ...]``) and experts
    stacked as ``mlp.experts.experts.linear_fc{1,2}.weight`` ``[L, E, ...]``. The pre-MLP norm of
    MoE layers is ``mlp.linear_fc1.layer_norm_weight`` (local spec) unless ``keys`` (the checkpoint's)
    name ``decoder.layers.pre_mlp_layernorm.weight`` (Transformer Engine spec)."""
    te_moe_norm = "decoder.layers.pre_mlp_layernorm.weight" in set(keys)
    per_layer = [_layer(spec, logical_shapes(spec), i, 0, 1, 0, 0, dtype, MegatronNames("te", "grouped"), "")
                 for i in range(spec.num_layers)]
    stacked: dict = {}
    for i, tensors in enumerate(per_layer):
        for t in tensors:
            name = t.name[len("decoder.layers.0."):]
            if name.startswith("mlp.experts.linear_fc"):
                fc, e = name[len("mlp.experts."):].split(".weight")
                name, index = f"mlp.experts.experts.{fc}.weight", (i, int(e))
            else:
                index = (i,)
            if name == "pre_mlp_layernorm.weight" and not te_moe_norm:
                name = "mlp.linear_fc1.layer_norm_weight"
            name = "decoder.layers." + name
            stacked.setdefault(name, []).append((index, t))
    out = [_vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight", spec, padded_vocab, 1, 0, 0, dtype)]
    for name, entries in stacked.items():
        inner = entries[0][1]
        lead = (spec.num_layers, spec.num_experts) if len(entries[0][0]) == 2 else (spec.num_layers,)
        if len(entries) != (lead[0] * (lead[1] if len(lead) == 2 else 1)):
            raise ValueError(f"{name}: not every layer has it (mixed dense and MoE layers are not supported "
                             "in torch_dist checkpoints)")
        pieces = []
        for index, t in entries:
            flat = index[0] * (lead[1] if len(lead) == 2 else 1) + (index[1] if len(index) == 2 else 0)
            pieces += [Piece(pc.logical, pc.row0, pc.nrows, pc.col0, pc.ncols, pc.offset + flat * inner.numel,
                             pc.pitch) for pc in t.pieces]
        out.append(PhysTensor(name, 0, lead + tuple(inner.shape), dtype, pieces))
    out.append(replicated("decoder.final_layernorm.weight", "model.norm.weight", (spec.hidden_size,), 0, dtype))
    if not spec.tie_word_embeddings:
        out.append(_vocab("output_layer.weight", "lm_head.weight", spec, padded_vocab, 1, 0, 0, dtype))
    return out


def torch_dist_layout(spec: ModelSpec, padded_vocab_size: int, dtype: Optional[torch.dtype] = None,
                      keys: Sequence[str] = ()) -> Layout:
    aliases = ("output_layer.weight",) if spec.tie_word_embeddings else ()
    return Layout(logical_shapes(spec), torch_dist_tensors(spec, padded_vocab_size, dtype or spec.dtype, keys), 1,
                  kind="megatron[torch_dist]", aliases=aliases)


def detect_names(keys: Sequence[str]) -> MegatronNames:
    keys = list(keys)
    norms = "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in keys) else "local"
    experts = "grouped" if any(".experts.linear_fc1.weight" in k for k in keys) else "sequential"
    return MegatronNames(norms, experts)


def vocab_rows(state: Mapping[str, torch.Tensor], tp: int) -> int:
    """The padded vocabulary of a legacy shard's state dict (its embedding rows times TP)."""
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in state:
            return int(state[key].shape[0]) * tp
    raise ValueError("no embedding.word_embeddings.weight or output_layer.weight in the first/last stage")

