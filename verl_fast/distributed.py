"""Facts about the torch.distributed world this process runs in, the few collectives the trainer
makes on plain Python numbers, and the small agreements between the processes of a run (one rank
acts, every rank learns the result). One process (no process group) is a world of size 1. And what of
its GPU a process may still allocate, where processes may share one (``allocatable_bytes``).

Collectives run on the device the group's backend works with: NCCL only moves CUDA tensors (a CPU
tensor fails with "No backend type associated with device type cpu"), gloo works on CPU tensors.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if is_distributed() else 1


def collective_device(group=None) -> torch.device:
    """The device tensors must sit on for a collective over ``group`` (default: the world): the
    current CUDA device for NCCL, the CPU for gloo (and without a process group)."""
    import torch.distributed as dist

    if is_distributed() and "nccl" in dist.get_backend(group):  # "nccl" or "cpu:gloo,cuda:nccl"
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_numbers(values: Sequence[float], op: str = "sum", group=None,
                       dtype: torch.dtype = torch.float64) -> List[float]:
    """``values`` reduced element-wise over the ranks of ``group`` (``"sum"`` or ``"max"``), as
    Python numbers; one collective for the whole list. Without a process group: ``values``."""
    import torch.distributed as dist

    if op not in ("sum", "max"):
        raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
    if not is_distributed():
        return [float(v) if dtype.is_floating_point else int(v) for v in values]
    t = torch.tensor(list(values), dtype=dtype, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def barrier(group=None) -> None:
    """A barrier that names this rank's CUDA device under NCCL (else NCCL guesses it from the rank)."""
    import torch.distributed as dist

    if not is_distributed():
        return
    device: Optional[torch.device] = collective_device(group)
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def rank_world() -> Tuple[int, int]:
    return rank(), world_size()


def on_main(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` on rank 0 and gives every rank its result, or raises its error on every rank (so
    that no rank waits forever for one that failed)."""
    import torch.distributed as dist

    this, world = rank_world()
    result: List[Any] = [None, None]
    if this == 0:
        try:
            result = [fn(), None]
        except BaseException as e:  # noqa: BLE001 - re-raised below, on every rank (DCP raises BaseException)
            result = [None, e]
    if world > 1:
        dist.broadcast_object_list(result, src=0)
    if result[1] is not None:
        raise result[1]
    return result[0]


def gather(value: Any) -> List[Any]:
    """``value`` from every rank, in rank order (an object collective: any backend, any device)."""
    import torch.distributed as dist

    _, world = rank_world()
    if world == 1:
        return [value]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one."""
    return bool(all_reduce_numbers([int(flag)], "max", dtype=torch.int32)[0])


# of what a process may still allocate, the share the budgets sized from it take (the update's micro-batch
# tokens, the HF decode's rows at once): the rest is headroom for what the counts leave out
MEMORY_FRACTION = 0.85


def indexed(device) -> torch.device:
    """``device`` with its index: "cuda" means the current CUDA device (as torch allocates there)."""
    d = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def allocatable_bytes(device: torch.device) -> int:
    """What this process may still allocate on the CUDA ``device`` beyond what its allocator holds: the
    device's free memory, or less under a per-process cap (``torch.cuda.set_per_process_memory_fraction``,
    how processes share a GPU or a run keeps to a smaller card's memory): the cap less what is reserved."""
    device = indexed(device)  # the fraction's getter refuses "cuda" without an index
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)  # older torch: no getter
    if fraction < 1.0:
        free = min(free, int(fraction * total) - torch.cuda.memory_reserved(device))
    return max(free, 0)


def usable_bytes(device: torch.device) -> int:
    """``allocatable_bytes`` and what this process's allocator holds unused (its next allocations reuse it)."""
    return allocatable_bytes(device) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
