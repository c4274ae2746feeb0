"""FSDP layouts.

- FSDP2 (``fully_shard``): every parameter is a DTensor, ``Shard(0)`` over the data-parallel mesh
  (``Replicate()`` on an extra mesh dimension for HSDP). A rank holds ``torch.chunk``'s part of dim 0.
  :func:`fsdp2_layout` builds it from a spec; :func:`dtensor_layout` reads any DTensor state dict
  (Shard on the first or last dimension, Replicate, over meshes of any rank).
- FSDP1 (``FullyShardedDataParallel``): each wrapped unit flattens its parameters (with alignment
  padding) into one flat parameter, padded to a multiple of the world size and split evenly; a
  rank holds elements ``[r * n, (r + 1) * n)``. :func:`fsdp1_layout` builds it from the flat
  parameters' entries; :func:`fsdp1_layout_from_module` reads them off a wrapped model.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import List, Mapping, Optional, Sequence, Tuple

import torch

from verl_fast.ops.reshard.layout import (Layout, PhysTensor, Piece, chunk_split, clean_name, flat_range_pieces,
                                         replicated)
from verl_fast.ops.reshard.spec import ModelSpec, as_2d, logical_shapes


def _shard_rows(name: str, shape, rank: int, start: int, size: int, dtype, col0: int = 0,
                ncols: Optional[int] = None) -> PhysTensor:
    """Dim-0 entries ``[start, start+size)`` (and last-dim columns ``[col0, col0+ncols)``) of a logical tensor."""
    rows, cols = as_2d(shape)
    if len(shape) == 1:
        return PhysTensor(name, rank, (size,), dtype, [Piece(name, start, size, 0, 1, 0, 1)])
    ncols = cols if ncols is None else ncols
    inner = rows // shape[0] if shape[0] else 0  # rows of the 2-D view per dim-0 entry
    local = (size,) + tuple(shape[1:-1]) + (ncols,)
    return PhysTensor(name, rank, local, dtype, [Piece(name, start * inner, size * inner, col0, ncols, 0, ncols)])


def fsdp2_layout(spec: ModelSpec, world_size: int, dtype: Optional[torch.dtype] = None,
                 ranks: Optional[Sequence[int]] = None) -> Layout:
    """Every parameter ``Shard(0)`` over ``ranks`` (default all ``world_size`` ranks), as FSDP2 does."""
    dtype = dtype or spec.dtype
    ranks = list(ranks) if ranks is not None else list(range(world_size))
    shapes = logical_shapes(spec)
    tensors = []
    for name, shape in shapes.items():
        for i, r in enumerate(ranks):
            start, size = chunk_split(shape[0], len(ranks), i)
            tensors.append(_shard_rows(name, shape, r, start, size, dtype))
    aliases = ("lm_head.weight",) if spec.tie_word_embeddings else ()
    return Layout(shapes, tensors, world_size, kind="fsdp2", aliases=aliases)


def _dtensor_region(shape: Tuple[int, ...], mesh_ranks: torch.Tensor, placements, name: str):
    """Yields (rank, per-dimension (start, size)) for every coordinate of the mesh."""
    for coord in itertools.product(*(range(n) for n in mesh_ranks.shape)):
        ranges = [(0, s) for s in shape]
        for mesh_dim, pl in enumerate(placements):
            if pl.is_replicate():
                continue
            if not pl.is_shard():
                raise ValueError(f"parameter {name}: placement {pl} is not supported (Shard or Replicate only)")
            d = pl.dim % len(shape)
            start, size = ranges[d]
            s, n = chunk_split(size, mesh_ranks.shape[mesh_dim], coord[mesh_dim])
            ranges[d] = (start + s, n)
        yield int(mesh_ranks[coord]), ranges


def dtensor_layout(spec: ModelSpec, state: Mapping[str, torch.Tensor], world_size: Optional[int] = None) -> Layout:
    """The layout of a state dict of DTensors (plain tensors count as replicated on every rank)."""
    import torch.distributed as dist

    world = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    shapes = logical_shapes(spec)
    aliases = ("lm_head.weight",) if spec.tie_word_embeddings else ()
    tensors: List[PhysTensor] = []
    seen = set()
    for key, value in state.items():
        name = clean_name(key)
        if name in aliases:
            continue
        if name not in shapes:
            raise ValueError(f"unknown parameter {key!r} for a {spec.family} model")
        if tuple(value.shape) != tuple(shapes[name]):
            raise ValueError(f"parameter {key!r} must have shape {list(shapes[name])}, got {list(value.shape)}")
        seen.add(name)
        if not hasattr(value, "placements"):
            tensors += [replicated(name, name, shapes[name], r, value.dtype) for r in range(world)]
            continue
        shape = tuple(shapes[name])
        for rank, ranges in _dtensor_region(shape, value.device_mesh.mesh, value.placements, name):
            tensors.append(_from_ranges(name, shape, rank, ranges, value.dtype))
    missing = [n for n in shapes if n not in seen]
    if missing:
        raise ValueError(f"missing parameter {missing[0]!r} in the state dict ({len(missing)} missing in all)")
    return Layout(shapes, tensors, world, kind="dtensor", aliases=aliases)


def _from_ranges(name: str, shape, rank: int, ranges, dtype) -> PhysTensor:
    full = [(0, s) for s in shape]
    if len(shape) > 2 and any(r != f for r, f in zip(ranges[1:-1], full[1:-1])):
        raise ValueError(f"parameter {name}: sharding a middle dimension is not supported")
    if len(shape) <= 1:
        return _shard_rows(name, shape, rank, ranges[0][0], ranges[0][1], dtype) if shape else \
            replicated(name, name, shape, rank, dtype)
    return _shard_rows(name, shape, rank, ranges[0][0], ranges[0][1], dtype, ranges[-1][0], ranges[-1][1])


# ---- FSDP1 ------------------------------------------------------------------------------------

FlatEntry = Tuple[Optional[str], int]  # (parameter name, or None for alignment padding; numel)


def fsdp1_flat_tensors(flat_name: str, entries: Sequence[FlatEntry], shapes: Mapping[str, Tuple[int, ...]],
                       world_size: int, dtype: torch.dtype) -> List[PhysTensor]:
    """The local shards of one flat parameter on every rank."""
    total = sum(n for _, n in entries)
    shard = -(-total // world_size) if total else 0
    tensors = []
    for r in range(world_size):
        lo, hi = r * shard, (r + 1) * shard
        pieces: List[Piece] = []
        pos = 0
        for name, n in entries:
            a, b = max(lo, pos), min(hi, pos + n)
            if name is not None and a < b:
                if as_2d(shapes[name])[0] * as_2d(shapes[name])[1] != n:
                    raise ValueError(f"flat parameter {flat_name}: {name} has {n} elements, expected shape "
                                     f"{list(shapes[name])}")
                pieces += flat_range_pieces(name, shapes[name], a - pos, b - pos, a - lo)
            pos += n
        tensors.append(PhysTensor(flat_name, r, (shard,), dtype, pieces))
    return tensors


def fsdp1_layout(spec: ModelSpec, flat_params: Sequence[Tuple[str, Sequence[FlatEntry]]], world_size: int,
                 dtype: Optional[torch.dtype] = None) -> Layout:
    """FSDP1 from its flat parameters: ``[(flat name, [(param name or None, numel), ...]), ...]``.

    Padding entries and the tail padding hold no parameter; every rank gets ``ceil(total / W)``."""
    dtype = dtype or spec.dtype
    shapes = logical_shapes(spec)
    tensors: List[PhysTensor] = []
    for flat_name, entries in flat_params:
        unknown = [n for n, _ in entries if n is not None and n not in shapes]
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r} in flat parameter {flat_name}")
        tensors += fsdp1_flat_tensors(flat_name, entries, shapes, world_size, dtype)
    aliases = ("lm_head.weight",) if spec.tie_word_embeddings else ()
    return Layout(shapes, tensors, world_size, kind="fsdp1", aliases=aliases)


def _flat_entries(module) -> "OrderedDict[str, Tuple[List[FlatEntry], torch.Tensor]]":
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out: "OrderedDict[str, Tuple[List[FlatEntry], torch.Tensor]]" = OrderedDict()
    for unit_name, unit in module.named_modules():
        if not isinstance(unit, FSDP) or unit._handle is None:
            continue
        flat = unit._handle.flat_param
        prefix = clean_name(unit_name + ".") if unit_name else ""
        fqns = iter(flat._fqns)
        entries: List[FlatEntry] = []
        for numel, pad in zip(flat._numels_with_padding, flat._is_padding_mask):
            entries.append((None, int(numel)) if pad else (clean_name(prefix + next(fqns)), int(numel)))
        out[(prefix or "") + "flat_param"] = (entries, flat)
    return out


def fsdp1_layout_from_module(spec: ModelSpec, module, world_size: Optional[int] = None) -> Layout:
    """The FSDP1 layout of a wrapped model (read off its flat parameters' metadata)."""
    import torch.distributed as dist

    world = world_size if world_size is not None else dist.get_world_size()
    flats = _flat_entries(module)
    dtype = next(iter(flats.values()))[1].dtype if flats else spec.dtype
    return fsdp1_layout(spec, [(name, entries) for name, (entries, _) in flats.items()], world, dtype)


def fsdp1_sources(module) -> "OrderedDict[str, torch.Tensor]":
    """The local flat-parameter shards of a wrapped model, named as in :func:`fsdp1_layout_from_module`."""
    return OrderedDict((name, flat.detach()) for name, (_, flat) in _flat_entries(module).items())
