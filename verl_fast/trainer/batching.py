"""How the trainer splits a step's sequences: over data-parallel ranks (balanced by tokens), into
micro-batches (by count or under a token budget), and the normalisers that keep gradient
accumulation exact.

Exactness. A micro-batch's loss is its *sum* over response tokens (or sequences) divided by the
count of the whole mini-batch (``loss_normalisers``), so the micro-batch losses add up to the
mini-batch's mean whatever their sizes; dividing each micro-batch's own mean by the number of
micro-batches instead would weight a 10-token micro-batch like a 10,000-token one. With R
data-parallel ranks the count is the global one divided by R, because FSDP averages gradients over
ranks: the average of the ranks' gradients is then the gradient of the global mean.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from verl_fast.algos.loss_terms import active_rows
from verl_fast.distributed import usable_bytes
from verl_fast.ops import schedule
from verl_fast.records.experience import Experience, concat
from verl_fast.strategies.memory_plan import MEMORY_FRACTION, Shape, activation_bytes, shape_of

__all__ = ["loss_normalisers", "micro_batches", "balance_across_ranks", "token_budget", "padded_budget"]

CPU_TOKEN_BUDGET = 16384  # actor.max_token_len_per_gpu unset where the free memory is not known
MIN_TOKEN_BUDGET = 4096  # the auto budget's floor


def loss_normalisers(response_mask: torch.Tensor, group=None, norm_length: float = 0) -> Dict[str, float]:
    """The counts a (mini-)batch's losses divide by (see the module docstring): ``num_tokens``
    (response tokens) and ``num_seqs`` (rows with at least one response token), over ``group``'s
    ranks and divided by its size; ``dp_size``, the rank count (token-sum, a plain sum, is multiplied
    by it instead, to undo the averaging); ``norm_length``, seq-mean-token-sum-norm's constant
    divisor (the trainer passes ``loss_scale_factor`` or ``max_new_tokens``: each micro-batch is cut
    to its own longest response, so its width is no constant; 0 leaves ``agg_loss`` the batch's
    width, exact only for the whole batch in one piece)."""
    tokens = float(response_mask.sum())
    seqs = float(active_rows(response_mask))
    if group is None:
        return {"num_tokens": tokens, "num_seqs": seqs, "dp_size": 1, "norm_length": norm_length}
    world = dist.get_world_size(group)
    return {"num_tokens": schedule.reduce_over(group, tokens, "sum", torch.float64) / world,
            "num_seqs": schedule.reduce_over(group, seqs, "sum", torch.float64) / world, "dp_size": world,
            "norm_length": norm_length}


def micro_batches(rows: torch.Tensor, token_counts: Optional[torch.Tensor] = None, *, size: Optional[int] = None,
                  max_tokens: Optional[int] = None, group=None, packed: bool = False) -> List[torch.Tensor]:
    """``rows`` (indices into a batch) cut into micro-batches: ``size`` rows each, or, with
    ``max_tokens``, micro-batches within that token budget, where ``token_counts[r]`` is row r's
    tokens: their sum when the passes run the rows ``packed`` without padding, else rows x longest.
    Under a budget every rank of ``group`` gets the same micro-batch count (FSDP ranks must run the
    same number of forward passes)."""
    if (size is None) == (max_tokens is None):
        raise ValueError("give exactly one of size (rows per micro-batch) or max_tokens (a token budget)")
    if max_tokens is None:
        return [rows[i : i + size] for i in range(0, rows.numel(), size)]
    if rows.numel() == 0:
        return []
    tokens = token_counts[rows].tolist()
    plan = schedule.pack_micro_batches(tokens, max_tokens, 1, group, layout="packed" if packed else "padded")
    return [rows[torch.as_tensor(idx, dtype=torch.long).to(rows.device)] for idx in plan]


def token_budget(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 compiled: bool, half: bool, state_bytes: float = 8.0, checkpointed: bool = False,
                 casts_weights: bool = False) -> int:
    """``actor.max_token_len_per_gpu``'s auto: on a GPU, the tokens whose activations
    (``memory_plan.activation_bytes``; ``compiled``: the norms and MLPs compiled, ``half``: bf16 / fp16
    passes, ``checkpointed``: under gradient checkpointing) fit ``MEMORY_FRACTION`` of the memory free now
    less what the update is still to allocate (the gradients of parameters that have none yet, the
    optimizer's states before its first step: ``state_bytes`` per trained parameter, 8 for AdamW's two
    fp32 moments); at least ``MIN_TOKEN_BUDGET``; ``casts_weights``: autocast casts fp32 weights in each
    pass (no bf16 copies of them). Counted for packed rows (``padded_budget``: for rows that run padded).
    Call it before the first update; elsewhere ``CPU_TOKEN_BUDGET``."""
    if device.type != "cuda":
        return CPU_TOKEN_BUDGET
    shape = shape_of(model)
    if not shape.width or not shape.layers:
        return CPU_TOKEN_BUDGET
    per_token = activation_bytes(shape, 2 if half else 4, compiled, checkpointed)

    # (trained parameter, this rank's shard of it: a DTensor's local tensor)
    trained = [(p, p.to_local() if hasattr(p, "to_local") else p) for p in model.parameters() if p.requires_grad]
    pending = sum(t.numel() * t.element_size() for p, t in trained if p.grad is None)
    if getattr(optimizer, "state", None) == {}:  # before its first step: exp_avg, exp_avg_sq to come
        pending += sum(state_bytes * t.numel() for _, t in trained)
    if casts_weights:  # autocast's bf16 casts of the fp32 weights, held by each pass (frozen ones for its backward)
        pending += sum(2 * p.numel() for p in model.parameters() if p.dtype == torch.float32)
    available = usable_bytes(device) - pending
    return max(MIN_TOKEN_BUDGET, int(MEMORY_FRACTION * max(available, 0) / per_token))


def padded_budget(budget: int, shape: Shape, width: int, half: bool, compiled: bool, checkpointed: bool = False) -> int:
    """``token_budget``'s ``budget`` (counted for packed rows) for rows that run padded to ``width``: the
    same activation memory over what such rows keep a token (``memory_plan.layer_bytes``'s
    ``padded_width``); at least the floor."""
    element = 2 if half else 4
    packed_bytes = activation_bytes(shape, element, compiled, checkpointed)
    padded_bytes = activation_bytes(shape, element, compiled, checkpointed, padded_width=width)
    return max(MIN_TOKEN_BUDGET, int(budget * packed_bytes / padded_bytes))


def balance_across_ranks(exp: Experience, group=None) -> tuple[Experience, Dict[str, Any]]:
    """The step's sequences redistributed over the ranks of ``group`` so that each trains on a nearly
    equal token count (Karmarkar-Karp on the sequences' lengths, equal counts per rank). Call it after
    the advantages are computed, while each rank still holds whole prompt groups."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = exp.input_ids.device
    parts: List[Experience] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(parts, exp.to(torch.device("cpu")), group=group)
    everything = concat(parts)
    plan = schedule.balance_partitions(everything.attention_mask.sum(-1), world, equal_size=True)
    before = torch.stack([p.attention_mask.sum() for p in parts]).float()
    metrics = {"dp/imbalance_before": float(before.max() / before.mean()),
               "dp/imbalance_after": plan.report.imbalance}
    return everything.select(torch.as_tensor(plan[rank], dtype=torch.long)).to(device), metrics
