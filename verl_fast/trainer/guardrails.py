"""Guardrails against silent failure (``guardrails`` config section; docs/faults.md#guardrails): checks the
trainer runs on every step, each a ``guardrails/*`` metric and a one-line warning or a refusal that stops
the run.

- The weight sync: the rollout engine's log-probs of the tokens it sampled against the actor's, at every
  rollout (so at the first after each sync), at no extra pass: the actor's are the step's old log-probs
  where it computes them, else the update's own forward (which is then the policy before the update:
  one optimiser step per batch), measured in the actor's loss and checked before the optimiser step. Past the tolerance the run stops, naming the parameter groups whose
  engine copy differs from the actor (``RolloutEngine.weight_differences``): an adapter the engine ignored,
  a stale or partial sync, a wrong dtype or layout.
- The samples' signal: heavy truncation for several steps, prompt groups whose samples all score the
  same, the same reward for the whole batch; a batch no reward function applied to (every score None) is
  refused, since it would train on 0.0.
- The update: an optimiser step skipped for a NaN / inf gradient is named (step, mini-batch, the
  non-finite loss terms); too many in a row stop the run.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from verl_fast import distributed
from verl_fast.config import GuardrailsConfig
from verl_fast.errors import UserError
from verl_fast.records.experience import Experience

logger = logging.getLogger(__name__)


class GuardrailStop(UserError):
    """A guardrail stopped the run (one line naming what it found)."""


class Streak:
    """Counts the steps in a row a condition held; ``hit`` is true once, on the step the count reaches
    ``steps`` (a warning per streak, not per step)."""

    def __init__(self, steps: int):
        self.steps, self.count = steps, 0

    def update(self, held: bool) -> bool:
        self.count = self.count + 1 if held else 0
        return self.count == self.steps


def flat_group_fraction(scores: torch.Tensor, prompt_index: torch.Tensor) -> float:
    """The share of prompt groups (samples of one prompt, ``prompt_index [N]``) of two or more samples
    whose ``scores [N]`` are all equal; 0 with no such group (a few tensor ops, no loop over groups)."""
    _, group, counts = torch.unique(prompt_index, return_inverse=True, return_counts=True)
    s = scores.float()
    hi = torch.full(counts.shape, float("-inf")).scatter_reduce(0, group, s, "amax")
    lo = torch.full(counts.shape, float("inf")).scatter_reduce(0, group, s, "amin")
    several = counts > 1
    counted = int(several.sum())
    return float(((hi == lo) & several).sum()) / counted if counted else 0.0


def _timed(method):
    """The check's seconds added to its ``Guardrails``' ``seconds`` (the step's ``perf/guardrails_s``)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
    return timed


class Guardrails:
    """One trainer's guardrails (module docstring); ``group``: the data-parallel ranks, whose figures a
    stopping check agrees on (every rank stops together)."""

    def __init__(self, cfg: GuardrailsConfig, is_main: bool, group: Any = None):
        self.cfg, self.is_main, self.group = cfg, is_main, group
        self.truncated = Streak(cfg.truncation_steps)
        self.flat_groups = Streak(cfg.flat_groups_steps)
        self.constant = Streak(cfg.flat_groups_steps)
        self.nonfinite_in_a_row = 0
        self._warned_no_logprobs = False
        self.seconds = 0.0  # spent in the checks since the last ``take_seconds``

    def take_seconds(self) -> float:
        """The seconds the checks took since the last call (the trainer's phases synchronise the device
        around them, so their device work is inside)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _warn(self, message: str) -> None:
        if self.is_main:
            logger.warning("guardrail: %s", message)

    def _sum(self, values: Sequence[float]) -> List[float]:
        values = [float(v) for v in values]
        if distributed.world_size() > 1:
            return distributed.all_reduce_numbers(values, group=self.group)
        return values

    # ---- the samples' signal

    @_timed
    def after_rewards(self, step: int, exp: Experience, truncated: float, not_applicable: int,
                      metrics: Dict[str, Any]) -> None:
        """Step ``step``'s scored samples (``exp.scores``, ``exp.prompt_index``), the share cut at
        max_new_tokens, and how many samples no reward function applied to (scored None by all)."""
        c = self.cfg
        scores = exp.scores.detach().float().cpu()
        count, unscored = self._sum([scores.numel(), not_applicable])
        if count and unscored == count:
            message = (f"step {step}: every reward function answered None (not applicable) for all {int(count)} "
                       "samples of the batch, which would train on 0.0; check reward_fn against the data's "
                       "data_source / ground truth (guardrails.all_none_rewards=warn trains on anyway)")
            if c.all_none_rewards == "error":
                raise GuardrailStop(message)
            self._warn(message)
        flat = flat_group_fraction(scores, exp.prompt_index.cpu())
        constant = float(scores.numel() > 1 and bool((scores == scores[0]).all()))
        metrics.update({"guardrails/flat_groups": flat, "guardrails/constant_rewards": constant,
                        "guardrails/not_applicable": float(not_applicable)})
        if self.truncated.update(truncated > c.truncation_threshold):
            self._warn(f"step {step}: response/truncated above {c.truncation_threshold} for {c.truncation_steps} "
                       f"steps in a row ({truncated:.2f} now): responses cut at rollout.max_new_tokens score what "
                       "a cut answer scores; raise max_new_tokens or reward brevity")
        if self.flat_groups.update(flat > c.flat_groups_threshold):
            self._warn(f"step {step}: {flat:.0%} of the prompt groups scored every sample the same for "
                       f"{c.flat_groups_steps} steps in a row: no advantage, no gradient from them (too easy or "
                       "too hard prompts, or a reward that cannot tell samples apart)")
        if self.constant.update(bool(constant)):
            self._warn(f"step {step}: every sample of the batch scored {float(scores[0]):g} for "
                       f"{c.flat_groups_steps} steps in a row: the reward gives no signal (is it reading the "
                       "response?)")

    # ---- the weight sync

    @_timed
    def sync_gap(self, exp: Experience) -> Optional[float]:
        """The mean |engine - actor| log-prob per response token of ``exp`` from its old log-probs (every
        rank's tokens), or None where the step has none (the update's forward then measures it:
        ``algos.policy_losses``'  ``guardrails/sync_logprob_diff``) or the engine returned none."""
        if exp.rollout_logprobs is None:
            if not self._warned_no_logprobs:
                self._warn("the rollout engine returned no log-probs of its samples: the weight sync is not checked")
                self._warned_no_logprobs = True
            return None
        if exp.old_logprobs is None:
            return None
        mask = exp.response_mask.float()
        gap = ((exp.old_logprobs.float() - exp.rollout_logprobs.float()).abs() * mask).sum()
        total, tokens = self._sum([gap, mask.sum()])
        return total / max(tokens, 1.0)

    @_timed
    def check_sync(self, step: int, diff: Optional[float], differences: Callable[[], Optional[List[str]]],
                   metrics: Dict[str, Any]) -> None:
        """Past ``sync_logprob_tolerance``, stops naming ``differences()`` (the parameter groups whose engine
        copy differs from the actor's; None: the engine cannot tell). ``diff`` None: nothing measured."""
        c = self.cfg
        if not c.sync_check or diff is None:
            return
        metrics["guardrails/sync_logprob_diff"] = diff
        if diff <= c.sync_logprob_tolerance:
            return
        groups = differences()
        named = ("the engine cannot name the parameters that differ" if groups is None else
                 "no engine weight differs from the actor's (a sampling or log-prob mismatch)" if not groups else
                 f"the parameter groups that differ: {', '.join(groups[:8])}" +
                 (f" (and {len(groups) - 8} more)" if len(groups) > 8 else ""))
        raise GuardrailStop(f"step {step}: the rollout engine's log-probs of its samples differ from the actor's by "
                            f"{diff:.3f} per token (guardrails.sync_logprob_tolerance={c.sync_logprob_tolerance}): "
                            f"it does not sample from the policy being trained; {named}")

    # ---- the update

    @_timed
    def after_update(self, step: int, skipped: List[str], metrics: Dict[str, Any]) -> None:
        """``skipped``: one line per optimiser step of this update skipped for a non-finite gradient."""
        for line in skipped:
            self._warn(f"step {step}: {line}")
        metrics["guardrails/skipped_steps"] = float(len(skipped))
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        limit = self.cfg.max_nonfinite_steps
        if limit and self.nonfinite_in_a_row >= limit:
            raise GuardrailStop(f"step {step}: {self.nonfinite_in_a_row} steps in a row had a NaN / inf gradient "
                                f"(guardrails.max_nonfinite_steps={limit}); the last: {skipped[-1]}")


def nonfinite_step(index: int, count: int, norm: float, stats: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The line naming optimiser step ``index`` of ``count`` when its gradient norm is not finite (the
    strategies skip such a step), with the loss terms that were not finite; None when it is finite."""
    if math.isfinite(norm):
        return None
    bad = sorted({k for st in stats for k, v in st.items() if not math.isfinite(float(v))})
    terms = f"non-finite: {', '.join(bad)}" if bad else "the loss terms finite: a gradient overflowed"
    return (f"actor mini-batch {index + 1} of {count}: gradient norm {norm} ({terms}); the optimiser step was "
            "skipped, the weights unchanged")
