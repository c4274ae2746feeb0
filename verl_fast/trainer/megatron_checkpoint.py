"""Checkpoints of a Megatron-trained actor: ``step_N/`` holds the HF export (safetensors that
transformers and vLLM load, written from the rollout model, which carries the trained weights)
and ``step_N/megatron/``, a Megatron distributed (``torch_dist``) checkpoint of model and optimizer
that resumes at any TP / PP layout and that ``verl-fast convert`` / ``load_megatron_checkpoint``
read. Written atomically: every rank writes into ``step_N.tmp-megatron``, rank 0 renames it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from verl_fast.models.wrapping import hf_module
from verl_fast.trainer import checkpoint


def save(output_dir: str, step: int, actor, hf_model: torch.nn.Module, tokenizer: Any, state: Dict[str, Any],
         is_main: bool) -> Optional[Path]:
    """Collective: every rank calls it. Returns the final folder on the main rank."""
    root = checkpoint.checkpoint_root(output_dir)
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp-megatron"  # one name on every rank
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "megatron").mkdir(parents=True)
    dist.barrier()
    actor.save_checkpoint(tmp / "megatron")
    dist.barrier()
    if not is_main:
        return None
    hf_module(hf_model).save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=1, default=str))
    for folder in (tmp / "megatron", tmp):
        checkpoint._fsync_dir(folder)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    checkpoint._fsync_dir(root)
    return final


def load(path: Path, actor, hf_model: torch.nn.Module) -> Dict[str, Any]:
    """Restores the Megatron model and optimizer, then the rollout model from them; the trainer state."""
    if not (path / "megatron").is_dir():
        raise ValueError(f"{path} has no megatron/ folder: it was not written by an actor.strategy=megatron run")
    actor.load_checkpoint(path / "megatron")
    actor.export_to(hf_module(hf_model))
    return json.loads((path / "trainer_state.json").read_text())
