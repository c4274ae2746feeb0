"""What RLTrainer asks of an algorithm, phase by phase. Each algorithm is one module of this package
(``registry.py`` maps ``algorithm.type`` to it); the trainer never tests an algorithm's name.

A step is one of two sequences of phases (``Step``), which the algorithm names:

- ``POLICY_GRADIENT``: generation (plus the algorithm's ``extra_rollout``: ReMax's greedy one) ->
  reward (and the ``reward_baselines`` an extra rollout gives) -> ``select_experience`` (the rows the
  update trains on: DAPO's dynamic sampling drops groups by their scores and tops them up from more
  prompts) -> old / reference log-probs and critic values -> ``correct_rollout`` (the rollout
  correction's weights, from the old log-probs) -> ``shape_rewards`` (KL in the reward) ->
  ``advantages`` (the algorithm's estimator and its whitening scope) -> actor update with
  ``actor_loss`` (and the critic's with ``critic_loss``) -> weight sync. Where ``scores_decide_rows``
  is false, the model passes may run while the reward scores. ``algos/policy_gradient.py`` implements these phases once for
  every estimator; a module adds its estimator call and what sets it apart.
- ``PREFERENCE``: chosen / rejected pairs (``pairs``: the dataset's, or sampled and ranked by the
  reward) -> ``update`` (the DPO loss) -> weight sync.
- ``SUPERVISED``: the dataset's rows as one ``Experience`` (``experience``) -> one actor update with
  ``loss`` through the strategy's ``forward_backward`` (``trainer/supervised.py``); validation is the
  validation set's loss.

Start-up: ``check`` refuses the combinations the algorithm cannot run (config validation);
``configure`` adjusts the run once the number of data-parallel ranks is known.

New policy losses go to ``algos/policy_losses.py`` (a function under ``@register_policy_loss``), new estimators are new
modules, new DPO losses to ``preference_losses.py`` (a function under ``@register_dpo_loss``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from verl_fast.config import Config
from verl_fast.data import RLDataProcessor
from verl_fast.records.prompts import PreferencePair, PromptRow
from verl_fast.records.experience import Experience
from verl_fast.records.generation import Generate, GenerationOutput

# score(batch, generation) -> [N] rewards of the generated samples
Score = Callable[[Sequence[PromptRow], GenerationOutput], torch.Tensor]
Stats = Dict[str, float]  # a loss's statistics, at the scale of a whole batch


@dataclass(frozen=True)
class MorePrompts:
    """What ``select_experience`` may draw on to top up a step's experience."""

    items: Sequence[PromptRow]  # the prompts fit() trains on (empty outside fit)
    step: int  # the trainer's step (0-based: the one being made)
    # scored_rollout(prompts) -> their experience, generated and scored as the step's own batch
    scored_rollout: Callable[[Sequence[PromptRow]], Experience]


class Step(enum.Enum):
    POLICY_GRADIENT = "policy_gradient"
    PREFERENCE = "preference"
    SUPERVISED = "supervised"


class Algorithm(Protocol):
    """What every algorithm declares. Built once per run from the config (``registry.build``)."""

    name: str
    step: Step
    item_type: type  # what the dataset's rows become: PromptRow, or PreferencePair
    samples: bool  # whether it generates (a rollout engine is built)
    needs_critic: bool
    needs_reference: bool

    def configure(self, world: int) -> None:
        """Start-up once the number of data-parallel ranks is known (may refuse, or size the batch)."""

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[Any]:
        """The dataset's rows as this algorithm's items."""


class PolicyGradientAlgorithm(Algorithm, Protocol):
    """The phases of a ``POLICY_GRADIENT`` step (module docstring)."""

    #: samples whose advantage is 0 everywhere add nothing to the gradient of ``actor_loss``
    zero_advantage_is_idle: bool
    #: ``select_experience`` chooses rows by their scores (the model passes then wait for the reward)
    scores_decide_rows: bool

    def extra_rollout(self, generate: Generate, batch: Sequence[PromptRow]) -> Optional[GenerationOutput]:
        ...

    def reward_baselines(self, batch: Sequence[PromptRow], extra: Optional[GenerationOutput], score: Score,
                         exp: Experience, metrics: Dict[str, Any]) -> Optional[torch.Tensor]:
        ...

    def select_experience(self, exp: Experience, more: MorePrompts, metrics: Dict[str, Any]) -> Experience:
        ...

    def needs_old_logprobs(self, exp: Experience) -> bool:
        ...

    def correct_rollout(self, exp: Experience, metrics: Dict[str, Any], engine: str) -> None:
        """``engine``: the rollout engine's name, for the error where it gave no log-probs."""

    def shape_rewards(self, exp: Experience, metrics: Dict[str, Any]) -> None:
        ...

    def advantages(self, exp: Experience, baselines: Optional[torch.Tensor],
                   group: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        ...

    def actor_loss(self, logp: torch.Tensor, entropy: torch.Tensor, sub: Experience,
                   counts: Dict[str, float]) -> Tuple[torch.Tensor, Stats]:
        ...

    def critic_loss(self, values: torch.Tensor, sub: Experience, counts: Dict[str, float],
                    num_sequences: int) -> Tuple[torch.Tensor, Stats]:
        ...


class PreferenceAlgorithm(Algorithm, Protocol):
    """The phases of a ``PREFERENCE`` step (module docstring)."""

    def pairs(self, batch: Sequence[Any], generate: Callable[[Sequence[PromptRow]], GenerationOutput],
              score: Score, metrics: Dict[str, Any]) -> List[PreferencePair]:
        ...

    def update(self, updates: Any, pairs: List[PreferencePair], pad_id: int) -> Dict[str, float]:
        """One optimiser step on ``pairs`` through ``updates`` (``trainer/updates.Updates``: its
        ``strategy`` and ``step``); the statistics and ``actor/grad_norm``."""


class SupervisedAlgorithm(Algorithm, Protocol):
    """The pieces of a ``SUPERVISED`` step (module docstring)."""

    def experience(self, batch: Sequence[Any], pad_id: int, device: torch.device) -> Experience:
        ...

    def loss(self, logp: torch.Tensor, sub: Experience, counts: Dict[str, float]) -> Tuple[torch.Tensor, Stats]:
        ...


def refuse_pairwise_ranking(cfg: Config, hint: str = "") -> None:
    """The check of every algorithm that scores its own samples: pairwise_ranking is DPO's reward."""
    if cfg.reward_fn.type == "pairwise_ranking":
        raise ValueError(f"reward_fn.type=pairwise_ranking is not supported with algorithm.type={cfg.algorithm.type}; "
                         "use algorithm.type=dpo" + hint)


def kl_reference(cfg: Config) -> bool:
    """Whether a KL term (in the loss or in the reward) reads a reference model's log-probs."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
