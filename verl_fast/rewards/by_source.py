"""``reward_fn.type: auto`` (the default): each row scored by the scorer its ``data_source`` names,
as verl's default ``compute_score`` routes them, plus reasoning-gym's rows (``reasoning_gym/<task>``,
what ``trainer.dataset: reasoning_gym:<task>`` writes). A data source with no scorer here is an
error that names it, raised on the dataset's first rows before any model loads (``preflight``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from verl_fast.rewards import verl_scores
from verl_fast.rewards.interface import RewardFunction, RewardInput
from verl_fast.rewards.rule import ReasoningGymReward

Score = Union[float, Dict[str, float]]

# data_source -> scorer (solution, ground_truth) -> score, as verl routes them
SCORERS: Dict[str, Callable[[str, Any], Score]] = {
    "openai/gsm8k": verl_scores.gsm8k_strict,
    **{name: verl_scores.math_boxed for name in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                                 "HuggingFaceH4/MATH-500")},
    **{name: verl_scores.math_dapo for name in ("math_dapo", "math", "math_dapo_reasoning")},
    "hiyouga/geometry3k": verl_scores.geo3k,
    **{f"searchR1_{name}": verl_scores.search_r1_em for name in ("nq", "triviaqa", "popqa", "hotpotqa",
                                                                "2wikimultihopqa", "musique", "bamboogle")},
}
PREFIXES: Dict[str, Callable[[str, Any], Score]] = {"aime": verl_scores.math_dapo}  # aime24, aime2025, ...
REASONING_GYM = "reasoning_gym/"
# what verl scores with code or packages that are not built in here (a sandbox, prime's grader, mathruler)
NOT_HERE = {
    **{name: "prime_math's sympy grader" for name in ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime",
                                                      "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads")},
    **{name: "a code sandbox" for name in ("codecontests", "apps", "codeforces", "taco")},
}


def scorer_of(data_source: str) -> Optional[Callable[[str, Any], Score]]:
    """The scorer verl routes ``data_source`` to, or None."""
    if data_source in SCORERS:
        return SCORERS[data_source]
    return next((fn for prefix, fn in PREFIXES.items() if data_source.startswith(prefix)), None)


def check_source(data_source: str, where: str) -> None:
    """Raises one line naming ``data_source`` (found at ``where``) when no scorer here takes it."""
    if data_source.startswith(REASONING_GYM) or scorer_of(data_source) is not None:
        return
    fix = ("set a reward: reward_fn.type=callable with reward_fn.path=file.py:function (verl: "
           "custom_reward_function.path / .name), or reward_fn.type=gsm8k / reasoning_gym / reward_model")
    if data_source in NOT_HERE:
        raise ValueError(f"{where}: data_source {data_source!r} is scored in verl with {NOT_HERE[data_source]}, "
                         f"which is not built in here; {fix}")
    known = sorted(SCORERS) + [f"{p}*" for p in PREFIXES] + [f"{REASONING_GYM}<task>"]
    raise ValueError(f"{where}: data_source {data_source!r} has no built-in scorer (reward_fn.type=auto routes "
                     f"{', '.join(known)}); {fix}")


class DataSourceReward(RewardFunction):
    """Scores each sample with the scorer of its ``data_source`` (module docstring); dict scores
    (math_dapo's ``acc``) keep their extra keys for the metrics, as a callable reward's do."""

    name = "data_source"

    def __init__(self) -> None:
        self._gym: Optional[ReasoningGymReward] = None
        self.last_extras: Dict[str, List[float]] = {}

    def __call__(self, samples: Sequence[RewardInput]) -> List[Score]:
        self.last_extras = {}
        out: List[Score] = []
        for i, s in enumerate(samples):
            check_source(s.data_source, f"sample {i}")
            if s.data_source.startswith(REASONING_GYM):
                self._gym = self._gym or ReasoningGymReward()
                out.append(self._gym([s])[0])
                continue
            score = scorer_of(s.data_source)(s.response, s.ground_truth)
            if isinstance(score, dict):
                for k, v in score.items():
                    if k != "score":
                        self.last_extras.setdefault(k, []).append(float(v))
            out.append(score)
        return out
