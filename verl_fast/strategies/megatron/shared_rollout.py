"""Rollout beside a Megatron actor when the engine holds its own weights (vLLM).

- The engine's weights come straight from the Megatron shards (``engine.sync_from(megatron_actor)``:
  one resharding plan from the TP / PP layout to the engine's TP layout, each rank receiving only
  the bytes of its engine shard it does not hold), so the HF actor's weights are not needed: they are
  released (its parameters moved to the meta device; the reference model, when one is used, was
  copied from them before). Checkpoints export HF weights from the Megatron shards instead.
- The ranks of a model-parallel group hold the same prompts: only the group's first rank sends them
  to the engine and the completions are broadcast over the group (``GroupSharedEngine``), so each
  prompt is generated once and every rank of the group trains on the same samples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl_fast.models.wrapping import hf_module
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout.data_parallel import GroupSharedEngine


def megatron_rollout(engine: RolloutEngine, megatron_actor, hf_actor: torch.nn.Module) -> RolloutEngine:
    """``engine`` set up for ``megatron_actor`` as the module docstring says (collective)."""
    hf_module(hf_actor).to("meta")
    group = megatron_actor.model_parallel_group()
    if dist.get_world_size(group) > 1:
        return GroupSharedEngine(engine, group)
    return engine


def released(hf_actor: torch.nn.Module) -> bool:
    """True when ``megatron_rollout`` released the HF actor's weights."""
    return next(hf_module(hf_actor).parameters()).is_meta
