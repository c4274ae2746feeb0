"""The training passes' norms and MLPs compiled by torch.compile (Inductor): ``actor.compile_blocks``.

At the 0.5B Qwen2 shape on a GPU the update is launch-bound (the GPU busy under half the time), and
of a layer's ~100 forward + backward kernels the two
RMSNorms (~7 elementwise kernels each way: cast, pow, mean, add, rsqrt, two multiplies) and the
MLP's activation (silu, multiply) are about a third by that count. Compiled, each norm is one kernel
forward and one or two backward, the activation one; the attention (which writes the shared-prompt
pass's KV cache, a Python object per layer) and the linear layers stay eager. The kernel counts, time
and peak memory either way: docs/benchmarks.md, "Measurements behind the code's choices".

One compiled function per module class (``type(m).forward`` with the module as its argument), so a
model's 49 norms share one compile (and the reference model's, and a later model's of the class):
compiled on the first pass with its sizes symbolic (``dynamic=True``), so no later micro-batch
shape compiles again (with torch.compile's default, automatic dynamic shapes, the first new row
count and the first new width each recompiled, ~1-2 s inside whichever steady step first met
them), and once per grad mode. The compiled forwards are installed
for the length of a ``with`` only -- the training and log-prob passes -- so the rollout's decode
(eager or itself compiled whole) runs the model as it was. Families: the dense ones whose norms and
MLPs are the plain HF modules (``FAMILIES``), and the language model of the vision-language ones built on
them (``VISION_FAMILIES``, the vision tower left eager).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List

import torch

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# vision-language models whose language model's norms and MLPs are those plain modules (their vision tower's
# left eager)
VISION_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})
BLOCKS = ("RMSNorm", "MLP")  # class-name endings of the modules compiled (LlamaRMSNorm, Qwen2MLP, ...)


def blocks(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The norm and MLP modules of a model of ``FAMILIES`` (of ``VISION_FAMILIES``: its language model's)
    that ``compiled`` swaps; [] for other models."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES | VISION_FAMILIES:
        return []
    return [m for name, m in model.named_modules() if type(m).__name__.endswith(BLOCKS) and "forward" not in m.__dict__
            and not (family in VISION_FAMILIES and "visual" in name.split("."))]


@functools.cache
def _compiled_forward(cls: type):
    """The class's compiled forward, one per process."""
    return torch.compile(cls.forward, dynamic=True)


@contextlib.contextmanager
def compiled(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """While active, ``model``'s norms and MLPs run their class's compiled forward (module docstring)."""
    swapped = blocks(model) if enabled else []
    try:
        for m in swapped:
            m.forward = functools.partial(_compiled_forward(type(m)), m)  # an instance attribute, deleted below
        yield
    finally:
        for m in swapped:
            m.__dict__.pop("forward", None)
