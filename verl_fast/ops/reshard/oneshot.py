"""What the one-shot calls (``reshard``, ``vllm_weights``) keep between calls, so that calling them
every step costs little more than the copy itself.

Two caches, least recently used dropped first:

- by *layout* (the layouts' digest, or a state dict's signature: names, shapes, dtypes, devices,
  placements): the plan, and the output tensors it allocated on each device. Every call that
  converts the same layouts without ``destinations`` writes into those same tensors: a call's
  outputs stay valid until the next call of the same conversion (clone them, or pass your own
  ``destinations`` / ``out``, to keep them).
- by *call* (the identity of the objects passed): the last call's inputs, ordered and bound. A call
  that passes the same dict holding the same tensor objects at the same memory skips the
  signature, the name lookups and the checks, and goes straight to the launch. The entry holds the
  dict and its tensors, so that no new object can take their identities while it is kept. Any
  change (a tensor replaced, resized or moved, a key added) misses, and the call takes the full path.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from verl_fast.ops.reshard.plan import ReshardPlan, Tensors

MAX_CACHED = 8

_PLANS: "OrderedDict[Hashable, ReshardPlan]" = OrderedDict()
_BUFFERS: "OrderedDict[Hashable, OrderedDict]" = OrderedDict()
_CALLS: "OrderedDict[Hashable, _Call]" = OrderedDict()


def remember(cache: OrderedDict, key: Hashable, make: Callable[[], object]):
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    while len(cache) > MAX_CACHED:
        cache.popitem(last=False)
    return value


def _snapshot(x: Optional[Tensors]) -> Tuple[tuple, tuple, tuple]:
    """``(keys, values, ids of the values)`` of a mapping, sequence or None."""
    if x is None:
        return (), (), ()
    if isinstance(x, Mapping):
        values = tuple(x.values())
        return tuple(x), values, tuple(map(id, values))
    values = tuple(x)
    return (), values, tuple(map(id, values))


class _Call:
    """One call's inputs, kept to recognise the same call again (see the module docstring)."""

    __slots__ = ("sources", "destinations", "keep", "snapshot", "plan", "srcs", "dsts", "device")

    def __init__(self, sources: Tensors, destinations: Optional[Tensors], keep: tuple, plan: ReshardPlan,
                 srcs: List[torch.Tensor], dsts: List[torch.Tensor], device: torch.device):
        self.sources, self.destinations, self.keep = sources, destinations, keep
        self.snapshot = (_snapshot(sources), _snapshot(destinations))  # holds every value passed
        self.plan, self.srcs, self.dsts, self.device = plan, srcs, dsts, device

    def repeats(self, sources: Tensors, destinations: Optional[Tensors]) -> bool:
        """The same containers, holding the same keys and tensor objects as when this call was kept,
        and the plan still bound to them at the memory they had (the C++ side checks each pointer)."""
        if sources is not self.sources or destinations is not self.destinations:
            return False
        for x, (keys, _, ids) in zip((sources, destinations), self.snapshot):
            if x is None:
                continue
            values = x.values() if isinstance(x, Mapping) else x
            if len(x) != len(ids) or tuple(map(id, values)) != ids or (keys and tuple(x) != keys):
                return False
        return self.plan.is_bound(self.srcs, self.dsts)


def execute(call_key: Hashable, layout_key: Callable[[], Hashable], make_plan: Callable[[], ReshardPlan],
            sources: Tensors, destinations: Optional[Tensors], device, keep: tuple = ()
            ) -> Tuple[Sequence[str], List[torch.Tensor]]:
    """Runs the conversion ``call_key`` names (a key cheap to hash: the identities of ``sources``,
    ``destinations`` and of the objects in ``keep``, which the entry holds, and plain arguments); on
    a miss, through the plan of ``layout_key()`` into ``destinations``, or into that plan's outputs
    on ``device`` (default: the sources'). Returns the destination names and tensors."""
    call = _CALLS.get(call_key)
    if call is not None and call.repeats(sources, destinations):
        _CALLS.move_to_end(call_key)
        call.plan.run(call.device)
        return call.plan.dst_names, call.dsts
    key = layout_key()
    p = remember(_PLANS, key, make_plan)
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
    remember(_CALLS, call_key, lambda: _Call(sources, destinations, keep, p, srcs, dsts, bound_device))
    return p.dst_names, dsts


def _first_device(tensors: Iterable) -> torch.device:
    first = next(iter(tensors), None)
    return getattr(first, "device", None) or torch.device("cpu")


def _intact(buffers: Iterable[torch.Tensor], p: ReshardPlan) -> bool:
    """Whether the outputs a plan allocated still have their shapes, dtypes and memory."""
    return all(type(b) is torch.Tensor and b.shape == t.shape and b.dtype == t.dtype and b.is_contiguous()
               and (b.data_ptr() != 0 or not t.numel) for b, t in zip(buffers, p.dst_tensors))
