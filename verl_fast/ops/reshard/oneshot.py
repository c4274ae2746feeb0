"""What the one-shot calls (``reshard``, ``vllm_weights``) keep between calls, so that calling them
every step costs little more than the copy itself.

- By *layout* (the layouts' digest, or a state dict's signature: names, shapes, dtypes, devices,
  placements): the plan, and, for callers that ask for reuse (``reuse=True``), the output tensors it
  allocated on each device. Every reusing call that converts the same layouts without
  ``destinations`` writes into those same tensors: its outputs stay valid until the next such call
  (``reshard`` reuses; ``vllm_weights`` only when asked). A call that does not reuse gets new
  output tensors each time, which no later call writes.
- By *arguments* (everything but the tensors): the last reusing call's plan, names and outputs. A call
  whose tensors are the very objects the plan is bound to, at the same memory (the C++ side checks
  each one), with the same keys, goes straight to the launch: no signature, no checks, no binding.
  So does a call whose tensors are new objects over the bound ones' memory (``model.state_dict()``
  makes new detached views at every call): same data pointer, shape, strides, dtype and device, so
  the bound objects, which keep that memory alive, describe them exactly. After such a call, the
  next one starts the copy into its own outputs first and checks its tensors while the GPU copies
  (the check is most of the host's work); if they fail, the full path rewrites those outputs.
  Anything else (a tensor replaced, resized or moved, a key added) takes the full path, which
  checks everything. Nothing is held here beyond what the plan's binding holds anyway.

Both caches drop the least recently used entry beyond ``MAX_CACHED``.
"""

from __future__ import annotations

from collections import OrderedDict
from operator import itemgetter
from typing import Callable, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_fast.ops.reshard.layout import local_tensor
from verl_fast.ops.reshard.plan import PLAIN_TENSOR_TYPES, ReshardPlan, Tensors

MAX_CACHED = 8

_PLANS: "OrderedDict[Hashable, ReshardPlan]" = OrderedDict()
_BUFFERS: "OrderedDict[Hashable, OrderedDict]" = OrderedDict()
_CALLS: "OrderedDict[Hashable, _Call]" = OrderedDict()


def remember(cache: OrderedDict, key: Hashable, make: Callable[[], object]):
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
        return value
    value = cache[key] = make()
    while len(cache) > MAX_CACHED:
        cache.popitem(last=False)
    return value


class _Key:
    """A cache key that hashes its (large) tuple once."""

    __slots__ = ("key", "hash")

    def __init__(self, key: tuple):
        self.key, self.hash = key, hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.key == other.key


def _as_list(given, names: Sequence[str], keys: Optional[tuple], plain: bool) -> Optional[List[torch.Tensor]]:
    """``given``'s tensors in ``names`` order when its keys are ``keys`` (a mapping) or it is a
    sequence of ``len(names)`` (``keys`` None); None otherwise. DTensors give their local shards."""
    if keys is None:
        if isinstance(given, Mapping) or not hasattr(given, "__len__") or len(given) != len(names):
            return None
        values = list(given)
    else:
        if not isinstance(given, Mapping) or len(given) != len(keys) or tuple(given) != keys:
            return None
        try:
            values = [given[n] for n in names] if len(names) == 1 else list(itemgetter(*names)(given))
        except KeyError:  # names with wrapper parts: the full path cleans them
            return None
    return values if plain else [local_tensor(v) for v in values]


class _Call:
    """The last full call of one argument combination (see the module docstring)."""

    __slots__ = ("keep", "plan", "device", "dsts", "src_keys", "dst_keys", "plain", "own_outputs", "first",
                 "run_first", "binding")

    def __init__(self, keep: tuple, plan: ReshardPlan, sources: Tensors, destinations: Optional[Tensors],
                 srcs: List[torch.Tensor], dsts: List[torch.Tensor], device: torch.device):
        self.keep = keep  # the objects whose identities the argument key holds
        self.plan, self.device, self.dsts = plan, device, dsts
        self.first = srcs[0] if srcs else None  # the last call's first source object
        self.run_first = False  # whether the next call copies before it checks (module docstring)
        self.binding = plan.binding  # the plan's binding this call made: another one since means rebind
        self.own_outputs = destinations is None
        self.src_keys = tuple(sources) if isinstance(sources, Mapping) else None
        self.dst_keys = tuple(destinations) if isinstance(destinations, Mapping) else None
        values = sources.values() if isinstance(sources, Mapping) else sources
        self.plain = all(type(v) in PLAIN_TENSOR_TYPES for v in values)  # else DTensors: their shards are bound

    def repeat(self, sources: Tensors, destinations: Optional[Tensors]) -> bool:
        """Runs the plan again if ``sources`` and ``destinations`` are what it is bound to."""
        if (destinations is None) != self.own_outputs or self.plan.binding != self.binding:
            return False  # (a call since bound the plan to other tensors: running it would write those)
        srcs = _as_list(sources, self.plan.src_names, self.src_keys, self.plain)
        dsts = self.dsts if destinations is None else _as_list(destinations, self.plan.dst_names, self.dst_keys, True)
        if srcs is None or dsts is None:
            return False
        if not self.plan.run_bound(srcs, dsts, check_after=self.run_first and self.own_outputs):
            self.run_first = False
            return False
        self.run_first = bool(srcs) and srcs[0] is not self.first  # new objects over the bound memory
        self.first = srcs[0] if srcs else None
        self.dsts = dsts
        return True


def execute(call_key: Hashable, layout_key: Callable[[], Hashable], make_plan: Callable[[], ReshardPlan],
            sources: Tensors, destinations: Optional[Tensors], device, keep: tuple = (), reuse: bool = True
            ) -> Tuple[Sequence[str], List[torch.Tensor]]:
    """Runs a conversion: ``call_key`` names its arguments (cheap to hash: plain values, and the
    identities of the objects in ``keep``, which the entry holds); on a miss, through the plan of
    ``layout_key()`` into ``destinations``, or (``reuse``) into that plan's outputs on ``device``
    (default: the sources'), or (not ``reuse``) into new tensors there. Returns the destination
    names and tensors."""
    fresh = destinations is None and not reuse
    call = None if fresh else _CALLS.get(call_key)
    if call is not None and call.repeat(sources, destinations):
        _CALLS.move_to_end(call_key)
        return call.plan.dst_names, call.dsts
    key = _Key(layout_key())
    p = remember(_PLANS, key, make_plan)
    if fresh:  # outputs of this call alone: the plan is kept, the tensors are the caller's
        return p.dst_names, p.execute_new(sources, device=device)
    if destinations is None:
        if device is None:
            device = _first_device(sources.values() if isinstance(sources, Mapping) else sources)
        buffers = remember(_BUFFERS, (key, str(device)), lambda: p.allocate_destinations(device))
        if not _intact(buffers.values(), p):  # a caller resized an output or freed its memory: fresh ones
            buffers = _BUFFERS[(key, str(device))] = p.allocate_destinations(device)
        srcs, dsts, bound_device = p.bind(sources, buffers)
    else:
        srcs, dsts, bound_device = p.bind(sources, destinations)
    p.run(bound_device)
    _CALLS.pop(call_key, None)
    remember(_CALLS, call_key, lambda: _Call(keep, p, sources, destinations, srcs, dsts, bound_device))
    return p.dst_names, dsts


def _first_device(tensors: Iterable) -> torch.device:
    first = next(iter(tensors), None)
    return getattr(first, "device", None) or torch.device("cpu")


def _intact(buffers: Iterable[torch.Tensor], p: ReshardPlan) -> bool:
    """Whether the outputs a plan allocated still have their shapes, dtypes and memory."""
    return all(type(b) is torch.Tensor and b.shape == t.shape and b.dtype == t.dtype and b.is_contiguous()
               and (b.data_ptr() != 0 or not t.numel) for b, t in zip(buffers, p.dst_tensors))
