"""Small agreements between the processes of a run (world 1 needs none of them)."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist

from verl_fast import distributed


def rank_world() -> Tuple[int, int]:
    return distributed.rank(), distributed.world_size()


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
    return bool(distributed.all_reduce_numbers([int(flag)], "max", dtype=torch.int32)[0])
