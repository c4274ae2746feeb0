"""Public entry points: ``verl_fast.reshard`` (one shot, plans cached), ``verl_fast.reshard.plan``
(a reusable :class:`ReshardPlan`), and ``vllm_weights`` for the rollout engine."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterator, Mapping, Optional, Tuple, Union

import torch

from verl_fast.ops.reshard.fsdp import dtensor_layout
from verl_fast.ops.reshard.hf import detect_naming, hf_layout
from verl_fast.ops.reshard.layout import Layout
from verl_fast.ops.reshard.plan import DEFAULT_BUCKET_BYTES, DEFAULT_TILE_BYTES, ReshardPlan, Tensors
from verl_fast.ops.reshard.spec import ModelSpec
from verl_fast.ops.reshard.vllm import consecutive_tp_ranks, vllm_layout

# One-shot calls keep their plans and the destination tensors they allocated, least recently used
# dropped first: a plan's planning and a model's worth of allocations cost more than the copy itself.
_PLANS: "OrderedDict[tuple, ReshardPlan]" = OrderedDict()
_BUFFERS: "OrderedDict[tuple, OrderedDict]" = OrderedDict()
_MAX_CACHED = 8


def _remember(cache: OrderedDict, key: tuple, make):
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    while len(cache) > _MAX_CACHED:
        cache.popitem(last=False)
    return value


def plan(src_layout: Layout, dst_layout: Layout, *, rank: Optional[int] = None, group=None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, tile_bytes: int = DEFAULT_TILE_BYTES) -> ReshardPlan:
    """Plans this rank's part of moving ``src_layout`` to ``dst_layout`` (collective when the layouts
    span several ranks). Execute it every step with ``plan.execute(sources, destinations)``."""
    return ReshardPlan(src_layout, dst_layout, rank=rank, group=group, bucket_bytes=bucket_bytes,
                       tile_bytes=tile_bytes)


def _execute_cached(key: tuple, make_plan, sources: Tensors, destinations: Optional[Tensors], device):
    """Runs the cached plan of ``key``; without ``destinations``, into the buffers this key's
    earlier calls allocated on the same device (allocated at the first call)."""
    p = _remember(_PLANS, key, make_plan)
    if destinations is None:
        if device is None:
            first = next(iter(sources.values() if isinstance(sources, Mapping) else sources), None)
            device = getattr(first, "device", None) or torch.device("cpu")
        destinations = _remember(_BUFFERS, key + (str(device),), lambda: p.allocate_destinations(device))
    return p.execute(sources, destinations)


def reshard(sources: Tensors, src_layout: Layout, dst_layout: Layout, destinations: Optional[Tensors] = None, *,
            rank: Optional[int] = None, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            tile_bytes: int = DEFAULT_TILE_BYTES, device=None) -> "OrderedDict[str, torch.Tensor]":
    """Moves this rank's ``sources`` (held as ``src_layout`` says) into ``dst_layout``'s tensors.

    Returns this rank's destination tensors by name (written into ``destinations`` when given).
    The plan is built on the first call for a pair of layouts and reused afterwards, and so are the
    destination tensors it allocates: a later call with the same layouts overwrites the tensors an
    earlier one returned (clone them to keep them). For full control keep the plan yourself:
    ``p = verl_fast.reshard.plan(src, dst); p.execute(s, d)``.
    """
    key = (src_layout.fingerprint(), dst_layout.fingerprint(), id(group), rank, bucket_bytes, tile_bytes)
    return _execute_cached(key, lambda: plan(src_layout, dst_layout, rank=rank, group=group,
                                             bucket_bytes=bucket_bytes, tile_bytes=tile_bytes),
                           sources, destinations, device)


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
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(vLLM name, tensor)`` pairs of vLLM's tensor-parallel shard ``tp_rank`` (fused ``qkv_proj``,
    ``gate_up_proj``, ``w13_weight``/``w2_weight``, padded vocab) from an HF model, its state dict,
    or an FSDP2-sharded model (then collective: every rank calls it and gets the shard of its TP
    rank, by default ``rank % tensor_parallel_size``). ``dtype`` converts on the way (default: the
    sources'). Layouts, plan and output tensors are kept for the next call with the same model
    shape, tensors and placements: the tensors returned are overwritten by that call.

    Engines that repack weights after loading (vLLM's CPU backend) take these through
    ``collective_rpc("reload_weights", ...)``: pass ``tensor_parallel_size=1`` there, vLLM slices its
    own shard. Where the engine keeps its parameters in the loaded layout (GPU builds), write into
    them directly and keep the plan: ``p = verl_fast.reshard.plan(src_layout, vllm_layout(spec, T,
    ...))`` once, then ``p.execute(sources, dict(vllm_model.named_parameters()))`` every step."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        spec = model_spec(config if config is not None else model_or_state_dict)
        state = model_or_state_dict.state_dict()
    elif not isinstance(model_or_state_dict, Mapping):
        raise TypeError("model_or_state_dict must be a torch.nn.Module or a state dict (name -> tensor), got "
                        f"{type(model_or_state_dict).__name__}")
    else:
        if config is None:
            raise ValueError("config (an HF config or a ModelSpec) is required with a state dict")
        spec, state = model_spec(config), model_or_state_dict
    tp = int(tensor_parallel_size)
    key = ("vllm", spec, tp, tp_rank, dtype, bucket_bytes, _signature(state))

    def make_plan() -> ReshardPlan:
        src = source_layout(spec, state)
        wire = dtype or next((t.dtype for t in src.tensors), spec.dtype)
        return plan(src, vllm_layout(spec, tp, _tp_ranks(src.world_size, tp, tp_rank), world_size=src.world_size,
                                     dtype=wire), bucket_bytes=bucket_bytes)

    return iter(_execute_cached(key, make_plan, state, None, device).items())


def _signature(state: Mapping[str, torch.Tensor]) -> tuple:
    """What a state dict's layout depends on: names, shapes, dtypes, devices, DTensor placements."""
    return tuple((k, tuple(v.shape), v.dtype, v.device, str(getattr(v, "placements", "")),
                  id(getattr(v, "device_mesh", None))) for k, v in state.items())


def _tp_ranks(world: int, tp: int, tp_rank: Optional[int]) -> Dict[int, int]:
    """Each process rank's TP rank (gathered when this rank's was given explicitly)."""
    if world == 1:
        return {0: 0 if tp_rank is None else int(tp_rank)}
    if tp_rank is None:
        return consecutive_tp_ranks(world, tp)
    import torch.distributed as dist

    every = [None] * world
    dist.all_gather_object(every, int(tp_rank))
    return dict(enumerate(every))
