"""Input checks that never make the host wait for the GPU.

A checking op's kernels write their verdict on the device (status bits, a count of bad labels); the
launch then queues a 4-byte copy of it into a slot of pinned host memory, set to ``-1`` just before.
The host reads the slot once the copy has landed (the value is no longer -1), without a CUDA call
and without waiting. Every checking call raises the first bad verdict that has landed by the time it
returns -- its own on the CPU, where the copy is done before the launch returns; on CUDA usually an
earlier call's, so a bad batch is reported by the next checking call (of any op that uses this
queue) or by :func:`raise_pending`, which waits for the device and raises what is outstanding.

The message names the argument, and on CUDA the op and device it came from, in one line.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from verl_fast.distributed import indexed  # queues are keyed by indexed devices

NOT_LANDED = -1  # a slot's value until its copy lands (verdicts are >= 0)
SLOTS = 256  # per device: how far the host may run ahead of the GPU with checks outstanding

Verdict = Callable[[int], Optional[str]]  # the landed value -> an error message, or None when fine


class _Queue:
    """One device's pinned slots and the checks waiting on them, oldest first."""

    def __init__(self, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        self.buffer = torch.full((SLOTS,), NOT_LANDED, dtype=torch.int32, pin_memory=pin)
        self.words = self.buffer.numpy()  # reads and writes without a torch call
        self.views = [self.buffer[i:i + 1] for i in range(SLOTS)]  # what a launch copies into
        self.free: List[int] = list(range(SLOTS))
        self.waiting: Deque[Tuple[int, Verdict]] = deque()
        self.lock = threading.Lock()

    def landed(self) -> Optional[str]:
        """Frees the slots whose copies have landed, oldest first, stopping at the first still in
        flight (so one source's verdicts are read in the order they were queued); the first error."""
        done = []
        with self.lock:
            while self.waiting:
                index, verdict = self.waiting[0]
                value = int(self.words[index])
                if value == NOT_LANDED:
                    break
                self.waiting.popleft()
                self.free.append(index)
                done.append((verdict, value))
        error = None
        for verdict, value in done:  # outside the lock: a verdict may read labels back (a wait)
            message = verdict(value)
            if error is None:
                error = message
        return error


_QUEUES: Dict[torch.device, _Queue] = {}
_QUEUES_LOCK = threading.Lock()


def _queue(device: torch.device) -> _Queue:
    queue = _QUEUES.get(device)
    if queue is None:
        with _QUEUES_LOCK:
            queue = _QUEUES.setdefault(device, _Queue(device))
    return queue


def take(device: torch.device) -> Tuple[int, torch.Tensor]:
    """A free slot of ``device``'s queue, set to NOT_LANDED: (its index, an int32 [1] CPU tensor over
    it for the launch to copy its verdict into). With every slot in flight, waits for the device."""
    queue = _queue(device)
    for waited in (False, True):
        with queue.lock:
            if queue.free:
                index = queue.free.pop()
                queue.words[index] = NOT_LANDED
                return index, queue.views[index]
        if waited:
            break
        _wait(device)
        message = queue.landed()
        if message is not None:
            raise ValueError(message)
    raise RuntimeError(f"pending_checks: {SLOTS} checks on {device} still unanswered after waiting for the device "
                       "(their launches never copied a verdict); pass check=False to run without them")


def expect(device: torch.device, index: int, verdict: Verdict) -> None:
    """Queues slot ``index``'s check (after the launch that copies into it was queued), then raises
    the first bad verdict that has landed (see raise_landed)."""
    queue = _queue(device)
    with queue.lock:
        queue.waiting.append((index, verdict))
    raise_landed(device)


def launch_checked(device: torch.device, launch: Callable[[torch.Tensor], None], verdict: Verdict) -> None:
    """``launch(slot)`` with a slot of ``device``'s queue (the launch queues the copy of its verdict word
    into ``slot``), then the check expected; a launch that raises before queuing anything gives the slot back."""
    index, slot = take(device)
    try:
        launch(slot)
    except BaseException:
        release(device, index)
        raise
    expect(device, index, verdict)


def release(device: torch.device, index: int) -> None:
    """Gives back a slot taken for a launch that raised before queuing its copy."""
    queue = _queue(device)
    with queue.lock:
        queue.free.append(index)


def raise_landed(device: torch.device) -> None:
    """Raises ValueError with the first bad verdict of ``device`` that has landed; never waits."""
    queue = _QUEUES.get(device)
    if queue is not None and queue.waiting:
        message = queue.landed()
        if message is not None:
            raise ValueError(message)


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raise_pending(device: Optional[torch.device] = None) -> None:
    """Waits for ``device`` (every device with checks outstanding when None) and raises ValueError
    with the first bad verdict among the checks queued so far. Call it where a step may wait (after
    its metrics are read, say) to report a bad batch from that step rather than the next one."""
    devices = [indexed(device)] if device is not None else list(_QUEUES)
    for d in devices:
        queue = _QUEUES.get(d)
        if queue is not None and queue.waiting:
            _wait(d)
            raise_landed(d)


def where(device: torch.device, op: str) -> str:
    """The suffix a deferred message gets on CUDA (nothing on the CPU, where the call itself raises)."""
    return f" (in a {op} call on {device}, checked once its kernels ran)" if device.type == "cuda" else ""
