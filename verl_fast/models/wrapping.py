"""What a training wrapper (FSDP1, FSDP2, DDP) did to a Hugging Face model, in one place."""

from __future__ import annotations

import torch


def is_sharded(model: torch.nn.Module) -> bool:
    """True for an FSDP1-wrapped model, an FSDP2 (``fully_shard``) model, or any model whose
    parameters are DTensors: its full weights exist only after a gather."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    if isinstance(model, (FSDP, FSDPModule)):
        return True
    # each module's own parameters (not ``model.parameters()``, which names and de-duplicates them: a few
    # times slower, and this is asked at every decode call)
    return any(type(p).__name__ == "DTensor" for m in model.modules() for p in m._parameters.values())


def hf_module(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside an FSDP1 / DDP wrapper (its ``.module``), else the model itself."""
    inner = getattr(model, "module", None)
    return inner if inner is not None and hasattr(inner, "save_pretrained") else model


def peft_base(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft wrapper (``get_base_model()``), else the model itself."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def wrapper_kind(model: torch.nn.Module):
    """``"fsdp2"`` or ``"fsdp1"`` when ``model`` or any module inside it carries that wrapper (the
    outermost one found first), else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    for m in model.modules():
        if isinstance(m, FSDPModule):
            return "fsdp2"
        if isinstance(m, FSDP):
            return "fsdp1"
    return None


def unwrapped_parameters(model: torch.nn.Module):
    """The parameters of ``model`` that no FSDP wrapper inside it manages (their gradients would not
    be reduced across ranks), e.g. a value head added on top of a wrapped backbone."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return list(model.parameters())
    managed = {id(p) for m in model.modules() if isinstance(m, (FSDP, FSDPModule)) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in managed]
