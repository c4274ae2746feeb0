"""RolloutOperator: turns a batch of prompts into completions through an engine, with per-batch
(and per-prompt) sampling chosen by an overridable ``get_generation_kwargs``."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from verl_fast.data import PromptRow
from verl_fast.rollout.base import GenerationOutput, RolloutEngine, SamplingSpec


class RolloutOperator:
    """Subclass and override ``get_generation_kwargs`` to sample differently per batch, e.g.::

        class Mixed(RolloutOperator):
            def get_generation_kwargs(self, batch):
                return [{"temperature": 0.0} if row.data_source == "exact" else {} for row in batch]

    It returns one dict for the whole batch or one per prompt; keys are SamplingSpec's fields
    (HF's ``max_new_tokens``, ``num_return_sequences``, ``do_sample`` are accepted too) and
    override the defaults (``generation_config``) for that call only.
    """

    def __init__(self, engine: RolloutEngine, default: Union[SamplingSpec, Dict[str, Any], None] = None):
        self.engine = engine
        if isinstance(default, SamplingSpec):
            self.default = default
        else:
            self.default = SamplingSpec.from_kwargs(SamplingSpec(), dict(default or {}))

    def get_generation_kwargs(self, batch: Sequence[PromptRow]) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        return {}

    def specs(self, batch: Sequence[PromptRow], seed: Optional[int] = None) -> List[SamplingSpec]:
        kwargs = self.get_generation_kwargs(batch)
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

    def rollout(self, batch: Sequence[PromptRow], seed: Optional[int] = None) -> GenerationOutput:
        return self.engine.generate([row.prompt_ids for row in batch], self.specs(batch, seed))
