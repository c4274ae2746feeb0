"""Weight sync from a training actor into a vLLM engine's tensor-parallel shard, through one
``ReshardPlan`` built at the first sync and reused every step.

The actor is read where it lives (no full state dict is ever gathered): FSDP2 / DTensor shards,
FSDP1 flat-parameter shards, a whole HF model, or the tensor / pipeline-parallel shards of a
Megatron actor (anything with ``weight_source()``: a layout over the world and this rank's tensors). Every rank receives only the bytes of its own
vLLM TP shard that it does not hold, converted to the engine's dtype before they are sent. Two
destinations:

- ``direct=True``: vLLM's own parameter tensors (``qkv_proj`` / ``gate_up_proj`` fused, TP-sharded,
  vocab padded), written in place. Right where the engine keeps weights in the loaded layout (GPU
  builds, unquantized).
- ``direct=False``: whole checkpoint-named tensors (only this rank's TP regions filled, see
  ``vllm_reload_layout``) for vLLM's reload path, which slices its shard and re-runs the
  post-load processing (the CPU backend repacks its linear weights there). The buffers are
  allocated once and reused.

The plan runs on one device per rank. An actor on another device than the engine (a CPU model, or
FSDP shards offloaded to the host, beside an engine on a GPU) is first copied into buffers on the
engine's device, allocated once (the actor's own bytes on this rank, in its dtype); nothing else
goes through the host.

    sync = WeightSync(ModelSpec.from_hf_config(cfg), tensor_parallel_size=2, tp_rank_of={0: 0, 1: 1},
                      world_size=2, dtype=torch.bfloat16, direct=True)
    sync.run(actor, dict(vllm_model.named_parameters()))   # every step, on every rank
    sync.received_bytes                                     # what this rank received
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from verl_fast import distributed
from verl_fast.models.wrapping import hf_module
from verl_fast.ops.reshard import (Layout, ModelSpec, ReshardPlan, dtensor_layout, fsdp1_layout_from_module,
                                   fsdp1_sources, hf_layout, plan, vllm_layout)
from verl_fast.ops.reshard.layout import clean_name, local_tensor
from verl_fast.ops.reshard.plan import DEFAULT_BUCKET_BYTES
from verl_fast.ops.reshard.vllm import vllm_reload_layout


def actor_source(spec: ModelSpec, model: torch.nn.Module) -> Tuple[Layout, Mapping[str, torch.Tensor]]:
    """The layout the actor's parameters are in, and this rank's tensors of it by name. A plain module
    under several processes is a whole copy on every rank: each rank's TP shard is then copied locally."""
    if hasattr(model, "weight_source"):  # e.g. strategies/megatron/actor.MegatronActor
        return model.weight_source()
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        FSDP = ()
    if isinstance(model, FSDP):
        return fsdp1_layout_from_module(spec, model), fsdp1_sources(model)
    params = OrderedDict((clean_name(k), v) for k, v in hf_module(model).named_parameters())
    if any(hasattr(v, "placements") for v in params.values()):
        return dtensor_layout(spec, params), params
    dtype = next(v.dtype for v in params.values() if v.is_floating_point())
    world = distributed.world_size()  # e.g. the HF copy a Megatron actor exports to, on every rank
    return hf_layout(spec, ranks=range(world), world_size=world, dtype=dtype), params


class WeightSync:
    """One engine's weight sync (see the module docstring). ``tp_rank_of`` maps every process rank
    to the TP rank of the engine it runs (consecutive ranks form a TP group: ``r % T``)."""

    def __init__(self, spec: ModelSpec, tensor_parallel_size: int, tp_rank_of: Mapping[int, int], world_size: int,
                 dtype: torch.dtype, direct: bool, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        build = vllm_layout if direct else vllm_reload_layout
        self.spec = spec
        self.direct = direct
        self.dst_layout = build(spec, tensor_parallel_size, dict(tp_rank_of), world_size=world_size, dtype=dtype)
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.plan: Optional[ReshardPlan] = None
        self._sources: List[torch.Tensor] = []
        self._staged: Optional[List[torch.Tensor]] = None  # the sources' copies on the engine's device
        self._buffers: Optional["OrderedDict[str, torch.Tensor]"] = None

    def _prepare(self, model: torch.nn.Module, device: Optional[torch.device]) -> None:
        src, tensors = actor_source(self.spec, model)
        self.plan = plan(src, self.dst_layout, group=self.group, bucket_bytes=self.bucket_bytes)
        self._sources = [tensors[name] for name in self.plan.src_names]
        local = [local_tensor(x) for x in self._sources]
        if device is not None and any(x.numel() and x.device != device for x in local):
            self._staged = [torch.empty_like(x, device=device) for x in local]

    def run(self, model: torch.nn.Module,
            destinations: Optional[Mapping[str, torch.Tensor]] = None) -> "OrderedDict[str, torch.Tensor]":
        """Writes this rank's engine tensors from ``model`` (collective over the layouts' ranks).

        ``destinations``: the engine's parameters by name (direct); ``None`` for the reload path,
        which returns the reused buffers to hand to vLLM's loader."""
        if self.plan is None:
            device = next((x.device for x in (destinations or {}).values() if x.numel()), None)
            self._prepare(model, device)
        if destinations is None:
            if self._buffers is None:
                device = next((x.device for x in self._sources if x.numel()), torch.device("cpu"))
                self._buffers = self.plan.allocate_destinations(device)
            destinations = self._buffers
        sources = self._sources
        if self._staged is not None:
            for staged, x in zip(self._staged, self._sources):
                staged.copy_(local_tensor(x), non_blocking=True)
            sources = self._staged
        return self.plan.execute(sources, destinations)

    @property
    def received_bytes(self) -> int:
        """Bytes this rank receives from other ranks per sync (its TP shard minus what it holds)."""
        return self.plan.stats()["received_bytes"] if self.plan is not None else 0

    def stats(self) -> Dict[str, int]:
        return self.plan.stats() if self.plan is not None else {}
