"""A reusable resharding plan: built once per rank by the C++ planner, executed every step.

Execution, per bucket: the *pack* phase writes this rank's outgoing bytes into a send slot (one
copy launch); ``torch.distributed`` point-to-point ops move exactly the bytes each peer needs
(NCCL on GPUs, gloo on CPUs); the *copy* phase writes every destination slice of the bucket in two
launches: the slices from local sources and zero padding first, while the bucket's messages are
still in flight, then the slices from the receive slot. Bucket ``b + 1``'s messages are in flight
while bucket ``b`` is copied; two send and two receive slots alternate.
"""

from __future__ import annotations

from collections import OrderedDict
from operator import attrgetter
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from verl_fast.distributed import indexed
from verl_fast.ops import arguments as V
from verl_fast.ops.native import cuda_stream, ext
from verl_fast.ops.reshard.layout import Layout, PhysTensor, local_tensor, order_tensors
from verl_fast.ops.reshard.spec import as_2d

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TILE_BYTES = 256 << 10
# New destination tensors are views of one allocation, each starting on this many bytes (the copy
# kernels take 16-byte vectors where addresses allow; torch's allocator aligns to 512).
OUTPUT_ALIGN_BYTES = 512

Tensors = Union[Mapping[str, torch.Tensor], Sequence[torch.Tensor]]
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # what _C takes; DTensors give their local shards
_SHAPE = attrgetter("shape")


def _dtype_code(dtype: torch.dtype, name: str) -> int:
    """The planner's code for ``dtype`` (``_C.DType``, whose names are torch's)."""
    codes = ext().DType.__members__
    key = str(dtype).removeprefix("torch.")
    if key not in codes:
        raise TypeError(f"{name}: unsupported dtype {dtype}; supported: {list(codes)}")
    return int(codes[key])


def _tables(layout: Layout, index: Dict[str, int], groups: Optional[Dict[str, int]]):
    rows, pieces = [], []
    for i, t in enumerate(layout.tensors):
        group = 0
        if groups is not None:
            group = groups.setdefault(t.group or t.name, len(groups))
        rows.append((t.rank, t.numel, _dtype_code(t.dtype, t.name), group))
        for p in t.pieces:
            if p.logical is None and groups is None:
                continue  # a source's padding feeds nothing
            pieces.append((index[p.logical] if p.logical is not None else -1, p.row0, p.nrows, p.col0, p.ncols, i,
                           p.offset, p.pitch))
    # column order: reshard.h's TensorCol and PieceCol
    as_t = lambda x, n: torch.tensor(x, dtype=torch.int64).reshape(-1, n)  # noqa: E731
    return as_t(rows, ext().reshard_tensor_cols), as_t(pieces, ext().reshard_piece_cols), [t.name for t in layout.tensors]


def _name_outside_storage(tensors: List[torch.Tensor], expected: List[PhysTensor], what: str) -> None:
    """Names the first tensor whose elements lie outside its storage (_C refuses it, unnamed)."""
    for x, t in zip(tensors, expected):
        if x.numel() and x.untyped_storage().nbytes() < (x.storage_offset() + x.numel()) * x.element_size():
            raise ValueError(f"{what} {t.name!r} has no memory behind it (its storage was freed or resized to "
                             "fewer bytes, as FSDP does with unsharded parameters)")


def _flat_split(tensors: List[PhysTensor]) -> Optional[tuple]:
    """(dtype, split sizes, element offsets, total elements) laying ``tensors`` out in one allocation,
    each starting on OUTPUT_ALIGN_BYTES (split sizes: each tensor's, then its padding); None when
    their dtypes differ."""
    if not tensors or len({t.dtype for t in tensors}) != 1:
        return None
    dtype = tensors[0].dtype
    align = max(1, OUTPUT_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    sizes, offsets, total = [], [], 0
    for t in tensors:
        offsets.append(total)
        sizes += [t.numel, -t.numel % align]
        total += sizes[-2] + sizes[-1]
    return dtype, sizes, offsets, total


def _same_device(device, bound: torch.device) -> bool:
    """Whether ``device`` (``"cuda"`` meaning the current one, as torch allocates) is ``bound``."""
    d = indexed(device)
    return d.type == bound.type and d.index == bound.index


class ReshardPlan:
    """One rank's plan from ``src`` to ``dst`` (layouts over the same ranks).

    ``group``: the process group whose ranks the layouts number (default: the world when the
    layouts span more than one rank). ``bucket_bytes`` bounds what any rank receives per bucket
    (the staging memory is twice that); ``tile_bytes`` is the executors' unit of work.
    """

    def __init__(self, src: Layout, dst: Layout, *, rank: Optional[int] = None, group=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, tile_bytes: int = DEFAULT_TILE_BYTES):
        if src.world_size != dst.world_size:
            raise ValueError(f"source layout spans {src.world_size} ranks, destination {dst.world_size}; "
                             "build both over the same process group")
        world = src.world_size
        self.group = group
        self.distributed = world > 1
        if self.distributed:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValueError(f"the layouts span {world} ranks but torch.distributed is not initialized")
            if dist.get_world_size(group) != world:
                raise ValueError(f"the layouts span {world} ranks but the process group has "
                                 f"{dist.get_world_size(group)}")
            rank = dist.get_rank(group) if rank is None else rank
        rank = 0 if rank is None else V.size(rank, "rank")
        for name, shape in dst.logical.items():
            if name in src.logical and tuple(src.logical[name]) != tuple(shape):
                raise ValueError(f"parameter {name}: shape {list(src.logical[name])} in the source layout, "
                                 f"{list(shape)} in the destination layout")
        logical = OrderedDict(src.logical)
        for name, shape in dst.logical.items():
            logical.setdefault(name, shape)
        index = {name: i for i, name in enumerate(logical)}
        C = ext()
        a = C.ReshardPlanArgs()
        a.logical_shapes = torch.tensor([as_2d(s) for s in logical.values()], dtype=torch.int64).reshape(-1, 2)
        a.logical_names = list(logical)
        a.src_tensors, a.src_pieces, a.src_names = _tables(src, index, None)
        a.dst_tensors, a.dst_pieces, a.dst_names = _tables(dst, index, {})
        a.rank, a.world_size = rank, world
        a.bucket_bytes, a.tile_bytes = V.size(bucket_bytes, "bucket_bytes", 1), V.size(tile_bytes, "tile_bytes", 1)
        self._c = C.ReshardPlan(a)
        self._phase = C.ReshardPhase
        self.rank, self.world_size = rank, world
        if self.distributed:
            self._check_same_plan(src, dst)
        self.src_tensors: List[PhysTensor] = [src.tensors[i] for i in self._c.local_sources]
        self.dst_tensors: List[PhysTensor] = [dst.tensors[i] for i in self._c.local_destinations]
        self._src_names = tuple(t.name for t in self.src_tensors)
        self._dst_names = tuple(t.name for t in self.dst_tensors)
        self._src_shapes = [torch.Size(t.shape) for t in self.src_tensors]
        self._dst_shapes = [torch.Size(t.shape) for t in self.dst_tensors]
        self.src_aliases = src.aliases
        self._messages = [(self._c.sends(b), self._c.recvs(b)) for b in range(self._c.num_buckets)]
        self._flat = _flat_split(self.dst_tensors)
        self._slots: Optional[tuple] = None
        self._device: Optional[torch.device] = None  # of the tensors bound, None before the first bind
        self.binding = 0  # counts the bindings: a caller that bound tensors tells whether they still are

    def _check_same_plan(self, src: Layout, dst: Layout) -> None:
        import torch.distributed as dist

        mine = (src.fingerprint(), dst.fingerprint())
        every: List = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, mine, group=self.group)
        if any(x != mine for x in every):
            bad = [r for r, x in enumerate(every) if x != mine]
            raise ValueError(f"ranks {bad} built different layouts than rank {self.rank}: every rank must "
                             "pass the same global source and destination layouts")

    # ---- introspection ----

    @property
    def src_names(self) -> Tuple[str, ...]:
        return self._src_names

    @property
    def dst_names(self) -> Tuple[str, ...]:
        return self._dst_names

    @property
    def num_buckets(self) -> int:
        return self._c.num_buckets

    def stats(self) -> Dict[str, int]:
        """Bytes this rank copies locally, receives, sends and zero-fills; buckets; segments."""
        sent = sum(n for sends, _ in self._messages for _, _, n in sends)
        return {"local_bytes": self._c.local_bytes, "received_bytes": self._c.received_bytes,
                "sent_wire_bytes": sent, "zero_bytes": self._c.zero_bytes, "buckets": self._c.num_buckets,
                "segments": self._c.num_segments, "tiles": self._c.num_tiles,
                "staging_bytes": 2 * (self._c.max_send_bytes + self._c.max_recv_bytes)}

    def allocate_destinations(self, device=None) -> "OrderedDict[str, torch.Tensor]":
        return OrderedDict((t.name, torch.empty(t.shape, dtype=t.dtype, device=device)) for t in self.dst_tensors)

    def new_destinations(self, device=None) -> List[torch.Tensor]:
        """New destination tensors in ``dst_names`` order. Where they share one dtype (the usual case),
        disjoint views of one allocation: one allocator call instead of one per tensor (~340 for a 7B
        model, each a few microseconds of host time before the copy can start). A tensor kept from
        them keeps the whole allocation alive."""
        if self._flat is None:
            return list(self.allocate_destinations(device).values())
        dtype, sizes, _, total = self._flat
        return self._views(torch.empty(total, dtype=dtype, device=device), sizes)

    def _views(self, buffer: torch.Tensor, sizes: List[int]) -> List[torch.Tensor]:
        parts = buffer.split_with_sizes(sizes)
        return [parts[2 * i].view(shape) for i, shape in enumerate(self._dst_shapes)]

    # ---- execution ----

    def _ordered(self, given: Tensors, expected: List[PhysTensor], what: str, aliases=()) -> List[torch.Tensor]:
        if not hasattr(given, "__iter__") or isinstance(given, (str, bytes, torch.Tensor)):
            raise TypeError(f"{what}s must be a mapping of name -> tensor or a sequence of tensors in "
                            f"{what}_names order, got {type(given).__name__}")
        if isinstance(given, Mapping):
            try:  # fast path: exact names, nothing extra
                if len(given) == len(expected):
                    return [local_tensor(given[t.name]) for t in expected]
            except KeyError:
                pass
            return order_tensors(given, expected, what, aliases)
        given = list(given)
        if len(given) != len(expected):
            raise ValueError(f"expected {len(expected)} {what} tensors on rank {self.rank} "
                             f"({', '.join(t.name for t in expected[:3])}, ...), got {len(given)}")
        return [x if type(x) in PLAIN_TENSOR_TYPES else local_tensor(x) for x in given]

    def _check(self, tensors: List[torch.Tensor], expected: List[PhysTensor], what: str) -> None:
        for x, t in zip(tensors, expected):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{what} {t.name!r} must be a torch.Tensor, got {type(x).__name__}")
            if tuple(x.shape) != tuple(t.shape):
                raise ValueError(f"{what} {t.name!r} must have shape {list(t.shape)}, got {list(x.shape)}")
            if x.dtype != t.dtype:
                raise TypeError(f"{what} {t.name!r} must be {t.dtype}, got {x.dtype}")
            if not x.is_contiguous():
                raise ValueError(f"{what} {t.name!r} must be contiguous")

    def _bind(self, srcs: List[torch.Tensor], dsts: List[torch.Tensor]) -> torch.device:
        if self._device is not None and self._c.is_bound(srcs, dsts):  # the same elements, unmoved: bound already
            return self._device
        self._device = None  # until bind() succeeds
        # _C checks the types, dtypes, sizes, contiguity, storage and one device; the exact shapes are
        # checked here; any failure is diagnosed again in Python, for an error that names the tensor
        try:
            fit = list(map(_SHAPE, srcs)) == self._src_shapes and list(map(_SHAPE, dsts)) == self._dst_shapes
        except AttributeError:
            fit = False
        if not fit:
            self._diagnose(srcs, dsts)
        device = next((x.device for x in srcs + dsts if x.numel()), torch.device("cpu"))
        if self._slots is None or self._slots[0].device != device:
            sizes = (self._c.max_send_bytes,) * 2 + (self._c.max_recv_bytes,) * 2
            self._slots = tuple(torch.empty(n, dtype=torch.uint8, device=device) for n in sizes)
        self.binding += 1
        try:
            self._c.bind(srcs, dsts, list(self._slots[:2]), list(self._slots[2:]))
        except (TypeError, ValueError):
            self._diagnose(srcs, dsts)
            raise
        self._device = device
        return device

    def _diagnose(self, srcs: List[torch.Tensor], dsts: List[torch.Tensor]) -> None:
        """Raises the error that names what makes ``srcs`` / ``dsts`` unfit for this plan, if it finds it."""
        self._check(srcs, self.src_tensors, "source")
        self._check(dsts, self.dst_tensors, "destination")
        devices = {x.device for x in srcs + dsts if x.numel()}
        if len(devices) > 1:
            raise ValueError(f"all source and destination tensors of rank {self.rank} must be on one device, "
                             f"got {sorted(map(str, devices))}")
        _name_outside_storage(srcs, self.src_tensors, "source")
        _name_outside_storage(dsts, self.dst_tensors, "destination")

    def _inputs(self, sources: Tensors, destinations: Optional[Tensors],
                device) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """``execute``'s arguments as lists in ``src_names`` / ``dst_names`` order (destinations
        allocated on ``device``, default the sources', when not given)."""
        srcs = self._ordered(sources, self.src_tensors, "source", self.src_aliases)
        if destinations is None:
            if device is None:
                device = next((x.device for x in srcs if x.numel()), torch.device("cpu"))
            return srcs, self.new_destinations(device)
        return srcs, self._ordered(destinations, self.dst_tensors, "destination")

    def bind(self, sources: Tensors, destinations: Optional[Tensors] = None, *,
             device=None) -> Tuple[List[torch.Tensor], List[torch.Tensor], torch.device]:
        """Orders, checks and binds ``execute``'s arguments: ``(sources, destinations, device)``, the
        tensors as lists in ``src_names`` / ``dst_names`` order. ``run`` then executes them, and
        :meth:`run_bound` again while they are still the tensors bound."""
        srcs, dsts = self._inputs(sources, destinations, device)
        return srcs, dsts, self._bind(srcs, dsts)

    def run_bound(self, srcs: List[torch.Tensor], dsts: List[torch.Tensor], *, check_after: bool = False) -> bool:
        """Runs the plan if ``srcs`` / ``dsts`` are the tensors bound (the same objects, or new ones
        viewing exactly their elements, as ``state_dict()`` gives, the bound ones unmoved); returns
        False otherwise, having written nothing that a run after binding them would not rewrite.
        ``check_after`` (one process): runs the bound tensors first and checks the given ones while
        the copy runs; a False then leaves the bound destinations written from the bound sources."""
        if self._device is None:
            return False
        # One process: run checks, before it copies, that each tensor is still at the memory bound,
        # and a copy cut short is redone whole after binding again. Across processes a rank must not
        # stop inside the exchange: the memory is checked first.
        local = not self.distributed
        if check_after and local:
            try:
                self.run(self._device)
            except ValueError:
                return False  # a bound tensor moved
            return self._c.is_bound(srcs, dsts, False)
        if not self._c.is_bound(srcs, dsts, not local):
            return False
        try:
            self.run(self._device)
        except ValueError:
            if not local or self._c.is_bound(srcs, dsts):
                raise
            return False  # a tensor moved
        return True

    def execute_new(self, sources: Tensors, *, device=None) -> List[torch.Tensor]:
        """Writes new destination tensors (``dst_names`` order) from ``sources``; no later call
        writes them. One process, the sources the ones bound last, the destinations of one dtype:
        they are bound as slices of one new allocation and the copy starts before their tensor
        objects are made, so the host builds those while the device copies."""
        srcs = self._ordered(sources, self.src_tensors, "source", self.src_aliases)
        fast = (not self.distributed and self._flat is not None and self._device is not None
                and (device is None or _same_device(device, self._device)) and self._c.sources_bound(srcs))
        if not fast:
            _, dsts, bound = self.bind(srcs, None, device=device)
            self.run(bound)
            return dsts
        dtype, sizes, offsets, total = self._flat
        buffer = torch.empty(total, dtype=dtype, device=self._device)
        self.binding += 1
        self._c.bind_destinations_in(buffer, offsets)
        self.run(self._device)
        return self._views(buffer, sizes)

    def execute(self, sources: Tensors, destinations: Optional[Tensors] = None, *,
                device=None) -> "OrderedDict[str, torch.Tensor]":
        """Writes this rank's destination tensors from its source tensors (a name -> tensor mapping,
        or a sequence in ``src_names`` order; DTensors give their local shard). Destinations are
        allocated (on ``device``, default the sources') unless given. Collective when distributed."""
        srcs, dsts = self._inputs(sources, destinations, device)
        if not self.run_bound(srcs, dsts):
            self.run(self._bind(srcs, dsts))
        return OrderedDict(zip(self.dst_names, dsts))

    def run(self, device: torch.device) -> None:
        """Executes the plan on the tensors bound last (see :meth:`bind`), on ``device``."""
        C, phase = self._c, self._phase
        stream = cuda_stream(self._slots[0])
        threads = torch.get_num_threads()
        nb = C.num_buckets
        pending: Dict[int, list] = {}

        def start(b: int) -> None:
            C.run(b, phase.pack, stream, threads)
            pending[b] = self._exchange(b)

        if nb:
            start(0)
        for b in range(nb):
            if b + 1 < nb:
                start(b + 1)
            C.run(b, phase.copy_local, stream, threads)  # overlaps bucket b's exchange
            for work in pending.pop(b):
                work.wait()
            C.run(b, phase.copy_received, stream, threads)

    def _exchange(self, b: int) -> list:
        sends, recvs = self._messages[b]
        if not sends and not recvs:
            return []
        import torch.distributed as dist

        slot = b % 2
        peer = (lambda r: dist.get_global_rank(self.group, r)) if self.group is not None else (lambda r: r)
        ops = [dist.P2POp(dist.isend, self._slots[slot][off:off + n], peer(r), self.group) for r, off, n in sends]
        ops += [dist.P2POp(dist.irecv, self._slots[2 + slot][off:off + n], peer(r), self.group)
                for r, off, n in recvs]
        return dist.batch_isend_irecv(ops)
