"""FP8 e4m3 weights with block scales, as an FP8 rollout engine holds them (``rollout.quantization: fp8``):
the quantisation the resharding engine writes into the engine's parameters (``csrc/reshard/fp8.h``: scale
= amax / 448 per block, round to nearest even, saturated), and its inverse.

``block``: ``(128, 128)`` (vLLM's block-FP8 linear layers: ``weight`` float8_e4m3fn ``[N, K]`` and
``weight_scale_inv`` float32 ``[ceil(N / 128), ceil(K / 128)]``, the multiplier that dequantises) or
``"channel"`` (one scale per output row, ``[N, 1]``)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from verl_fast.ops.native import cuda_stream, ext

Block = Union[Tuple[int, int], str]
BLOCK = (128, 128)  # vLLM's weight_block_size
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value (csrc/reshard/fp8.h's kFp8Max)


def block_shape(block: Block, cols: int) -> Tuple[int, int]:
    """(rows, cols) of one scale's block; ``"channel"``: (1, the whole row)."""
    if block == "channel":
        return 1, max(cols, 1)
    if (not isinstance(block, tuple) or len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool)
                                                                 and b >= 1 for b in block)):
        raise ValueError(f"block must be 'channel' or (rows, cols) of positive ints, got {block!r}")
    return block


def scale_shape(shape: Tuple[int, int], block: Block) -> Tuple[int, int]:
    br, bc = block_shape(block, shape[1])
    return -(-shape[0] // br), -(-shape[1] // bc)


def quantize(x: torch.Tensor, block: Block = BLOCK, out: Optional[torch.Tensor] = None,
             scale_out: Optional[torch.Tensor] = None, num_threads: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, cols]`` (float32 / bfloat16 / float16 / float64, any strides) as ``(q float8_e4m3fn [rows,
    cols], scale float32 [blocks])``; ``out`` / ``scale_out`` (views into an engine's parameters, rows
    contiguous) are written in place."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [rows, cols], got {getattr(x, 'shape', type(x).__name__)}")
    br, bc = block_shape(block, x.shape[1])
    if out is None:
        out = torch.empty(x.shape, dtype=FP8, device=x.device)
    if scale_out is None:
        scale_out = torch.empty(scale_shape(tuple(x.shape), block), dtype=torch.float32, device=x.device)
    if out.dtype != FP8:
        raise TypeError(f"out must be float8_e4m3fn, got {out.dtype}")
    ext().fp8_quantize(x, out.view(torch.uint8), scale_out, br, bc, cuda_stream(x), num_threads)
    return out, scale_out


def quantize_many(sources: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], scale_outs: Sequence[torch.Tensor],
                  block: Block = BLOCK, num_threads: int = 0) -> None:
    """``quantize(sources[i], block, out=outs[i], scale_out=scale_outs[i])`` for every ``i`` in one call: on a
    GPU one launch per 32 tensors of a dtype, no host synchronisation (what a weight sync runs). ``outs``
    (float8_e4m3fn) and ``scale_outs`` (float32): existing tensors, e.g. views into an engine's parameters,
    disjoint; every tensor on one device. ``block``: one shape for all (``"channel"`` per tensor's rows).
    On a GPU the launches start while the later tensors are read: a bad tensor is named after the ones before
    it were queued."""
    if not (len(sources) == len(outs) == len(scale_outs)):
        raise ValueError(f"sources, outs and scale_outs must be as long, got {len(sources)}, {len(outs)} and "
                         f"{len(scale_outs)}")
    if not sources:
        return
    for i, out in enumerate(outs):
        if out.dtype != FP8:
            raise TypeError(f"outs[{i}] must be float8_e4m3fn, got {out.dtype}")
    br, bc = (1, 0) if block == "channel" else block_shape(block, 1)
    ext().fp8_quantize_many(list(sources), [o.view(torch.uint8) for o in outs], list(scale_outs), br, bc,
                            cuda_stream(sources[0]), num_threads)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: Block = BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` block by block, in ``dtype``: the weight an FP8 layer computes with."""
    br, bc = block_shape(block, q.shape[1])
    full = scale.repeat_interleave(br, 0)[: q.shape[0]].repeat_interleave(bc, 1)[:, : q.shape[1]]
    return (q.to(torch.float32) * full).to(dtype)
