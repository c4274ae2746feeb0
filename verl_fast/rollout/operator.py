"""RolloutOperator: turns a batch of prompts into completions through an engine, with per-batch
(and per-prompt) sampling chosen by an overridable ``get_generation_kwargs``."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from verl_fast.records.prompts import PromptBatch, PromptRow
from verl_fast.records.generation import GenerationOutput, SamplingSpec, merge_outputs
from verl_fast.rollout.base import RolloutEngine
from verl_fast.ops.schedule import rollout_buckets


class RolloutOperator:
    """Subclass and override ``get_generation_kwargs`` to sample differently per batch, e.g.::

        class Mixed(RolloutOperator):
            def get_generation_kwargs(self, batch):
                return [{"temperature": 0.0} if row.data_source == "exact" else {} for row in batch]

    ``batch`` is a ``PromptBatch``: rows (``row.data_source``, ``row.columns``) and columns
    (``batch["task_type"]``: any field of the dataset's rows). It returns one dict for the whole
    batch or one per prompt; keys are SamplingSpec's fields (HF's ``max_new_tokens``,
    ``num_return_sequences``, ``do_sample`` are accepted too) and override the defaults
    (``generation_config``) for that call only.
    """

    def __init__(self, engine: RolloutEngine, default: Union[SamplingSpec, Dict[str, Any], None] = None,
                 max_num_seqs: Optional[int] = None, max_batch_tokens: Optional[int] = None):
        """With ``max_batch_tokens``, prompts go to the engine in length-bucketed waves
        (``verl_fast.schedule.rollout_buckets``): similar prompt lengths together, at most
        ``max_num_seqs`` sequences and ``max_batch_tokens`` worst-case tokens per wave."""
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        if isinstance(default, SamplingSpec):
            self.default = default
        else:
            self.default = SamplingSpec.from_kwargs(SamplingSpec(), dict(default or {}))

    def get_generation_kwargs(self, batch: Sequence[PromptRow]) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        return {}

    def specs(self, batch: Sequence[PromptRow], seed: Optional[int] = None) -> List[SamplingSpec]:
        kwargs = self.get_generation_kwargs(PromptBatch(batch))
        per_prompt = kwargs if isinstance(kwargs, list) else [kwargs] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"get_generation_kwargs returned {len(per_prompt)} dicts for {len(batch)} prompts")
        specs = []
        for i, kw in enumerate(per_prompt):
            kw = dict(kw or {})
            if seed is not None and "seed" not in kw and self.default.seed is None:
                kw["seed"] = seed + i  # reproducible sampling per step and prompt
            specs.append(SamplingSpec.from_kwargs(self.default, kw))
        return specs

    def generate(self, batch: Sequence[PromptRow],
                 change: Optional[Callable[[SamplingSpec], SamplingSpec]] = None) -> GenerationOutput:
        """The completions of ``batch`` in one engine call, each prompt's spec changed by ``change`` (the
        ``Generate`` an algorithm's own rollout calls: ReMax's greedy one)."""
        specs = self.specs(batch)
        return self.engine.generate([row.prompt_ids for row in batch], [change(s) for s in specs] if change else specs)

    def rollout(self, batch: Sequence[PromptRow], seed: Optional[int] = None) -> GenerationOutput:
        prompts = [row.prompt_ids for row in batch]
        specs = self.specs(batch, seed)
        vision = [row.vision for row in batch] if any(row.vision is not None for row in batch) else None
        if self.max_batch_tokens is None or len(batch) < 2:
            return self.engine.generate(prompts, specs, **_images(vision, range(len(batch))))
        n = max(s.n for s in specs)  # each prompt occupies n sequences
        plan = rollout_buckets([len(p) for p in prompts], [s.max_tokens for s in specs],
                               max(1, (self.max_num_seqs or len(batch) * n) // n),
                               max(1, self.max_batch_tokens // n))
        parts = []
        for wave in plan:
            members = [int(i) for i in wave]
            out = self.engine.generate([prompts[i] for i in members], [specs[i] for i in members],
                                       **_images(vision, members))
            parts.append((out, members))
        pad = self.engine.pad_token_id
        return merge_outputs(parts, int(pad) if pad is not None else 0)

    def metrics(self) -> Dict[str, float]:
        """The latest rollout's own figures (the multi-turn operator's turns and tool calls)."""
        return {}


def _images(vision: Optional[List[Any]], members: Sequence[int]) -> Dict[str, Any]:
    """The ``vision`` keyword of an engine call over prompts ``members`` (none for text prompts: engines
    without images take every text call)."""
    return {} if vision is None else {"vision": [vision[i] for i in members]}
