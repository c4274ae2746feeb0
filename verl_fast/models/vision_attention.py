"""The vision tower's attention over many images in a few calls (Qwen2-VL / Qwen2.5-VL).

The tower runs every image of a forward as one sequence of patches and attends within segments
given by ``cu_seqlens``: each image (Qwen2-VL, and Qwen2.5-VL's full-attention blocks) or each
window of 8 x 8 patches (Qwen2.5-VL's other blocks). With transformers' ``sdpa`` the tower loops
over the segments in Python, one attention call (and a split and a concatenation) per segment:
per block, one call for every window of every picture, each a few tiny kernels. transformers takes the segments' boundaries in one call
only for an implementation whose name says "flash" (its variable-length kernels); ``ATTENTION`` is
such a name for ``segment_attention``, which groups the segments by length and runs one batched
``scaled_dot_product_attention`` per distinct length (a picture's windows are all one length, bar
the edge windows of a grid that the window does not divide), exactly the per-segment attention.
``batched`` sets it on a model's vision tower for the length of a block (the language model keeps
its own).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import torch
from transformers import AttentionInterface

from verl_fast.models.wrapping import hf_module

ATTENTION = "verl_fast_flash_segments"  # "flash" in the name: transformers hands over cu_seqlens whole


def _groups(cu_seqlens: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
    """(length, the token indices [n, length] of the n segments of that length) for each distinct segment
    length of ``cu_seqlens`` [S + 1], on its device (one read to the host)."""
    bounds = cu_seqlens.tolist()
    by_length: dict = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    device = cu_seqlens.device
    return [(length, torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device))
            for length, starts in by_length.items()]


def segment_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                      cu_seq_lens_q=None, **kwargs) -> Tuple[torch.Tensor, None]:
    """Attention within each segment of ``cu_seq_lens_q`` (no mask, not causal) over query / key / value
    [1, heads, T, D]: one ``scaled_dot_product_attention`` per distinct segment length. Returns
    [1, T, heads, D] as transformers' attention functions do."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError("segment_attention serves a vision tower's packed patches: query [1, heads, T, D] "
                         f"with cu_seq_lens_q; got query {list(query.shape)}, cu_seq_lens_q {cu_seq_lens_q}")
    heads, tokens, dim = query.shape[1:]
    outs, order = [], []
    for length, index in _groups(cu_seq_lens_q):
        flat = index.reshape(-1)
        q, k, v = (t[0].index_select(1, flat).reshape(heads, -1, length, dim).transpose(0, 1)
                   for t in (query, key, value))  # [n, heads, length, D]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling)
        outs.append(out.transpose(1, 2).reshape(-1, heads, dim))  # [n * length, heads, D]
        order.append(flat)
    if len(outs) == 1 and outs[0].shape[0] == tokens:  # the segments cover the tokens in order
        return outs[0][None], None
    placed = torch.empty(tokens, dtype=torch.long, device=query.device)
    positions = torch.cat(order)
    placed[positions] = torch.arange(positions.numel(), device=query.device)
    return torch.cat(outs).index_select(0, placed)[None], None


AttentionInterface.register(ATTENTION, segment_attention)


def _tower_config(model: torch.nn.Module) -> Optional[object]:
    config = getattr(hf_module(model), "config", None)
    vision = getattr(config, "vision_config", None)
    return vision if vision is not None and hasattr(vision, "_attn_implementation") else None


@contextlib.contextmanager
def batched(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s vision tower attends through ``segment_attention`` inside the block, where it attends
    with ``sdpa`` (its other implementations, and a model without a tower, are left alone)."""
    config = _tower_config(model)
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield
        return
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
