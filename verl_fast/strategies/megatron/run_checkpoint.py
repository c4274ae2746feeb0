"""The run's checkpoints under the Megatron strategy, in the layout and with the guarantees of
``verl_fast/checkpoint.py`` (``step_N.tmp`` renamed once ``manifest.json`` is written; verified on
resume): ``step_N/megatron/`` is a Megatron distributed (``torch_dist``) checkpoint of the model and
its optimizer state, which resumes at any TP / PP layout and which ``verl-fast convert`` /
``load_megatron_checkpoint`` read; ``step_N/megatron_critic/`` the same for a Megatron critic;
beside them the HF export (safetensors that transformers and vLLM load) of the actor, from the HF
actor, or gathered from the Megatron shards where the HF actor keeps no weights (vLLM rollout)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict

import torch

from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.checkpoint import model_card
from verl_fast.files import run_files, safe_load
from verl_fast.distributed import on_main
from verl_fast.models.wrapping import hf_module
from verl_fast.strategies.megatron import dist_checkpoint
from verl_fast.strategies.megatron.checkpoint_loader import checkpoint_globals
from verl_fast.strategies.megatron.shared_rollout import released
from verl_fast.strategies.megatron.training import MegatronTrained

MEGATRON = "megatron"
MEGATRON_CRITIC = "megatron_critic"


def save(output_dir: str, step: int, actor, hf_model: torch.nn.Module, tokenizer: Any,
         state: Dict[str, Any], critic=None) -> Path:
    """Collective: every rank writes its Megatron shards (the actor's, and ``critic``'s when it is a
    Megatron critic); rank 0 the HF export and the trainer state."""
    root = checkpoint.checkpoint_root(output_dir)
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"

    def prepare() -> None:
        checkpoint.prepare_root(root)
        run_files.remove(tmp)  # a killed write's leftover (a link by that name: the link only)
        (tmp / MEGATRON).mkdir(parents=True)
        if _is_megatron(critic):
            (tmp / MEGATRON_CRITIC).mkdir()

    weights = actor.hf_state() if released(hf_model) else None  # the HF actor keeps no weights (vLLM rollout)

    def write_hf() -> None:
        hf_module(hf_model).save_pretrained(tmp, safe_serialization=True, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / checkpoint.STATE).write_text(json.dumps({"step": step, **state}, indent=1, default=str))
        model_card.write(tmp, {"step": step, **state})  # the HF export's card

    on_main(prepare)
    try:
        dist_checkpoint.save(actor, tmp / MEGATRON)
        if _is_megatron(critic):
            dist_checkpoint.save(critic, tmp / MEGATRON_CRITIC)
        on_main(write_hf)
        records = checkpoint.records_to_publish(tmp, on_main(lambda: checkpoint.checkpoint_files(tmp)))
        on_main(lambda: checkpoint.publish(tmp, final, records, step))
    except BaseException:
        on_main(lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise
    return final


def load(path: Path, actor, hf_model: torch.nn.Module, critic=None) -> Dict[str, Any]:
    """Restores the Megatron model and optimizer (and a Megatron critic's), then the rollout model from
    them; the trainer state."""
    for folder, needed, strategy in ((MEGATRON, True, "actor"), (MEGATRON_CRITIC, _is_megatron(critic), "critic")):
        if needed and not (path / folder).is_dir():
            raise checkpoint.CheckpointError(f"{path} has no {folder}/ folder: it was not written by a "
                                             f"{strategy}.strategy=megatron run")
        if needed:  # megatron-core unpickles these with no allowlist: each is read as data only first
            safe_load.check_dcp_data(path / folder, checkpoint_globals(), "a Megatron checkpoint")
    dist_checkpoint.load(actor, path / MEGATRON)
    if _is_megatron(critic):
        dist_checkpoint.load(critic, path / MEGATRON_CRITIC)
    if not released(hf_model):
        actor.export_to(hf_module(hf_model))
    return json.loads((path / checkpoint.STATE).read_text())


def _is_megatron(critic) -> bool:
    return isinstance(critic, MegatronTrained)
