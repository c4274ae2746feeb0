"""How the trainer's models (actor, reference, critic) are laid out over the data-parallel ranks,
built from the config when the user passes plain Hugging Face models.

``actor.strategy`` / ``critic.strategy``:
- ``fsdp2`` (what ``auto`` means with several processes): ``fully_shard`` on every decoder layer,
  then on the whole model, whose own group holds what the layers leave out (embeddings, final norm,
  heads). Each parameter becomes a DTensor sharded on dim 0 over all ranks; gradients are
  reduce-scattered (averaged) in the backward.
- ``fsdp1``: ``FullyShardedDataParallel`` with one unit per decoder layer (``use_orig_params``).
- ``none`` (what ``auto`` means in one process): the plain module on ``trainer.device``.
(``megatron`` is the Megatron-core strategy, ``megatron/``.)
Options of a sharded model: ``mixed_precision: bfloat16`` (bf16 parameters in forward and backward,
fp32 gradient reduction, fp32 weights in the optimizer; the alternative to ``autocast``; for an
unsharded actor ``bf16_compute.py`` does the same),
``cpu_offload`` (sharded parameters, gradients and optimizer state live on the CPU),
``gradient_checkpointing`` (recompute each layer's activations in the backward),
``unsharded_accumulation`` (FSDP2, see ``micro_steps``).

A model the user already wrapped (FSDP2 or FSDP1) is used as it is, never re-wrapped; only
parameters left outside every wrapper (a value head on a wrapped backbone) get a root wrapper of the
same kind, so that their gradients are reduced too.
"""

from __future__ import annotations

import copy
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterator, List, Sequence, TypeVar

import torch
from torch import nn

from verl_fast.distributed import collective_device, is_distributed, world_size
from verl_fast.models.wrapping import hf_module, peft_base, unwrapped_parameters, wrapper_kind


@dataclass(frozen=True)
class Sharding:
    """A resolved strategy (``fsdp2`` | ``fsdp1`` | ``none``) and its options."""

    strategy: str
    mixed_precision: bool = False
    cpu_offload: bool = False
    gradient_checkpointing: bool = False
    unsharded_accumulation: str = "off"

    @staticmethod
    def from_config(section, name: str, world: int) -> "Sharding":
        """From the ``actor`` or ``critic`` config section (``name`` is the section's name)."""
        strategy = section.strategy
        if strategy == "auto":
            strategy = "fsdp2" if world > 1 else "none"
        if strategy == "none" and world > 1:
            raise ValueError(f"{name}.strategy=none is not supported with {world} processes: gradients would "
                             f"not be reduced across ranks; use {name}.strategy=fsdp2 (or fsdp1)")
        if strategy in ("fsdp2", "fsdp1") and not is_distributed():
            raise ValueError(f"{name}.strategy={strategy} needs torch.distributed initialised (run under "
                             f"torchrun); use {name}.strategy=none in one process")
        mixed = section.mixed_precision == "bfloat16"  # auto: none when sharded (FSDP)
        if strategy == "none" and ((mixed and name != "actor") or section.cpu_offload):
            key = "cpu_offload" if section.cpu_offload else "mixed_precision"
            raise ValueError(f"{name}.{key} is not supported with {name}.strategy=none (one process); "
                             f"use {name}.autocast=bfloat16 for bf16 compute, or run under torchrun with fsdp2")
        if section.cpu_offload and collective_device().type != "cuda":
            raise ValueError(f"{name}.cpu_offload needs CUDA (NCCL): offloading moves shards from the GPU "
                             "to the CPU, and without a GPU the model is on the CPU already; remove it")
        return Sharding(strategy, mixed, section.cpu_offload, section.gradient_checkpointing,
                        section.unsharded_accumulation)


def compute_device(sharding: Sharding, wanted: str, model: nn.Module) -> torch.device:
    """Where the model computes: the collective device when sharded (FSDP moves the shards there,
    or keeps them on the CPU under offload and computes there), else ``trainer.device`` (``auto``:
    where the model's parameters already are)."""
    if sharding.strategy != "none" or wrapper_kind(model) is not None:
        return collective_device()
    if wanted == "auto":
        return next(model.parameters()).device
    device = torch.device(wanted)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible")
    return device


def shard(model: nn.Module, sharding: Sharding, device: torch.device) -> nn.Module:
    """The module to train: ``model`` wrapped as ``sharding`` says (FSDP2 wraps in place, FSDP1
    returns a wrapper), or as it is when the user wrapped it already (plus a root wrapper of the
    same kind over parameters no wrapper manages)."""
    kind = wrapper_kind(model)
    if sharding.gradient_checkpointing:
        enable_checkpointing(model)
    if kind is not None:
        if not unwrapped_parameters(model):
            return model
        return _WRAP[kind](model, replace(sharding, strategy=kind), layers=[])
    if sharding.strategy == "none":
        return model.to(device)
    return _WRAP[sharding.strategy](model, sharding, layers=decoder_layers(model))


def enable_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing on the outermost Hugging Face model inside ``model`` (non-reentrant,
    which FSDP's per-layer hooks need)."""
    target = next((m for m in model.modules() if hasattr(m, "gradient_checkpointing_enable")), None)
    if target is None:
        raise ValueError(f"gradient_checkpointing needs a Hugging Face model; {type(model).__name__} has no "
                         "gradient_checkpointing_enable()")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The modules Hugging Face says must not be split (``_no_split_modules``: the decoder layers),
    innermost first, so that wrapping them in this order wraps children before their parents."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return list(reversed([m for m in model.modules() if type(m).__name__ in names and m is not model]))


@lru_cache(maxsize=None)
def _mesh(device_type: str, world: int, group_id: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world,))


def data_parallel_mesh():
    """The 1-D mesh over every rank that FSDP2 shards on (one per process group)."""
    import torch.distributed as dist

    return _mesh(collective_device().type, world_size(), id(dist.group.WORLD))


def _fsdp2(model: nn.Module, sharding: Sharding, layers: List[nn.Module], mesh=None) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh or data_parallel_mesh()}
    if sharding.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if sharding.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    root = fsdp_root(model)
    fully_shard(root, **kwargs)
    if layers and _keeps_unsharded(root, sharding):  # never for a model the user wrapped
        _GATHER_ONCE.add(root)
    return model


def fsdp_root(model: nn.Module) -> nn.Module:
    """The module that carries FSDP2's root: the Hugging Face model inside a peft wrapper, else ``model``.
    FSDP2 initialises its layers' states from the root's first forward; peft's ``generate`` calls the
    inner model's, never the wrapper's, so a root on the wrapper met layers that an earlier ``generate``
    had made roots of their own (every later pass then failed)."""
    return peft_base(model)


# FSDP2 models this module wrapped whose micro-batches run on parameters gathered once per step
_GATHER_ONCE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
T = TypeVar("T")


def _keeps_unsharded(model: nn.Module, sharding: Sharding) -> bool:
    """``unsharded_accumulation`` resolved: ``auto`` is on when the whole model's parameters (in
    the compute dtype) and fp32 gradients take at most a quarter of the device's memory."""
    if sharding.unsharded_accumulation != "auto" or sharding.cpu_offload:
        return sharding.unsharded_accumulation == "on" and not sharding.cpu_offload
    numel = sum(p.numel() for p in model.parameters())  # DTensors count their global size
    param_bytes = 2 if sharding.mixed_precision else next(model.parameters()).element_size()
    device = collective_device()
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return numel * (param_bytes + 4) <= memory // 4


def _set_fsdp2_resharding(model: nn.Module, after_forward: bool) -> None:
    model.set_reshard_after_forward(after_forward)
    if after_forward:  # the root's own default: not resharded after forward (backward needs it at once)
        model.set_reshard_after_forward(False, recurse=False)


def micro_steps(model: nn.Module, micro: Sequence[T]) -> Iterator[T]:
    """Yields the micro-batches of one optimiser step. For an FSDP2 model wrapped here with
    ``unsharded_accumulation`` on, the parameters are all-gathered by the first forward and kept
    until the last backward, and gradients accumulate unsharded and unreduced until the last
    backward reduce-scatters them: one all-gather and one reduce-scatter per step instead of one per
    micro-batch, the same gradient. Other models: the micro-batches as they are."""
    model = fsdp_root(model)
    if model not in _GATHER_ONCE or len(micro) < 2:
        yield from micro
        return
    _set_fsdp2_resharding(model, after_forward=False)
    try:
        for i, item in enumerate(micro):
            last = i == len(micro) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            yield item
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        _set_fsdp2_resharding(model, after_forward=True)


@contextmanager
def gathered_for_passes(model: nn.Module, passes: int) -> Iterator[None]:
    """Around ``passes`` no-grad forwards of an FSDP2 model wrapped here with
    ``unsharded_accumulation`` on: parameters all-gathered by the first forward, kept for the others
    and resharded at the end."""
    model = fsdp_root(model)
    if model not in _GATHER_ONCE or passes < 2:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    _set_fsdp2_resharding(model, after_forward=False)
    try:
        yield
    finally:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        _set_fsdp2_resharding(model, after_forward=True)


def _fsdp1(model: nn.Module, sharding: Sharding, layers: List[nn.Module]) -> nn.Module:
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    device = collective_device()
    kwargs = {"use_orig_params": True, "device_id": device}
    if layers:
        kwargs["auto_wrap_policy"] = ModuleWrapPolicy({type(m) for m in layers})
    if sharding.mixed_precision:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if sharding.cpu_offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    return FSDP(model, **kwargs)


_WRAP = {"fsdp2": _fsdp2, "fsdp1": _fsdp1}


def reference_from(actor: nn.Module, sharding: Sharding, device: torch.device) -> nn.Module:
    """A frozen copy of the actor's current weights, laid out as the actor is. A plain actor is
    deep-copied. An FSDP2 actor's copy is built on the meta device, sharded on the actor's mesh and
    filled shard by shard from the actor's local shards (no rank ever holds the whole model). An
    FSDP1 actor's full weights are gathered to the CPU once and sharded again."""
    kind = wrapper_kind(actor)
    hf = hf_module(actor)
    if kind is None:
        return freeze(copy.deepcopy(hf).to(device))
    if not hasattr(type(hf), "_from_config"):
        raise ValueError(f"building the reference from an FSDP-wrapped {type(hf).__name__} needs a Hugging Face "
                         "model class; pass ref_model")
    sharding = replace(sharding, strategy=kind, gradient_checkpointing=False)
    dtype = _local(next(hf.parameters())).dtype
    if kind == "fsdp1":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True))
        ref = type(hf)._from_config(copy.deepcopy(hf.config), dtype=dtype)
        ref.load_state_dict({k.removeprefix("module."): v for k, v in full.items()})
        return freeze(_fsdp1(ref, sharding, decoder_layers(ref)))
    with torch.device("meta"):
        ref = type(hf)._from_config(copy.deepcopy(hf.config), dtype=dtype)
    mesh = next(p for p in hf.parameters()).device_mesh
    ref = _fsdp2(ref, sharding, decoder_layers(ref), mesh=mesh)
    ref.to_empty(device=_local(next(hf.parameters())).device)
    ours, theirs = dict(ref.named_parameters()), dict(hf.named_parameters())
    if ours.keys() != theirs.keys():
        raise ValueError("the actor's parameters do not match a fresh model built from its config; pass ref_model")
    with torch.no_grad():
        for name, p in ours.items():
            if p.placements != theirs[name].placements or p.shape != theirs[name].shape:
                raise ValueError(f"parameter {name}: the actor is sharded as {theirs[name].placements}, "
                                 f"{list(theirs[name].shape)}; pass ref_model")
            p.to_local().copy_(theirs[name].to_local())
        for name, buf in hf.named_buffers():  # non-persistent buffers (rotary tables) too
            owner, _, leaf = name.rpartition(".")
            ref.get_submodule(owner)._buffers[leaf] = buf.detach().clone()
    return freeze(ref)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
