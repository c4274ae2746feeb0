"""Public entry points: ``verl_fast.reshard`` (one shot, plans cached), ``verl_fast.reshard.plan``
(a reusable :class:`ReshardPlan`), and ``vllm_weights`` for the rollout engine."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterator, Mapping, Optional, Tuple, Union

import torch

from verl_fast.ops import arguments as V
from verl_fast.ops.reshard import oneshot
from verl_fast.ops.reshard.fsdp import dtensor_layout
from verl_fast.ops.reshard.hf import detect_naming, hf_layout
from verl_fast.ops.reshard.layout import Layout
from verl_fast.ops.reshard.plan import (DEFAULT_BUCKET_BYTES, DEFAULT_TILE_BYTES, PLAIN_TENSOR_TYPES, ReshardPlan,
                                       Tensors)
from verl_fast.ops.reshard.spec import ModelSpec
from verl_fast.ops.reshard.vllm import consecutive_tp_ranks, vllm_layout

def plan(src_layout: Layout, dst_layout: Layout, *, rank: Optional[int] = None, group=None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, tile_bytes: int = DEFAULT_TILE_BYTES) -> ReshardPlan:
    """Plans this rank's part of moving ``src_layout`` to ``dst_layout`` (collective when the layouts
    span several ranks). Execute it every step with ``plan.execute(sources, destinations)``."""
    return ReshardPlan(src_layout, dst_layout, rank=rank, group=group, bucket_bytes=bucket_bytes,
                       tile_bytes=tile_bytes)


def reshard(sources: Tensors, src_layout: Layout, dst_layout: Layout, destinations: Optional[Tensors] = None, *,
            rank: Optional[int] = None, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            tile_bytes: int = DEFAULT_TILE_BYTES, device=None) -> "OrderedDict[str, torch.Tensor]":
    """Moves this rank's ``sources`` (held as ``src_layout`` says) into ``dst_layout``'s tensors.

    Returns this rank's destination tensors by name (written into ``destinations`` when given).
    The plan is built on the first call for a pair of layouts and reused afterwards, and so are the
    destination tensors it allocates: a later call with the same layouts overwrites the tensors an
    earlier one returned (clone them to keep them, or pass ``destinations``). A layout is read when
    a call first sees it: build a new one rather than changing one in place. For full control keep
    the plan yourself: ``p = verl_fast.reshard.plan(src, dst); p.execute(s, d)``.
    """
    call_key = ("reshard", id(src_layout), id(dst_layout), id(group), rank, bucket_bytes, tile_bytes, str(device))
    names, tensors = oneshot.execute(
        call_key, lambda: (src_layout.fingerprint(), dst_layout.fingerprint(), id(group), rank, bucket_bytes,
                           tile_bytes),
        lambda: plan(src_layout, dst_layout, rank=rank, group=group, bucket_bytes=bucket_bytes, tile_bytes=tile_bytes),
        sources, destinations, device, keep=(src_layout, dst_layout, group))
    return OrderedDict(zip(names, tensors))


reshard.plan = plan  # verl_fast.reshard.plan(src_layout, dst_layout, ...)


def model_spec(model_or_config: Union[torch.nn.Module, ModelSpec, object]) -> ModelSpec:
    if isinstance(model_or_config, ModelSpec):
        return model_or_config
    config = getattr(model_or_config, "config", model_or_config)
    return ModelSpec.from_hf_config(config)


def source_layout(spec: ModelSpec, state: Mapping[str, torch.Tensor]) -> Layout:
    """The layout a state dict is in: DTensors (FSDP2 / HSDP) or whole HF tensors on this rank."""
    values = list(state.values())
    if any(hasattr(v, "placements") for v in values):
        return dtensor_layout(spec, state)
    dtype = next((v.dtype for v in values if v.is_floating_point()), spec.dtype)
    return hf_layout(spec, names=detect_naming(spec, state.keys()), dtype=dtype)


def vllm_weights(model_or_state_dict: Union[torch.nn.Module, Mapping[str, torch.Tensor]],
                 config: Union[ModelSpec, object, None] = None, tensor_parallel_size: int = 1,
                 tp_rank: Optional[int] = None, dtype: Optional[torch.dtype] = None, device=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, tile_bytes: int = DEFAULT_TILE_BYTES,
                 out: Optional[Mapping[str, torch.Tensor]] = None, *,
                 reuse: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(vLLM name, tensor)`` pairs of vLLM's tensor-parallel shard ``tp_rank`` (fused ``qkv_proj``,
    ``gate_up_proj``, ``w13_weight``/``w2_weight``, padded vocab) from an HF model, its state dict,
    or an FSDP2-sharded model (then collective: every rank calls it and gets the shard of its TP
    rank, by default ``rank % tensor_parallel_size``). ``dtype`` converts on the way (default: the
    sources').

    The plan is kept for the next call with the same model shape, dtypes, devices and placements.
    The tensors returned are new at every call, so a result kept from one call never changes when
    the function is called again. ``reuse=True`` (a loop that hands each result to the engine
    before the next call) keeps the output tensors too and writes them again at every call of the
    same conversion: a call passing the same tensors as the last one (the same objects, or new ones
    over the same memory such as ``state_dict()`` makes, in any dict) then goes straight to the copy,
    and its results are valid until the next such call. ``out`` (vLLM name -> tensor, e.g. the
    engine's own parameters) is written instead, and returned (the short path applies there too).

    Engines that repack weights after loading (vLLM's CPU backend) take these through
    ``collective_rpc("reload_weights", ...)``: pass ``tensor_parallel_size=1`` there, vLLM slices its
    own shard. Where the engine keeps its parameters in the loaded layout (GPU builds), write into
    them directly and keep the plan: ``p = verl_fast.reshard.plan(src_layout, vllm_layout(spec, T,
    ...))`` once, then ``p.execute(sources, dict(vllm_model.named_parameters()))`` every step."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        spec = model_spec(config if config is not None else model_or_state_dict)
        # the parameters themselves (not detached copies): the same objects every call, so a plan
        # bound to them last time is still bound (FSDP1's full state dict clones them regardless)
        state = model_or_state_dict.state_dict(keep_vars=True)
    elif not isinstance(model_or_state_dict, Mapping):
        raise TypeError("model_or_state_dict must be a torch.nn.Module or a state dict (name -> tensor), got "
                        f"{type(model_or_state_dict).__name__}")
    else:
        if config is None:
            raise ValueError("config (an HF config or a ModelSpec) is required with a state dict")
        spec, state = model_spec(config), model_or_state_dict
    tp = V.size(tensor_parallel_size, "tensor_parallel_size", 1)
    if tp_rank is not None:
        tp_rank = V.size(tp_rank, "tp_rank")
        if tp_rank >= tp:
            raise ValueError(f"tp_rank must be in [0, tensor_parallel_size) = [0, {tp}), got {tp_rank}")
    bucket_bytes, tile_bytes = V.size(bucket_bytes, "bucket_bytes", 1), V.size(tile_bytes, "tile_bytes", 1)
    call_key = ("vllm", spec, tp, tp_rank, dtype, bucket_bytes, tile_bytes, str(device))

    def make_plan() -> ReshardPlan:
        src = source_layout(spec, state)
        wire = dtype or next((t.dtype for t in src.tensors), spec.dtype)
        return plan(src, vllm_layout(spec, tp, _tp_ranks(src.world_size, tp, tp_rank), world_size=src.world_size,
                                     dtype=wire), bucket_bytes=bucket_bytes, tile_bytes=tile_bytes)

    names, tensors = oneshot.execute(call_key, lambda: ("vllm", spec, tp, tp_rank, dtype, bucket_bytes, tile_bytes,
                                                        _signature(state)),
                                     make_plan, state, out, device, reuse=V.flag(reuse, "reuse"))
    return zip(names, tensors)


def _signature(state: Mapping[str, torch.Tensor]) -> tuple:
    """What a state dict's layout depends on: names, shapes, dtypes, devices, DTensor placements."""
    return tuple((k, v.shape, v.dtype, v.device) if type(v) in PLAIN_TENSOR_TYPES else
                 (k, tuple(v.shape), v.dtype, v.device, str(getattr(v, "placements", "")),
                  id(getattr(v, "device_mesh", None))) for k, v in state.items())


def _tp_ranks(world: int, tp: int, tp_rank: Optional[int]) -> Dict[int, int]:
    """Each process rank's TP rank (gathered when this rank's was given explicitly)."""
    if world == 1:
        return {0: 0 if tp_rank is None else tp_rank}
    if tp_rank is None:
        return consecutive_tp_ranks(world, tp)
    import torch.distributed as dist

    every = [None] * world
    dist.all_gather_object(every, tp_rank)
    return dict(enumerate(every))
