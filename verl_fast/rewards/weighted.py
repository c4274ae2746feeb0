"""Several reward functions as one: each named, weighted and guarded on its own, their weighted sum
the sample's reward (TRL's ``reward_funcs`` / ``reward_weights``). A score of None (NaN here) is "not
applicable": the sum leaves it out, as TRL's nansum does (a sample no function applies to scores 0)."""

from __future__ import annotations

import math
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from verl_fast.rewards.interface import GuardedReward, RewardFunction, RewardInput
from verl_fast.rewards.model import RewardModel


class WeightedRewards(RewardFunction):
    """``parts``: (name, weight, guarded reward). A call scores the batch with each reward in turn
    (each under its own ``on_error`` and ``timeout_s``) and returns ``sum_i weight_i * score_i`` per
    sample, NaN terms (None: not applicable) left out. ``last_metrics`` holds the latest call's ``reward/<name>/mean`` (unweighted, when
    there are several rewards) and ``reward/<name>/<key>`` for each extra numeric key a reward's
    dict results held; ``last_errors`` the samples zeroed by ``on_error: zero``, over all rewards."""

    def __init__(self, parts: Sequence[Tuple[str, float, GuardedReward]]):
        if not parts:
            raise ValueError("reward_fn: at least one reward function is needed")
        names = [name for name, _, _ in parts]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"reward_fn: the reward functions' names must differ (they name the metrics "
                             f"reward/<name>/mean), got {twice[0]!r} more than once; set each one's name")
        self.parts = list(parts)
        self.name = "+".join(names)
        self.last_errors = 0
        self.last_not_applicable = 0  # the latest call's samples no function applied to (each scored 0.0)
        self.last_metrics: Dict[str, float] = {}

    @property
    def scores_off_the_main_thread(self) -> bool:
        """Every part scores in a worker thread already (``timeout_s`` set: ``rewards.deadline``) and
        none is a reward model (GPU work that would only queue behind the trainer's own passes)."""
        return all(r.timeout_s is not None and not isinstance(r.inner, RewardModel) for _, _, r in self.parts)

    def __call__(self, samples: Sequence[RewardInput], stop: Optional[threading.Event] = None) -> List[float]:
        total = [0.0] * len(samples)
        applied_any = [False] * len(samples)
        metrics: Dict[str, float] = {}
        errors = 0
        for name, weight, reward in self.parts:
            scores = reward(samples, stop=stop)
            errors += reward.last_errors
            total = [t if math.isnan(s) else t + weight * s for t, s in zip(total, scores)]
            applied_any = [a or not math.isnan(s) for a, s in zip(applied_any, scores)]
            applied = [s for s in scores if not math.isnan(s)]
            if len(self.parts) > 1 and applied:
                metrics[f"reward/{name}/mean"] = sum(applied) / len(applied)
            metrics.update({f"reward/{name}/{k}": v for k, v in reward.last_extras.items()})
        self.last_errors, self.last_metrics = errors, metrics
        self.last_not_applicable = applied_any.count(False)
        return total
