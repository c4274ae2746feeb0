"""Rollout over data-parallel engine groups inside one torchrun world.

Every rank runs an engine; consecutive ranks form one tensor-parallel group (one vLLM engine over
``T`` ranks), and the ``world / T`` groups generate independently. ``generate`` is collective: each
rank passes its own prompts; all prompts are split over the groups balanced by expected tokens
(``n * (prompt length + max_tokens)``, Karmarkar-Karp from ``verl_fast.schedule``), every rank of a
group generates its group's share (the same requests, so a TP group stays in step), and the
results are gathered so that each rank gets the completions of its own prompts, in its order.
Each prompt keeps its sampling spec (and seed) whichever group serves it.

``GroupSharedEngine``: ranks that hold the same data (a Megatron model-parallel group) send their
prompts once, from the group's first rank, and all get its completions.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Union

import torch
import torch.distributed as dist

from verl_fast.ops.schedule import balance_partitions
from verl_fast.records.generation import GenerationOutput, SamplingSpec, merge_outputs, pad_completions
from verl_fast.rollout.base import RolloutEngine


def rows_of(out: GenerationOutput, start: int, stop: int) -> GenerationOutput:
    """The completions of prompts ``[start, stop)`` of ``out`` (grouped by prompt in order),
    re-indexed from 0 and trimmed to their own width."""
    index = out.prompt_index
    keep = ((index >= start) & (index < stop)).nonzero().flatten()
    lo, hi = (int(keep[0]), int(keep[-1]) + 1) if keep.numel() else (0, 0)
    width = max(1, int(out.response_mask[lo:hi].sum(-1).max())) if hi > lo else 1
    return GenerationOutput(
        prompt_index=index[lo:hi] - start, response_ids=out.response_ids[lo:hi, :width].clone(),
        response_mask=out.response_mask[lo:hi, :width].clone(),
        logprobs=out.logprobs[lo:hi, :width].clone() if out.logprobs is not None else None,
        texts=out.texts[lo:hi], finish_reasons=out.finish_reasons[lo:hi],
        routed_experts=out.routed_experts[lo:hi] if out.routed_experts is not None else None)


class EngineWrapper(RolloutEngine):
    """Passes everything but ``generate`` to the wrapped ``self.engine``."""

    engine: RolloutEngine

    @property
    def owns_weights(self) -> bool:
        return self.engine.owns_weights

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def waves_by_default(self) -> bool:
        return self.engine.waves_by_default

    def sync_from(self, model: torch.nn.Module) -> Dict[str, float]:
        return self.engine.sync_from(model)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def metrics(self) -> dict:
        return self.engine.metrics()

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class DataParallelEngine(EngineWrapper):
    """``engine`` (this rank's member of a TP group of ``tensor_parallel_size`` consecutive ranks)
    serving the whole world's prompts; see the module docstring."""

    collective = True

    def __init__(self, engine: RolloutEngine, tensor_parallel_size: int, pad_token_id: int, group=None):
        self.engine = engine
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        tp = int(tensor_parallel_size)
        if tp < 1 or self.world % tp:
            raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the number of processes ({self.world})")
        self.tp = tp
        self.num_groups = self.world // tp
        self.pad_token_id = pad_token_id

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: Union[SamplingSpec, Sequence[SamplingSpec]]) -> GenerationOutput:
        specs = [sampling] * len(prompts) if isinstance(sampling, SamplingSpec) else list(sampling)
        if len(specs) != len(prompts):
            raise ValueError(f"one sampling spec per prompt expected: {len(prompts)} prompts, {len(specs)} specs")
        mine = ([list(map(int, p)) for p in prompts], specs)
        every: List = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        flat = [(p, s) for ps, ss in every for p, s in zip(ps, ss)]
        start = sum(len(ps) for ps, _ in every[: self.rank])
        if not flat:
            return pad_completions([], [], [], self.pad_token_id)
        cost = [s.n * (len(p) + s.max_tokens) for p, s in flat]
        plan = balance_partitions(cost, min(self.num_groups, len(flat)), equal_size=False)
        parts = [sorted(int(i) for i in plan[g]) for g in range(len(plan))] + [[]] * self.num_groups
        share = parts[self.rank // self.tp]
        out = self.engine.generate([flat[i][0] for i in share], [flat[i][1] for i in share]) if share else None
        outs: List = [None] * self.world
        dist.all_gather_object(outs, out if self.rank % self.tp == 0 else None, group=self.group)
        merged = merge_outputs([(outs[g * self.tp], parts[g]) for g in range(self.num_groups) if parts[g]],
                               self.pad_token_id)
        return rows_of(merged, start, start + len(prompts))


class GroupSharedEngine(EngineWrapper):
    """``engine`` (collective over the world) for ranks whose ``group`` holds the same prompts: only the
    group's first rank sends them, the others send none, and the completions are broadcast over the
    group, so every rank of it trains on the same samples and each prompt is generated once."""

    collective = True

    def __init__(self, engine: RolloutEngine, group):
        self.engine, self.group = engine, group
        self.first = dist.get_rank(group) == 0
        self.src = dist.get_global_rank(group, 0)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: Union[SamplingSpec, Sequence[SamplingSpec]]) -> GenerationOutput:
        out = self.engine.generate(prompts if self.first else [], sampling if self.first else [])
        box = [out if self.first else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

