"""Checkpoints of a Megatron-trained actor, in the layout and with the guarantees of
``trainer/checkpoint.py`` (``step_N.tmp`` renamed once ``manifest.json`` is written; verified on
resume): ``step_N/megatron/`` is a Megatron distributed (``torch_dist``) checkpoint of the model and
its optimizer state, which resumes at any TP / PP layout and which ``verl-fast convert`` /
``load_megatron_checkpoint`` read; beside it the HF export (safetensors that transformers and vLLM
load), written from the rollout model, which carries the trained weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict

import torch

from verl_fast.models.wrapping import hf_module
from verl_fast.trainer import checkpoint
from verl_fast.trainer.ranks import on_main

MEGATRON = "megatron"


def save(output_dir: str, step: int, actor, hf_model: torch.nn.Module, tokenizer: Any,
         state: Dict[str, Any]) -> Path:
    """Collective: every rank writes its Megatron shards; rank 0 the HF export and the trainer state."""
    root = checkpoint.checkpoint_root(output_dir)
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"

    def prepare() -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / MEGATRON).mkdir(parents=True)

    def write_hf() -> None:
        hf_module(hf_model).save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / checkpoint.STATE).write_text(json.dumps({"step": step, **state}, indent=1, default=str))

    on_main(prepare)
    try:
        actor.save_checkpoint(tmp / MEGATRON)
        on_main(write_hf)
        records = checkpoint._checksums(tmp, on_main(lambda: checkpoint._files(tmp)))
        on_main(lambda: checkpoint._publish(tmp, final, records, step))
    except BaseException:
        on_main(lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise
    return final


def load(path: Path, actor, hf_model: torch.nn.Module) -> Dict[str, Any]:
    """Restores the Megatron model and optimizer, then the rollout model from them; the trainer state."""
    if not (path / MEGATRON).is_dir():
        raise checkpoint.CheckpointError(f"{path} has no {MEGATRON}/ folder: it was not written by an "
                                         "actor.strategy=megatron run")
    actor.load_checkpoint(path / MEGATRON)
    actor.export_to(hf_module(hf_model))
    return json.loads((path / checkpoint.STATE).read_text())
