"""The gradient norm of megatron-core's optimizers without Apex / Transformer Engine, computed on the
device in one pass.

Without those libraries megatron-core falls back to a norm that converts the list of per-tensor norms
(0-d device tensors) into a host tensor: one device-to-host copy, and so one wait for the device, per
parameter tensor at every optimiser step. ``use_foreach_grad_norm`` puts a foreach norm in its place
(same signature, same result, one device tensor, no host round trip); megatron-core still reads the
total norm once after reducing it over the model-parallel ranks.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                    per_tensor: bool, *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``amp_C.multi_tensor_l2norm``'s interface: the L2 norm of all of ``tensor_lists[0]`` together,
    as a float32 tensor of shape [1] on their device (per-tensor norms are not offered)."""
    if per_tensor:
        raise ValueError("foreach_l2_norm: per_tensor=True is not supported")
    tensors = tensor_lists[0]
    norms = torch._foreach_norm(tensors)  # one launch per dtype/device group, float32 grads stay float32
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def use_foreach_grad_norm() -> None:
    """Replaces megatron-core's host-side fallback norm (only that one: Apex's or Transformer Engine's
    kernel is kept when installed)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
