"""vLLM's layout at tensor-parallel size T: its parameter names, fused tensors and TP shards.

Read from vLLM's model code (models/{llama,qwen2,qwen3,qwen2_moe,qwen3_moe,mixtral}.py) and its
layers' weight loaders:
- ``self_attn.qkv_proj`` (QKVParallelLinear): rank t holds ``[q heads of t; k heads; v heads]``;
  with T >= num_kv_heads one kv head per rank, head ``t // (T / num_kv_heads)`` (replicated).
- ``mlp.gate_up_proj`` (MergedColumnParallelLinear): ``[gate rows of t; up rows of t]``.
- ``o_proj`` / ``down_proj`` (RowParallelLinear): columns of t; their biases whole on every rank.
- ``embed_tokens`` / ``lm_head`` (VocabParallelEmbedding): vocab padded to a multiple of 64, split
  evenly; the padding rows are zeros. ``lm_head`` is absent with tied embeddings.
- MoE (FusedMoE): ``experts.routed_experts.w13_weight`` ``[E, 2I/T, H]`` (per expert: gate rows of t,
  then up rows of t), ``w2_weight`` ``[E, H, I/T]``; the router ``gate`` whole. Mixtral's block is
  ``block_sparse_moe``.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_fast.ops import arguments as V
from verl_fast.ops.reshard.hf import hf_layout
from verl_fast.ops.reshard.layout import Layout, PhysTensor, Piece, col_slice, even_split, replicated, row_bands
from verl_fast.ops.reshard.spec import ModelSpec, as_2d, layer_prefix, logical_shapes

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
EXPERTS_PREFIX = "experts.routed_experts."  # where vLLM 0.32 registers FusedMoE's weights


def padded_vocab(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    return -(-vocab_size // pad_to) * pad_to


def kv_heads_of(num_kv_heads: int, tp: int, t: int) -> tuple:
    """``(first kv head, number of kv heads)`` that tensor-parallel rank ``t`` of ``tp`` holds."""
    if tp >= num_kv_heads:
        if tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp} must be a multiple of num_kv_heads {num_kv_heads}")
        return t // (tp // num_kv_heads), 1
    if num_kv_heads % tp:
        raise ValueError(f"num_kv_heads {num_kv_heads} must be a multiple of tensor_parallel_size {tp}")
    per = num_kv_heads // tp
    return t * per, per


def _vocab(name: str, logical: str, spec: ModelSpec, tp: int, t: int, rank: int, dtype) -> PhysTensor:
    per = padded_vocab(spec.vocab_size) // tp
    if padded_vocab(spec.vocab_size) % tp:
        raise ValueError(f"padded vocabulary {padded_vocab(spec.vocab_size)} is not divisible by {tp}")
    start = t * per
    real = max(0, min(spec.vocab_size, start + per) - start)
    return row_bands(name, rank, dtype, spec.hidden_size, [(logical, start, real), (None, 0, per - real)])


def _attention(spec: ModelSpec, shapes, i: int, tp: int, t: int, rank: int, dtype) -> List[PhysTensor]:
    p, d, H = layer_prefix(i), spec.head_dim, spec.hidden_size
    q0, nq = even_split(spec.num_heads, tp, t, "num_attention_heads")
    k0, nk = kv_heads_of(spec.num_kv_heads, tp, t)
    out = []
    for kind, cols in (("weight", H), ("bias", 1)):
        if kind == "bias" and not spec.qkv_bias:
            continue
        bands = [(f"{p}self_attn.q_proj.{kind}", q0 * d, nq * d), (f"{p}self_attn.k_proj.{kind}", k0 * d, nk * d),
                 (f"{p}self_attn.v_proj.{kind}", k0 * d, nk * d)]
        out.append(row_bands(f"{p}self_attn.qkv_proj.{kind}", rank, dtype, cols, bands))
    c0, nc = even_split(spec.num_heads * d, tp, t, "attention width")
    out.append(col_slice(p + "self_attn.o_proj.weight", rank, dtype, p + "self_attn.o_proj.weight",
                         (H, spec.num_heads * d), c0, nc, (H, nc)))
    extra = ["self_attn.o_proj.bias"] if spec.o_bias else []
    extra += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if spec.qk_norm else []
    out += [replicated(p + n, p + n, shapes[p + n], rank, dtype) for n in extra]
    return out


def _gated_mlp(prefix: str, logical_prefix: str, inter: int, spec: ModelSpec, tp: int, t: int, rank: int, dtype,
               bias: bool = False) -> List[PhysTensor]:
    """gate_up_proj [2I/T, H] and down_proj [H, I/T] of a dense MLP (or a shared expert)."""
    H, lp = spec.hidden_size, logical_prefix
    r0, n = even_split(inter, tp, t, "intermediate_size")
    out = [row_bands(prefix + "gate_up_proj.weight", rank, dtype, H,
                     [(lp + "gate_proj.weight", r0, n), (lp + "up_proj.weight", r0, n)])]
    if bias:
        out.append(row_bands(prefix + "gate_up_proj.bias", rank, dtype, 1,
                             [(lp + "gate_proj.bias", r0, n), (lp + "up_proj.bias", r0, n)]))
    out.append(col_slice(prefix + "down_proj.weight", rank, dtype, lp + "down_proj.weight", (H, inter), r0, n, (H, n)))
    if bias:
        out.append(replicated(prefix + "down_proj.bias", lp + "down_proj.bias", (H,), rank, dtype))
    return out


def _moe(spec: ModelSpec, i: int, tp: int, t: int, rank: int, dtype, experts_prefix: str) -> List[PhysTensor]:
    p, H, E, I = layer_prefix(i), spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    block = p + ("block_sparse_moe." if spec.family == "mixtral" else "mlp.")
    r0, n = even_split(I, tp, t, "moe_intermediate_size")
    gate_up, down = p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
    bands = []
    for e in range(E):
        bands += [(gate_up, e * 2 * I + r0, n), (gate_up, e * 2 * I + I + r0, n)]
    out = [replicated(block + "gate.weight", p + "mlp.gate.weight", (E, H), rank, dtype),
           row_bands(block + experts_prefix + "w13_weight", rank, dtype, H, bands, shape=(E, 2 * n, H)),
           col_slice(block + experts_prefix + "w2_weight", rank, dtype, down, (E, H, I), r0, n, (E, H, n))]
    if spec.has_shared_expert:
        Is = spec.shared_expert_intermediate_size
        out += _gated_mlp(p + "mlp.shared_expert.", p + "mlp.shared_expert.", Is, spec, tp, t, rank, dtype)
        out.append(replicated(p + "mlp.shared_expert_gate.weight", p + "mlp.shared_expert_gate.weight", (1, H),
                              rank, dtype))
    return out


def vllm_tensors(spec: ModelSpec, tp: int, t: int, rank: int, dtype, experts_prefix: str = EXPERTS_PREFIX
                 ) -> List[PhysTensor]:
    """vLLM's parameters on tensor-parallel rank ``t`` of ``tp``, placed on process ``rank``."""
    H, shapes = spec.hidden_size, logical_shapes(spec)
    out = [_vocab("model.embed_tokens.weight", "model.embed_tokens.weight", spec, tp, t, rank, dtype)]
    for i in range(spec.num_layers):
        p = layer_prefix(i)
        out.append(replicated(p + "input_layernorm.weight", p + "input_layernorm.weight", (H,), rank, dtype))
        out += _attention(spec, shapes, i, tp, t, rank, dtype)
        out.append(replicated(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (H,),
                              rank, dtype))
        if spec.is_sparse(i):
            out += _moe(spec, i, tp, t, rank, dtype, experts_prefix)
        else:
            out += _gated_mlp(p + "mlp.", p + "mlp.", spec.intermediate_size, spec, tp, t, rank, dtype,
                              bias=spec.mlp_bias)
    out.append(replicated("model.norm.weight", "model.norm.weight", (H,), rank, dtype))
    if not spec.tie_word_embeddings:
        out.append(_vocab("lm_head.weight", "lm_head.weight", spec, tp, t, rank, dtype))
    return out


def consecutive_tp_ranks(world_size: int, tensor_parallel_size: int) -> Dict[int, int]:
    """Each process rank's TP rank when consecutive ranks form TP groups (vLLM's own grouping under
    an external launcher): ``r % T``."""
    tp = V.size(tensor_parallel_size, "tensor_parallel_size", 1)
    return {r: r % tp for r in range(V.size(world_size, "world_size", 1))}


def vllm_layout(spec: ModelSpec, tensor_parallel_size: int = 1, tp_rank_of: Optional[Mapping[int, int]] = None,
                world_size: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                experts_prefix: str = EXPERTS_PREFIX) -> Layout:
    """vLLM at TP size ``tensor_parallel_size``; ``tp_rank_of`` maps each process rank that runs a
    vLLM worker to its TP rank (default: process rank t runs TP rank t, t < T)."""
    tp = V.size(tensor_parallel_size, "tensor_parallel_size", 1)
    ranks = dict(tp_rank_of) if tp_rank_of is not None else {t: t for t in range(tp)}
    for rank, t in ranks.items():
        if not 0 <= t < tp:
            raise ValueError(f"tp rank {t} of process {rank} outside [0, {tp})")
    world = world_size if world_size is not None else max(ranks) + 1
    dtype = dtype or spec.dtype
    tensors: List[PhysTensor] = []
    for rank, t in sorted(ranks.items()):
        tensors += vllm_tensors(spec, tp, t, rank, dtype, experts_prefix)
    return Layout(logical_shapes(spec), tensors, world, kind=f"vllm[tp={tp}]")


def vllm_names(spec: ModelSpec, tensor_parallel_size: int = 1) -> Sequence[str]:
    """vLLM's parameter names in load order (the same on every TP rank)."""
    return [t.name for t in vllm_tensors(spec, tensor_parallel_size, 0, 0, spec.dtype)]


Rect = Tuple[int, int, int, int]  # row0, nrows, col0, ncols


def _needed(spec: ModelSpec, tp: int, t: int) -> Dict[str, List[Rect]]:
    """The regions of each logical tensor that vLLM's TP rank ``t`` holds."""
    out: Dict[str, List[Rect]] = {}
    for phys in vllm_tensors(spec, tp, t, 0, spec.dtype):
        for p in phys.pieces:
            if p.logical is not None:
                out.setdefault(p.logical, []).append((p.row0, p.nrows, p.col0, p.ncols))
    return out


def _gaps(rows: int, cols: int, covered: List[Rect]) -> List[Rect]:
    """Rectangles tiling the part of a ``rows x cols`` grid that ``covered`` (disjoint) leaves free:
    horizontal strips between row boundaries, and the column gaps inside each strip."""
    cuts = sorted({0, rows} | {r for r0, n, _, _ in covered for r in (r0, r0 + n)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        spans = sorted((c0, c0 + n) for r0, nr, c0, n in covered if r0 <= a and b <= r0 + nr)
        col = 0
        for c0, c1 in spans + [(cols, cols)]:
            if c0 > col:
                out.append((a, b - a, col, c0 - col))
            col = max(col, c1)
    return out


def vllm_reload_layout(spec: ModelSpec, tensor_parallel_size: int = 1,
                       tp_rank_of: Optional[Mapping[int, int]] = None, world_size: Optional[int] = None,
                       dtype: Optional[torch.dtype] = None) -> Layout:
    """What vLLM's reload path (``reload_weights``, the model's own ``load_weights``) takes on each
    rank: whole tensors with checkpoint names, out of which vLLM's loaders slice their TP shard.
    Only the regions that rank's TP shard reads are filled from the sources (so each rank receives
    exactly its shard's bytes, as with :func:`vllm_layout`); the rest is zeros, never read."""
    tp = V.size(tensor_parallel_size, "tensor_parallel_size", 1)
    ranks = dict(tp_rank_of) if tp_rank_of is not None else {t: t for t in range(tp)}
    world = world_size if world_size is not None else max(ranks) + 1
    dtype = dtype or spec.dtype
    whole = hf_layout(spec, names="checkpoint", dtype=dtype)
    needed = {t: _needed(spec, tp, t) for t in set(ranks.values())}
    tensors: List[PhysTensor] = []
    for rank, t in sorted(ranks.items()):
        for phys in whole.tensors:
            rows, cols = as_2d(phys.shape)
            pieces, covered = [], []
            for p in phys.pieces:  # whole HF tensors: pitch == cols
                for r0, nr, c0, nc in needed[t].get(p.logical, ()):
                    a, b = max(r0, p.row0), min(r0 + nr, p.row0 + p.nrows)
                    c, d = max(c0, p.col0), min(c0 + nc, p.col0 + p.ncols)
                    if a < b and c < d:
                        at = p.offset + (a - p.row0) * p.pitch + (c - p.col0)
                        pieces.append(Piece(p.logical, a, b - a, c, d - c, at, p.pitch))
                        covered.append((at // cols, b - a, at % cols, d - c))
            pieces += [Piece(None, 0, nr, 0, nc, r0 * cols + c0, cols) for r0, nr, c0, nc in _gaps(rows, cols, covered)]
            tensors.append(PhysTensor(phys.name, rank, phys.shape, dtype, pieces, phys.group))
    return Layout(whole.logical, tensors, world, kind=f"vllm-reload[tp={tp}]", aliases=whole.aliases)
