"""OpenMP's wait policy for a process that trains on a GPU, set before torch loads: the `verl-fast`
process sets it for itself, a trainer in async_mode full for its rollout worker processes.

torch's CPU ops run parallel regions on GNU OpenMP's thread pool, whose idle workers spin before they
sleep (``OMP_WAIT_POLICY`` unset). On a GPU machine, in a trainer process whose torch.compile caches
were warm, the updates after the first step ran about twice as long, the kernels no busier, while the
native worker threads burned CPU-seconds spinning; with ``OMP_WAIT_POLICY=PASSIVE`` the same run had no
such steps (docs/benchmarks.md, "Measurements behind the code's choices"). On a CPU-only
machine the spinning is what keeps torch's own parallel ops fast (the default run's steps took ~30%
longer under PASSIVE on 2 cores), so the policy is set only where an NVIDIA device is present.
libgomp reads the variable once, when torch loads it: ``use`` must run before ``import torch``.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

VARIABLE = "OMP_WAIT_POLICY"
# present wherever an NVIDIA driver serves a GPU: the control device (also inside containers) and the
# driver's /proc entry (on the host)
NVIDIA_MARKERS = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


def use(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Sets ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (default: this process's) on a machine with
    an NVIDIA GPU, unless the variable is already set."""
    environ = os.environ if environ is None else environ
    if VARIABLE not in environ and any(os.path.exists(path) for path in NVIDIA_MARKERS):
        environ[VARIABLE] = "PASSIVE"
