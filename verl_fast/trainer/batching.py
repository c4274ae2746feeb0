"""Token-budget micro-batches for the trainer, with loss scales that keep gradient accumulation exact.

The trainer's update over one (per-rank) batch::

    mbs = make_micro_batches(attention_mask.sum(-1), max_token_len_per_gpu,
                             loss_weights=response_mask.sum(-1), dp_group=dp_group)
    for idx, scale in mbs:                       # idx: int64 indices into the batch
        loss = token_mean_loss(model(batch[idx]), response_mask[idx])   # mean over this micro-batch
        (loss * scale).backward()
    log_probs = mbs.restore([... one output per micro-batch ...])       # back in batch order

A micro-batch's mean loss times ``scale`` sums, over micro-batches, to the mean over the whole
batch, whatever the micro-batches' sizes: ``scale_b = W_b / W`` where ``W_b`` is the loss weight in
micro-batch b (response tokens for a token-mean loss; sequences for the seq-mean-* modes) and ``W``
the batch's total. With ``dp_group``, ``W`` is the total over all data-parallel ranks and the scale
is multiplied by the group's size, because FSDP / DDP average gradients over ranks: the averaged
gradient is then the gradient of the global mean. Dividing by the micro-batch count instead (the
usual gradient-accumulation recipe) weights a 10-token micro-batch like a 10,000-token one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import torch

from verl_fast.ops import schedule

__all__ = ["MicroBatches", "make_micro_batches", "loss_scales"]


def loss_scales(weights: Sequence[float], dp_group=None) -> List[float]:
    """Per-micro-batch loss multipliers ``W_b / W`` (times the DP world size with ``dp_group``).

    ``weights[b]``: micro-batch b's loss weight — its response-token count for a token-mean loss,
    its sequence count for seq-mean-token-mean / seq-mean-token-sum. With ``dp_group`` (a
    ``torch.distributed`` process group) ``W`` is all-reduced over the group, and each scale is
    multiplied by the group's size to undo the gradient averaging over ranks. A micro-batch of
    weight 0 (no response tokens) gets scale 0; skip its backward, as its mean loss is 0/0.
    """
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if w.ndim != 1 or len(w) == 0:
        raise ValueError(f"weights must be a non-empty 1-D sequence (one per micro-batch), got {len(w)} values")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights must be finite and >= 0")
    total, world = float(w.sum()), 1
    if dp_group is not None:
        import torch.distributed as dist

        total = float(schedule.reduce_over(dp_group, total, "sum", torch.float64))
        world = dist.get_world_size(dp_group)
    if total <= 0:
        raise ValueError("the loss weights sum to 0 (no response tokens in the batch)")
    return [float(x) * world / total for x in w]


@dataclass(frozen=True)
class MicroBatches:
    """Micro-batch index tensors, their loss scales, and the packing plan they came from.

    Iterating gives ``(indices, loss_scale)`` pairs; ``len()`` is the micro-batch count.
    """

    indices: List[torch.Tensor]  # int64 CPU tensors: micro-batch b is batch[indices[b]]
    loss_scales: List[float]
    plan: schedule.Plan

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, float]]:
        return iter(zip(self.indices, self.loss_scales))

    def restore(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-micro-batch outputs (dim 0 runs over the micro-batch's sequences) in batch order."""
        if len(outputs) != len(self.indices):
            raise ValueError(f"outputs must hold one tensor per micro-batch ({len(self.indices)}), got {len(outputs)}")
        for b, (out, idx) in enumerate(zip(outputs, self.indices)):
            if out.shape[0] != len(idx):
                raise ValueError(f"outputs[{b}] must have {len(idx)} rows (its micro-batch's sequences), "
                                 f"got {out.shape[0]}")
        cat = torch.cat(list(outputs), dim=0)
        order = torch.cat(self.indices).to(cat.device)
        restored = torch.empty_like(cat)
        restored[order] = cat
        return restored


def make_micro_batches(token_counts, max_token_len_per_gpu: int, *, loss_weights=None, dp_group=None,
                       same_count_across_dp: bool = True, min_num: int = 1,
                       layout: str = "packed") -> MicroBatches:
    """Micro-batches of one rank's batch within ``max_token_len_per_gpu`` tokens each.

    ``token_counts``: tokens per sequence that occupy the model (e.g. ``attention_mask.sum(-1)``),
    a list / numpy array / integer tensor. ``loss_weights``: per-sequence loss weight — response
    tokens (``response_mask.sum(-1)``) for a token-mean loss, 1 per row with a response token for the
    seq-mean modes; default ``token_counts``. ``dp_group``: with ``same_count_across_dp`` every rank of the group gets the
    same micro-batch count, and loss weights are totalled over the group (see module docstring).
    ``layout``: ``"packed"`` (sequences concatenated, remove-padding) or ``"padded"`` (each micro-batch
    padded to its longest sequence). A sequence over the budget gets its own micro-batch
    (``plan.oversize`` lists them).
    """
    plan = schedule.pack_micro_batches(token_counts, max_token_len_per_gpu, min_num,
                                       dp_group if (dp_group is not None and same_count_across_dp) else None,
                                       layout=layout)
    indices = [torch.as_tensor(g) for g in plan]
    if loss_weights is None:
        weights = plan.tokens
    else:
        w = loss_weights.detach().cpu().double().numpy() if isinstance(loss_weights, torch.Tensor) \
            else np.asarray(loss_weights, dtype=np.float64)
        n = sum(len(i) for i in indices)
        if w.shape != (n,):
            raise ValueError(f"loss_weights must hold one weight per sequence ({n}), got shape {list(w.shape)}")
        weights = [float(w[i.numpy()].sum()) for i in indices]
    return MicroBatches(indices=indices, loss_scales=loss_scales(weights, dp_group), plan=plan)
