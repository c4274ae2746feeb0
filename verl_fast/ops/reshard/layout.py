"""Layouts: which tensors each rank holds, and where every piece of every logical tensor sits in them.

A :class:`Layout` is a list of :class:`PhysTensor` (a tensor one rank holds, by name, shape and
dtype). Each physical tensor is tiled by :class:`Piece` s: a rectangle of one logical tensor's 2-D
view (``spec.as_2d``) stored at element ``offset`` with row ``pitch``, or zero padding. The
builders for each framework (``hf``, ``fsdp``, ``megatron``, ``vllm``) compose the helpers below.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_fast.ops.reshard.spec import as_2d

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """Rows ``[row0, row0+nrows)`` x cols ``[col0, col0+ncols)`` of ``logical`` (None: zeros),
    stored at element ``offset`` of the physical tensor, consecutive rows ``pitch`` elements apart."""

    logical: Optional[str]
    row0: int
    nrows: int
    col0: int
    ncols: int
    offset: int
    pitch: int


@dataclass
class PhysTensor:
    name: str
    rank: int
    shape: Shape
    dtype: torch.dtype
    pieces: List[Piece]
    group: Optional[str] = None  # bucketing key, shared by the same tensor on every rank (default: name)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


@dataclass
class Layout:
    """Physical tensors of every rank of a layout over ``world_size`` ranks.

    ``logical`` maps each logical name to its full shape; ``aliases`` lists names a state dict may
    carry that the layout deliberately skips (e.g. ``lm_head.weight`` of a tied model)."""

    logical: "OrderedDict[str, Shape]"
    tensors: List[PhysTensor]
    world_size: int
    kind: str = ""
    aliases: Tuple[str, ...] = field(default=())

    def __post_init__(self):
        seen = set()
        for t in self.tensors:
            if not 0 <= t.rank < self.world_size:
                raise ValueError(f"{self.kind} tensor {t.name}: rank {t.rank} outside [0, {self.world_size})")
            key = (t.rank, t.name)
            if key in seen:
                raise ValueError(f"{self.kind} layout has {t.name} twice on rank {t.rank}")
            seen.add(key)
            for p in t.pieces:
                if p.logical is not None and p.logical not in self.logical:
                    raise ValueError(f"{self.kind} tensor {t.name} refers to unknown parameter {p.logical}")

    def on_rank(self, rank: int) -> List[PhysTensor]:
        return [t for t in self.tensors if t.rank == rank]

    def fingerprint(self) -> str:
        """A digest of everything the planner reads (identical layouts on every rank <=> equal digests)."""
        h = hashlib.sha1()
        h.update(repr((self.world_size, list(self.logical.items()))).encode())
        for t in self.tensors:
            h.update(repr((t.name, t.rank, tuple(t.shape), str(t.dtype), t.group)).encode())
            h.update(repr(t.pieces).encode())
        return h.hexdigest()


# ---- piece builders ---------------------------------------------------------------------------


def full_piece(logical: str, shape: Shape, offset: int = 0) -> Piece:
    rows, cols = as_2d(shape)
    return Piece(logical, 0, rows, 0, cols, offset, cols)


def replicated(name: str, logical: str, shape: Shape, rank: int, dtype: torch.dtype,
               group: Optional[str] = None) -> PhysTensor:
    """The whole logical tensor, unchanged."""
    return PhysTensor(name, rank, tuple(shape), dtype, [full_piece(logical, shape)], group)


Band = Tuple[Optional[str], int, int]  # (logical or None for zeros, row0, nrows), full width


def row_bands(name: str, rank: int, dtype: torch.dtype, cols: int, bands: Sequence[Band],
              shape: Optional[Shape] = None, group: Optional[str] = None) -> PhysTensor:
    """Bands of whole rows stacked in order (fused QKV, gate/up, row shards, vocab padding)."""
    pieces, row = [], 0
    for logical, row0, nrows in bands:
        if nrows:
            pieces.append(Piece(logical, row0 if logical is not None else 0, nrows, 0, cols, row * cols, cols))
        row += nrows
    shape = tuple(shape) if shape is not None else (row, cols) if cols > 1 else (row,)
    t = PhysTensor(name, rank, shape, dtype, pieces, group)
    if t.numel != row * cols:
        raise ValueError(f"{name}: bands hold {row} x {cols} elements, shape {list(shape)} holds {t.numel}")
    return t


def col_slice(name: str, rank: int, dtype: torch.dtype, logical: str, logical_shape: Shape, col0: int,
              ncols: int, shape: Shape, group: Optional[str] = None) -> PhysTensor:
    """Columns ``[col0, col0+ncols)`` of every row (row-parallel linear layers)."""
    rows, _ = as_2d(logical_shape)
    return PhysTensor(name, rank, tuple(shape), dtype, [Piece(logical, 0, rows, col0, ncols, 0, ncols)], group)


def flat_range_pieces(logical: str, shape: Shape, start: int, end: int, offset: int) -> List[Piece]:
    """Elements ``[start, end)`` of the row-major logical tensor, stored contiguously from ``offset``:
    a partial first row, whole rows, a partial last row (FSDP1's flat shards)."""
    rows, cols = as_2d(shape)
    out: List[Piece] = []
    pos = start
    while pos < end:
        r, c = divmod(pos, cols)
        if c or end - pos < cols:  # partial row
            n = min(cols - c, end - pos)
            out.append(Piece(logical, r, 1, c, n, offset + pos - start, n))
            pos += n
        else:
            nr = (end - pos) // cols
            out.append(Piece(logical, r, nr, 0, cols, offset + pos - start, cols))
            pos += nr * cols
    return out


def slice_bands(bands: Sequence[Band], start: int, n: int) -> List[Band]:
    """Rows ``[start, start+n)`` of the stack of ``bands``, as bands."""
    out: List[Band] = []
    pos = 0
    for logical, row0, nrows in bands:
        a, b = max(start, pos), min(start + n, pos + nrows)
        if a < b:
            out.append((logical, row0 + a - pos if logical is not None else 0, b - a))
        pos += nrows
    if sum(b[2] for b in out) != n:
        raise ValueError(f"rows [{start}, {start + n}) outside a stack of {pos} rows")
    return out


# ---- splits -----------------------------------------------------------------------------------


def even_split(n: int, parts: int, index: int, what: str) -> Tuple[int, int]:
    """``(start, size)`` of part ``index`` of ``n`` split in ``parts`` equal parts (must divide)."""
    if n % parts:
        raise ValueError(f"{what}: {n} is not divisible by {parts}")
    size = n // parts
    return index * size, size


def chunk_split(n: int, parts: int, index: int) -> Tuple[int, int]:
    """``(start, size)`` of ``torch.chunk``'s part ``index`` (DTensor's Shard): ceil-sized, last ones short."""
    size = -(-n // parts) if n else 0
    start = min(n, index * size)
    return start, max(0, min(n, start + size) - start)


# ---- state dicts ------------------------------------------------------------------------------


def local_tensor(t) -> torch.Tensor:
    """The local shard of a DTensor (the same object every call), the tensor itself otherwise."""
    local = getattr(t, "_local_tensor", None)
    if local is None and hasattr(t, "to_local") and hasattr(t, "placements"):
        local = t.to_local()
    return local if local is not None else t


#: Wrapper parts that torch inserts into parameter names (FSDP1, activation checkpointing, compile).
WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """The parameter name without wrapper parts (and without DDP's leading ``module.``)."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name[len("module."):] if name.startswith("module.") else name


def order_tensors(given: Mapping[str, torch.Tensor], expected: Sequence[PhysTensor], what: str,
                  aliases: Iterable[str] = ()) -> List[torch.Tensor]:
    """The tensors of ``given`` in the order of ``expected``; every expected name must be present
    with its shape, and every given name must be expected (or a known alias)."""
    names = OrderedDict((t.name, t) for t in expected)
    skip = set(aliases)
    unknown = [k for k in given if clean_name(k) not in names and clean_name(k) not in skip]
    if unknown:
        raise ValueError(f"unknown {what} parameter {unknown[0]!r} (not in the layout; "
                         f"{len(unknown)} unknown in all)")
    cleaned: Dict[str, torch.Tensor] = {clean_name(k): v for k, v in given.items()}
    out = []
    for name, t in names.items():
        if name not in cleaned:
            raise ValueError(f"missing {what} parameter {name!r} (expected shape {list(t.shape)})")
        x = local_tensor(cleaned[name])
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} parameter {name!r} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != tuple(t.shape):
            raise ValueError(f"{what} parameter {name!r} must have shape {list(t.shape)}, got {list(x.shape)}")
        out.append(x)
    return out
