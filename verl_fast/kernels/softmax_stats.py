"""Partial softmax statistics of a row of logits, and how to merge them (pure torch, no Triton).

A slice of a row's (temperature-scaled) logits ``z`` -- one vocabulary tile, one vocabulary chunk,
or one tensor-parallel rank's shard -- is summarised by four fp32 numbers:

    m   a reference point (the slice's max)
    s   sum exp(z - m)
    t   sum exp(z - m) * (z - m)        (only when the entropy is wanted)
    zl  the label's logit if the label falls in the slice, else 0

Keeping ``t`` relative to ``m`` (rather than ``sum p * z``) makes the entropy
``H = log(s) - t / s`` a sum of two non-negative terms, so large-magnitude logits lose nothing
to cancellation. Moving a summary to a new reference ``M >= m`` scales ``s`` by ``exp(m - M)``
and turns ``t`` into ``exp(m - M) * (t + (m - M) * s)``; that rule merges vocabulary splits,
chunks and ranks alike.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist


class Stats(NamedTuple):
    m: torch.Tensor
    s: torch.Tensor
    t: Optional[torch.Tensor]
    zl: torch.Tensor


def _rebase(st: Stats, ref: torch.Tensor) -> Stats:
    scale = torch.exp(st.m - ref)
    t = None if st.t is None else scale * (st.t + (st.m - ref) * st.s)
    return Stats(ref, scale * st.s, t, st.zl)


def merge(parts: Stats) -> Stats:
    """Merges summaries stacked along dim 0 (``[S, N]`` each) into one per token (``[N]``)."""
    ref = parts.m.max(dim=0).values
    st = _rebase(parts, ref)
    t = None if st.t is None else st.t.sum(0)
    return Stats(ref, st.s.sum(0), t, st.zl.sum(0))


def merge_across(st: Stats, group) -> Stats:
    """Merges per-rank summaries of vocabulary shards across a tensor-parallel group (two all-reduces)."""
    ref = st.m.clone()
    dist.all_reduce(ref, op=dist.ReduceOp.MAX, group=group)
    st = _rebase(st, ref)
    parts = [st.s, st.zl] if st.t is None else [st.s, st.zl, st.t]
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return Stats(ref, packed[0], None if st.t is None else packed[2], packed[1])


def finalize(st: Stats) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(lse, logp, entropy or None)`` from merged summaries."""
    log_s = torch.log(st.s)
    lse = st.m + log_s
    entropy = None if st.t is None else log_s - st.t / st.s
    return lse, st.zl - lse, entropy


def vocab_shard(group, local_vocab: int) -> Tuple[int, int]:
    """``(first id of this rank's shard, global vocabulary size)``: equal contiguous shards in rank order."""
    if group is None:
        return 0, local_vocab
    return dist.get_rank(group) * local_vocab, dist.get_world_size(group) * local_vocab
