"""The rollout interface every engine implements (``RolloutEngine``); what it takes and returns is in
``verl_fast/records/generation.py``."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from verl_fast.records.generation import GenerationOutput, SamplingSpec


class RolloutEngine:
    """What the trainer needs from an engine. Subclasses: HFGenerateEngine, VLLMInferenceEngine; a new
    engine is one module and one line of ``verl_fast/rollout/engines.py`` (``docs/add_an_engine.md``).

    The class answers for its kind before any engine exists: ``check_config`` (its combinations of
    keys), ``prepare_process`` (environment the launcher sets before libraries load), ``build`` (the
    engine from a config beside its actor), ``owns_weights`` (its memory: a copy of its own) and
    ``packages`` (the optional packages it imports). An engine then generates, takes the actor's
    weights (``sync_from``), and sleeps and wakes around the update."""

    #: the ``rollout.type`` that names this engine (the registry sets it)
    name: str = ""

    #: True when the engine holds its own copy of the weights (they must be pushed after updates).
    owns_weights: bool = False

    #: True when ``rollout.length_buckets: auto`` sends it prompts in length-bucketed waves (an engine
    #: that pads a call's batch to its longest prompt gains; one that schedules its own does not)
    waves_by_default: bool = False

    #: True when it generates for a vision-language actor from prompts with images
    takes_images: bool = False

    #: the optional packages it imports: (import name, the verl_fast extra that installs it)
    packages: Tuple[Tuple[str, str], ...] = ()

    #: the token id its completions are right-padded with (None: the tokenizer's)
    pad_token_id: Optional[int] = None

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raises ValueError (one line naming the keys) for a config this engine cannot run."""

    @classmethod
    def prepare_process(cls, cfg) -> None:
        """Sets up this process for the engine before its libraries are imported (the launcher's job,
        never a constructor's)."""

    @classmethod
    def build(cls, cfg, actor: torch.nn.Module, tokenizer, *, model_path: Optional[str] = None,
              autocast_dtype: Optional[torch.dtype] = None, source=None) -> "RolloutEngine":
        """The engine for ``cfg.rollout`` beside ``actor``, generating with its weights. ``model_path``:
        the actor's folder, where the engine may load the weights from; ``source``: what an engine that
        owns weights syncs from when not the actor itself (a strategy's own copy)."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a config: override build()")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Union[SamplingSpec, Sequence[SamplingSpec]],
    ) -> GenerationOutput:
        raise NotImplementedError

    #: True when ``generate`` is a collective call (every rank calls it the same number of times).
    collective: bool = False

    #: True when the engine takes requests one by one while it runs (``submit`` / ``step``): a
    #: multi-turn rollout then continues each trajectory as soon as its observation is in.
    streams: bool = False

    def turn_cache(self):
        """A cache of each conversation's state between a multi-turn rollout's calls, whose ``generate(keys,
        prompts, specs)`` continues the conversation cached under each key and feeds only its new tokens, and
        ``reserve(tokens)`` is told the longest conversation the rollout expects (the HF engine's
        ``rollout/kv_turns.TurnCache``). None: each call reads its prompts whole (vLLM serves them from its
        prefix cache)."""
        return None

    def sync_from(self, model: torch.nn.Module) -> Dict[str, float]:
        """Makes the engine generate with ``model``'s current weights (after every optimizer step;
        collective when the model is sharded; engines that own weights also take a Megatron actor).
        Returns ``{"bytes": ...}``: what this rank received. Engines that generate with the model
        itself have nothing to do."""
        return {"bytes": 0}

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Loads new weights in place (HF names). Engines that share the actor's weights do nothing."""

    def weight_differences(self, model: torch.nn.Module) -> Optional[List[str]]:
        """The parameter groups (modules, HF names) whose weights in the engine differ from ``model``'s
        beyond the engine's dtype: what a failed sync check names. None: this engine cannot tell."""
        return None

    def sleep(self) -> None:
        """Releases memory held for generation while training runs (where the engine can)."""

    def wake_up(self) -> None:
        """Re-acquires what ``sleep`` released, before the next rollout."""

    def metrics(self) -> dict:
        """Engine-side metrics (e.g. prefix-cache hit rate, KV-cache usage) for the trainer's metrics."""
        return {}

    def call_metrics(self) -> dict:
        """The engine's own figures since this was last read, where it keeps any (read after each call of a
        multi-turn rollout: that call's; ``metrics`` is the trainer's, per step)."""
        return {}
