"""What an asynchronous rollout hands the trainer, and the figures it keeps.

``Sampled``: one step's generation, the step it is for, and the policy version (optimiser steps
applied) that sampled each token (``versions [N, L]``, -1 off the response mask). A sample whose
tokens carry several versions is a partial rollout's; otherwise every token of a sequence has one.
``AsyncStats``: per training step, the staleness histogram (share of response tokens per
``trainer version - token version``), the time the trainer waited for samples and the time the
rollout side had nothing to do, over the wall time between two steps' takes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from verl_fast.records.generation import GenerationOutput, pad_completions


@dataclass
class Sampled:
    step: int  # the training step these samples are for
    gen: GenerationOutput
    versions: torch.Tensor  # [N, L] int64: the version that sampled each response token (-1 off the mask)
    gen_seconds: float = 0.0  # wall time of the generation

    @staticmethod
    def of_one_version(step: int, gen: GenerationOutput, version: int, gen_seconds: float = 0.0) -> "Sampled":
        versions = torch.where(gen.response_mask.bool(), torch.full_like(gen.response_ids, version),
                               torch.full_like(gen.response_ids, -1))
        return Sampled(step, gen, versions, gen_seconds)

    def oldest(self) -> int:
        on = self.versions[self.gen.response_mask.bool()]
        return int(on.min()) if on.numel() else -1

    def to_state(self) -> Dict[str, Any]:
        """JSON-safe and exact (float32 log-probs round-trip through Python floats)."""
        g, mask = self.gen, self.gen.response_mask.bool()
        rows = range(g.num_sequences)
        return {"step": self.step, "gen_seconds": self.gen_seconds,
                "prompt_index": g.prompt_index.tolist(), "texts": list(g.texts),
                "finish_reasons": list(g.finish_reasons),
                "tokens": [g.response_ids[i][mask[i]].tolist() for i in rows],
                "logprobs": None if g.logprobs is None else [g.logprobs[i][mask[i]].tolist() for i in rows],
                "versions": [self.versions[i][mask[i]].tolist() for i in rows]}

    @staticmethod
    def from_state(state: Dict[str, Any], pad_id: int) -> "Sampled":
        gen = pad_completions(state["tokens"], state["logprobs"], state["prompt_index"], pad_id,
                              state["texts"], state["finish_reasons"])
        versions = torch.full_like(gen.response_ids, -1)
        for i, v in enumerate(state["versions"]):
            versions[i, : len(v)] = torch.as_tensor(v, dtype=torch.int64)
        return Sampled(int(state["step"]), gen, versions, float(state["gen_seconds"]))


def staleness_figures(sampled: Sampled, version: int) -> Dict[str, float]:
    """``async/staleness/*``: mean, max and the histogram (share of response tokens at each staleness)
    of ``version - token version`` over the response tokens."""
    on = sampled.gen.response_mask.bool()
    stale = (version - sampled.versions[on]).to(torch.int64)
    if not stale.numel():
        return {"async/staleness_mean": 0.0, "async/staleness_max": 0.0}
    out = {"async/staleness_mean": float(stale.double().mean()), "async/staleness_max": float(stale.max())}
    counts = torch.bincount(stale.clamp(min=0))
    for k, c in enumerate(counts.tolist()):
        if c:
            out[f"async/staleness_hist/{k}"] = c / stale.numel()
    out["async/mixed_version_sequences"] = float(sum(
        int(sampled.versions[i][on[i]].unique().numel() > 1) for i in range(on.shape[0])))
    return out


class AsyncStats:
    """Idle and overlap fractions between two takes (one training step's wall time)."""

    def __init__(self) -> None:
        self._last: Optional[float] = None

    def step_figures(self, waited: float, rollout_busy: float, gen_seconds: float, queue_depth: int) -> Dict[str, float]:
        """``waited``: the trainer's wait for this step's samples; ``rollout_busy``: seconds the rollout
        side generated since the last take; ``gen_seconds``: the generation time of these samples."""
        now = time.perf_counter()
        out = {"async/queue_depth": float(queue_depth), "time/async_wait": waited, "time/async_generation": gen_seconds}
        if gen_seconds > 0:  # the share of the generation that ran while the trainer worked
            out["async/overlap_fraction"] = max(0.0, min(1.0, 1.0 - waited / gen_seconds))
        if self._last is not None:
            span = max(now - self._last, 1e-9)
            out["async/trainer_idle_fraction"] = min(1.0, waited / span)
            out["async/rollout_idle_fraction"] = max(0.0, 1.0 - rollout_busy / span)
        self._last = now
        return out


def check_staleness(sampled: Sampled, version: int, max_staleness: int) -> None:
    """Raises when any token of ``sampled`` is more than ``max_staleness`` versions old (a bug: the
    producers never hand out such samples)."""
    oldest = sampled.oldest()
    if oldest >= 0 and version - oldest > max_staleness:
        raise RuntimeError(f"samples for step {sampled.step} hold tokens of version {oldest}, "
                           f"{version - oldest} versions old (trainer.max_staleness={max_staleness})")

