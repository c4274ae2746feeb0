"""Small agreements between the processes of a run (world 1 needs none of them)."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist


def rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def on_main(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` on rank 0 and gives every rank its result, or raises its error on every rank (so
    that no rank waits forever for one that failed)."""
    rank, world = rank_world()
    result: List[Any] = [None, None]
    if rank == 0:
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
    _, world = rank_world()
    if world == 1:
        return [value]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one."""
    _, world = rank_world()
    if world == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
