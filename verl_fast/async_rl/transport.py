"""Weights pushed by version from the trainer (rank 0) to the rollout workers (ranks 1..W), in
memory, never through files: the actor's parameters flattened into one buffer, announced by a
version counter the workers read before every token.

- ``group``: a process group of its own (``ProcessGroupGloo`` over CPU tensors, ``ProcessGroupNCCL``
  when every worker has a GPU of its own); a push is one broadcast that every worker joins at its
  next token boundary (the trainer waits for them there).
- ``shared``: one buffer in shared memory (CUDA IPC when the workers share the trainer's GPU, where
  NCCL cannot run two ranks; host shared memory on the CPU); a push writes it once every worker has
  copied the previous version out, then bumps the counter.

Both sides see the same parameter names in the same order (checked when a worker starts).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Iterator, List, Optional, Sequence

import torch

from verl_fast.models import lora

TRANSPORTS = ("group", "shared")
TIMEOUT = datetime.timedelta(minutes=30)


def flat_size(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def flatten_into(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.detach().reshape(-1), non_blocking=True)
        offset += n


def unflatten_from(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.data.copy_(flat[offset:offset + n].view(p.shape), non_blocking=True)
        offset += n


def rendezvous(port: int, rank: int, world: int):
    """The weight group's store on this host: rank 0 hosts it (``port`` 0: a free port, read back
    from ``.port``), the workers connect to it."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT, wait_for_workers=False)


def process_group(backend: str, store: Any, rank: int, world: int):
    """This process's member of the weight group (every member constructs it: it connects them)."""
    import torch.distributed as dist

    store = dist.PrefixStore("verl_fast_async_weights", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, TIMEOUT)


def _broadcast(group: Any, flat: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([flat], opts).wait()


class Publisher:
    """The trainer's side. ``announced``: a shared int64 (``mp.Value``), the newest version; ``acks``:
    a shared int64 array, one slot per worker (the version it copied last), for ``shared``;
    ``pushes``: a shared int64, the broadcasts started, for ``group``."""

    def __init__(self, kind: str, flat: torch.Tensor, announced: Any, acks: Any, pushes: Any, group: Any = None):
        if kind not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {kind!r}")
        self.kind, self.flat, self.announced, self.acks, self.group = kind, flat, announced, acks, group
        self.pushes = pushes  # group: broadcasts started (each worker joins every one, in order)

    def publish(self, params: Sequence[torch.Tensor], version: int, alive=lambda: True) -> None:
        """Makes ``params`` the workers' version ``version`` (waits for the workers as its kind says;
        ``alive()`` False ends a wait with an error)."""
        if self.kind == "shared":
            while min(self.acks[:]) < self.announced.value:  # the previous version not yet copied out
                if not alive():
                    raise RuntimeError("a rollout worker stopped while the trainer pushed weights")
                time.sleep(0.0005)
        flatten_into(self.flat, params)
        if self.flat.is_cuda:
            torch.cuda.current_stream(self.flat.device).synchronize()
        if self.kind == "group":  # the version travels with the weights: announcements may run ahead
            self.pushes.value += 1
            _broadcast(self.group, torch.tensor([version], dtype=torch.int64, device=self.flat.device))
            _broadcast(self.group, self.flat)
        self.announced.value = version


class Subscriber:
    """A worker's side: ``poll()`` receives every version announced since the last call into
    ``staged`` (its own flat copy) and returns the newest one it holds."""

    def __init__(self, kind: str, worker: int, staged: torch.Tensor, announced: Any, acks: Any, pushes: Any,
                 shared: Optional[torch.Tensor] = None, group: Any = None):
        self.kind, self.worker, self.staged, self.announced, self.acks = kind, worker, staged, announced, acks
        self.pushes, self.shared, self.group = pushes, shared, group
        self.version = -1
        self._joined = 0

    def poll(self) -> int:
        if self.kind == "group":  # every broadcast started, in order
            while self._joined < self.pushes.value:
                version = torch.zeros(1, dtype=torch.int64, device=self.staged.device)
                _broadcast(self.group, version)
                _broadcast(self.group, self.staged)
                self.version, self._joined = int(version), self._joined + 1
            return self.version
        newest = self.announced.value
        if newest != self.version:
            self.staged.copy_(self.shared)
            if self.staged.is_cuda:
                torch.cuda.current_stream(self.staged.device).synchronize()
            self.version = newest
            self.acks[self.worker] = newest
        return self.version


def wait_for_first(sub: Subscriber, alive=lambda: True) -> int:
    """Blocks until the first version arrived (a worker's start)."""
    while sub.poll() < 0:
        if not alive():
            raise RuntimeError("the trainer stopped before pushing the first weights")
        time.sleep(0.001)
    return sub.version


def params_of(model: torch.nn.Module) -> List[torch.Tensor]:
    return [p for _, p in model.named_parameters()]


class PushedWeights:
    """What the workers receive, in order: ``module``'s parameters, or for a LoRA actor (peft) the base
    model's, each adapted layer's weight merged as the export merges it (``models/lora``: W + s * B @ A,
    in W's dtype), so that the workers decode with a plain model of the base architecture. ``names``
    are the worker model's parameter names; iterating yields the tensors (a merged one made only when
    reached: one layer's weight at a time, not a second model)."""

    def __init__(self, module: torch.nn.Module):
        self.tensors = dict(module.named_parameters())
        self.adapter = None
        if lora.is_peft(module):
            self.adapter = module.peft_config[module.active_adapter].to_dict()
            self.plan = lora.export_plan(list(self.tensors), self.adapter)
        else:
            self.plan = {name: (name,) for name in self.tensors}
        self.names = list(self.plan)
        first = self.tensors[self.plan[self.names[0]][0]]
        self.dtype, self.device = first.dtype, first.device
        self.numel = sum(self.tensors[sources[0]].numel() for sources in self.plan.values())

    def __iter__(self) -> Iterator[torch.Tensor]:
        for name in self.names:
            sources = self.plan[name]
            if len(sources) == 1:
                yield self.tensors[sources[0]]
            else:
                with torch.no_grad():
                    yield lora.exported(sources, self.tensors, self.adapter)
