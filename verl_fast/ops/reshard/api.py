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
from verl_fast.ops.reshard.vllm import vllm_layout

_PLANS: "OrderedDict[tuple, ReshardPlan]" = OrderedDict()
_MAX_CACHED = 8


def plan(src_layout: Layout, dst_layout: Layout, *, rank: Optional[int] = None, group=None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, tile_bytes: int = DEFAULT_TILE_BYTES) -> ReshardPlan:
    """Plans this rank's part of moving ``src_layout`` to ``dst_layout`` (collective when the layouts
    span several ranks). Execute it every step with ``plan.execute(sources, destinations)``."""
    return ReshardPlan(src_layout, dst_layout, rank=rank, group=group, bucket_bytes=bucket_bytes,
                       tile_bytes=tile_bytes)


def _cached_plan(src_layout: Layout, dst_layout: Layout, **kw) -> ReshardPlan:
    key = (src_layout.fingerprint(), dst_layout.fingerprint(), id(kw.get("group")), kw.get("rank"),
           kw.get("bucket_bytes"), kw.get("tile_bytes"))
    if key in _PLANS:
        _PLANS.move_to_end(key)
        return _PLANS[key]
    p = plan(src_layout, dst_layout, **kw)
    _PLANS[key] = p
    while len(_PLANS) > _MAX_CACHED:
        _PLANS.popitem(last=False)
    return p


def reshard(sources: Tensors, src_layout: Layout, dst_layout: Layout, destinations: Optional[Tensors] = None, *,
            rank: Optional[int] = None, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            tile_bytes: int = DEFAULT_TILE_BYTES, device=None) -> "OrderedDict[str, torch.Tensor]":
    """Moves this rank's ``sources`` (held as ``src_layout`` says) into ``dst_layout``'s tensors.

    Returns this rank's destination tensors by name (written into ``destinations`` when given).
    The plan is built on the first call for a pair of layouts and reused afterwards; for full
    control keep the plan yourself: ``p = verl_fast.reshard.plan(src, dst); p.execute(s, d)``.
    """
    p = _cached_plan(src_layout, dst_layout, rank=rank, group=group, bucket_bytes=bucket_bytes,
                     tile_bytes=tile_bytes)
    return p.execute(sources, destinations, device=device)


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
    sources').

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
    src = source_layout(spec, state)
    dtype = dtype or next((t.dtype for t in src.tensors), spec.dtype)
    tp = int(tensor_parallel_size)
    if src.world_size > 1:
        import torch.distributed as dist

        mine = (dist.get_rank() % tp) if tp_rank is None else int(tp_rank)
        every = [None] * src.world_size
        dist.all_gather_object(every, mine)
        tp_of: Dict[int, int] = dict(enumerate(every))
    else:
        tp_of = {0: 0 if tp_rank is None else int(tp_rank)}
    dst = vllm_layout(spec, tp, tp_of, world_size=src.world_size, dtype=dtype)
    out = reshard(state, src, dst, bucket_bytes=bucket_bytes, device=device)
    return iter(out.items())
