"""Checkpoints as Hugging Face folders (safetensors that transformers and vLLM load) plus the
optimizer and trainer state, written atomically: into a temporary folder, then renamed.

Layout: ``<output_dir>/checkpoints/step_000010/{config.json, model.safetensors, tokenizer files,
optimizer.pt, trainer_state.json[, critic.pt, critic_optimizer.pt]}``. A folder named ``step_N``
is complete by construction; a run killed mid-write leaves only a ``.tmp`` folder, which resume
ignores (and removes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from verl_fast import safe_load
from verl_fast.models.wrapping import hf_module, is_sharded

_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def latest(output_dir: str) -> Optional[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return max(steps)[1] if steps else None


def full_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The whole model's parameters on the CPU, gathered from FSDP shards when sharded."""
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if is_sharded(model):
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    except ImportError:  # pragma: no cover
        pass
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def save(output_dir: str, step: int, actor: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
         state: Dict[str, Any], critic: Optional[torch.nn.Module] = None,
         critic_optimizer: Optional[torch.optim.Optimizer] = None, is_main: bool = True) -> Optional[Path]:
    """Writes ``step_<step>`` atomically; returns its path (on the main rank)."""
    weights = full_state_dict(actor)  # collective under FSDP: every rank calls it
    if not is_main:
        return None
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    model = hf_module(actor)
    # tied embeddings share storage; save_pretrained de-duplicates them itself
    model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if critic is not None:
        torch.save({k: v.detach().cpu() for k, v in critic.state_dict().items()}, tmp / "critic.pt")
        if critic_optimizer is not None:
            torch.save(critic_optimizer.state_dict(), tmp / "critic_optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=1, default=str))
    _fsync_dir(tmp)
    if final.exists():  # an older run's checkpoint of the same step
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    return final


def _fsync_dir(path: Path) -> None:
    for p in path.iterdir() if path.is_dir() else []:
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_partial(output_dir: str) -> None:
    root = checkpoint_root(output_dir)
    if root.is_dir():
        for p in root.iterdir():
            if ".tmp-" in p.name:
                shutil.rmtree(p, ignore_errors=True)


def load(path: Path, actor: torch.nn.Module, optimizer: torch.optim.Optimizer,
         critic: Optional[torch.nn.Module] = None,
         critic_optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
    """Restores weights and optimizer state in place; returns the trainer state."""
    from safetensors.torch import load_file

    weights: Dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(f))
    _load_weights(actor, weights)
    optimizer.load_state_dict(safe_load.load(path / "optimizer.pt"))  # state dicts are data only
    if critic is not None and (path / "critic.pt").exists():
        critic.load_state_dict(safe_load.load(path / "critic.pt"))
        if critic_optimizer is not None and (path / "critic_optimizer.pt").exists():
            critic_optimizer.load_state_dict(safe_load.load(path / "critic_optimizer.pt"))
    return json.loads((path / "trainer_state.json").read_text())


def _load_weights(model: torch.nn.Module, weights: Dict[str, torch.Tensor]) -> None:
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    module = hf_module(model)
    missing, unexpected = module.load_state_dict(weights, strict=False)
    tied = set(getattr(module, "_tied_weights_keys", None) or [])
    tied_embeddings = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
    missing = [k for k in missing if k not in tied and not (tied_embeddings and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
