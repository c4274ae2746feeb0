"""The process environment vLLM needs to run inside the trainer's process; the launcher sets it.

``configure_vllm_env()`` is called by the ``verl-fast`` CLI (and by scripts and tests) before any
``VLLMInferenceEngine`` is built; where nobody has set ``VLLM_ENABLE_V1_MULTIPROCESSING``, the engine's
constructor calls it itself, and otherwise only checks (its error says what to change).

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's engine core runs in this process, so weights can be
  handed to it as tensors (with multiprocessing they would have to be serialised to another process).
- ``OMP_NUM_THREADS`` (CPU only, when unset): set to torch's current thread count. Without it an
  in-process vLLM-CPU engine drops torch to ONE intra-op thread for the whole process (its serving
  default), which would slow training that shares the process. (vLLM-CPU also makes
  ``torch.set_num_threads`` a no-op; ``VLLMInferenceEngine(cpu_threads=...)`` switches threads
  around its own calls through ``torch._C.set_num_threads``.)
"""

from __future__ import annotations

import os
from typing import Dict

import torch

IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


def configure_vllm_env(keep_torch_threads: bool = True) -> Dict[str, str]:
    """Sets the variables above in ``os.environ``; returns what it set. Call before building engines.

    Safe to call when vLLM is not installed (it only sets variables)."""
    changed = {IN_PROCESS: "0"}
    if keep_torch_threads and not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        changed["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    os.environ.update(changed)
    return changed
