"""Megatron distributed (``torch_dist``) checkpoints of a trained Megatron model and its distributed
optimizer (``training.MegatronTrained``): each rank writes its shards, and a checkpoint loads at any
other tensor / pipeline / data-parallel layout (the optimizer state in megatron-core's fully
reshardable form). ``run_checkpoint.py`` places them in a run's step folders."""

from __future__ import annotations

import contextlib
from typing import Any, Dict

import torch

from verl_fast.strategies.megatron.training import MegatronTrained


def _sharded_state(trained: MegatronTrained, is_loading: bool) -> Dict[str, Any]:
    model = {(f"model{v}" if trained.par.vpp else "model"): c.module.sharded_state_dict()
             for v, c in enumerate(trained.model.chunks)}
    # the canonical per-parameter optimizer state: reloadable at any TP / PP / DP layout
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    return {**model, "optimizer": trained.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=meta)}


def save(trained: MegatronTrained, path) -> None:
    """Writes a ``torch_dist`` checkpoint into the (existing, empty) folder ``path``; collective."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(_sharded_state(trained, is_loading=False), str(path))


def load(trained: MegatronTrained, path) -> None:
    """Restores the model and optimizer from ``save``'s folder, whatever layout wrote it; collective."""
    from megatron.core import dist_checkpointing

    optimizer = trained.optimizer
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not opt.optimizer.state:  # never stepped: megatron-core needs states to load into (its own
            opt._init_optimizer_states_with_dummy_values()  # zero-gradient step; the load overwrites it)
    state = dist_checkpointing.load(_sharded_state(trained, is_loading=True), str(path))
    for v, c in enumerate(trained.model.chunks):
        c.module.load_state_dict(state[f"model{v}" if trained.par.vpp else "model"])
    with _torch_adam_step_kept(optimizer):
        optimizer.load_state_dict(state["optimizer"])


@contextlib.contextmanager
def _torch_adam_step_kept(optimizer):
    """Two slips of megatron-core 0.16 when it loads a fully reshardable state into torch's Adam (no Apex
    / Transformer Engine): it copies every state tensor a parameter has, "step" included, from a record
    that leaves "step" out (a KeyError), and it gives every parameter the same "step" tensor, which
    torch's Adam then increments once per parameter. While active, only the tensors the record holds
    are copied; on exit each parameter gets its own "step"."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            continue

        def copy_present(model_param, tensors, opt=opt):
            group, order = opt.model_param_group_index_map[model_param]
            main = opt.optimizer.param_groups[group]["params"][order]
            dst = {"param": main, **opt.optimizer.state[main]}
            for key, value in tensors.items():
                dst[key].copy_(value)

        opt._set_main_param_and_optimizer_states = copy_present
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
