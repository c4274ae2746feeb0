"""What RLTrainer asks of a training strategy: one implementation per backend, chosen once from
``actor.strategy`` when the trainer is built (``backends.build``).

- ``fsdp_strategy.FSDPStrategy`` (``fsdp2``, ``fsdp1``, ``none``; ``auto``): the Hugging Face actor,
  reference and critic trained by torch, laid out as ``sharding.py`` says.
- ``megatron/strategy.MegatronStrategy`` (``megatron``): a Megatron-core copy of the actor (and of a
  PPO critic with ``critic.strategy: megatron``) trains; the Hugging Face actor rolls out.

The trainer cuts micro-batches (index tensors into the step's ``Experience``) and the strategy runs
them: forward passes without gradients (log-probs, values), and one training entry for every loss
(policy gradient, the critic's, SFT's, DPO's pairs): ``forward_backward(exp, micro, loss_fn)``
accumulates the gradient of the micro-batches' losses, ``optimizer_step()`` clips it, steps and zeroes
it (one ``forward_backward`` per step: megatron-core reduces the gradient at the end of its pass).
What a backend can do is said by flags (``uneven_micro_batches``, ``packs_sequences``,
``budgets_tokens``), never by its name. The strategy also says what a rollout engine syncs its
weights from, prepares the engine it rolls out with, and writes / restores its checkpoints (model and
optimizer state, sharded as it trains). Offloading belongs to it too: FSDP's ``cpu_offload`` shards,
the Megatron strategy's release of the Hugging Face actor's weights when vLLM holds its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Tuple

import torch

from verl_fast.records.experience import Experience
from verl_fast.rollout.base import RolloutEngine

# loss_fn(*outputs [n, L] of the micro-batch, micro-batch) -> (loss, stats): the actor's outputs are
# (log-probs, entropy), the critic's (values,)
LossFn = Callable[..., Tuple[torch.Tensor, Dict[str, float]]]


class Critic(Protocol):
    """A PPO critic under one backend."""

    optimizer: Any  # the trainer sets its rate each step (critic.lr_scheduler)

    def values(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        """[N, L] float32 values of the response positions (no gradient)."""

    def forward_backward(self, exp: Experience, micro: List[torch.Tensor], loss_fn: LossFn) -> List[Dict[str, Any]]:
        """The gradient of ``loss_fn(values, sub)`` over ``micro``, accumulated; each micro-batch's statistics."""

    def optimizer_step(self) -> float:
        """Clips, steps and zeroes the accumulated gradient; its norm."""


class Strategy(Protocol):
    device: torch.device  # where the step's tensors live
    dp_rank: int
    dp_size: int
    dp_group: Any  # the data-parallel ranks (None with one)
    actor: torch.nn.Module  # the Hugging Face actor: HF generate runs on it
    ref: Optional[torch.nn.Module]  # the frozen reference copy, laid out as the actor (None: none kept)
    has_reference: bool  # ref_logprobs serves (a copy, or a LoRA actor's base with its adapters disabled)
    critic: Optional[Critic]
    optimizer: Any  # the actor's
    autocast_dtype: Optional[torch.dtype]  # actor.autocast (None: none)
    uneven_micro_batches: bool  # ranks may run different numbers of forward / backward passes (one process)
    packs_sequences: bool  # log-prob and training passes run the rows without padding (token budgets count real tokens)
    budgets_tokens: bool  # micro-batches may be cut by a token budget (actor.use_dynamic_bsz), not only by rows
    hf_decode_by_default: bool  # rollout.type auto may decode with ``actor`` itself (not a copy exported into)

    def autocast(self) -> ContextManager[Any]:
        """The forward passes' autocast (``actor.autocast``), also around generation."""

    # start-up, before any model loads (static methods; the CLI calls them through backends.strategy_class):
    # check_machine(cfg) refuses a machine the backend cannot train on; check_fits(cfg,
    # needs_reference, device) refuses a run that cannot fit; planned(cfg, device) -> what auto keys resolve to

    def resolved(self) -> Dict[str, Any]:
        """The actor's settings as this strategy resolved their auto / null values (config key -> value),
        printed once at start-up."""

    def actor_logprobs(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        """[N, L] float32 log-probs of the response tokens under the actor (no gradient)."""

    def ref_logprobs(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        """The same under the reference."""

    def forward_backward(self, exp: Experience, micro: List[torch.Tensor], loss_fn: LossFn,
                         entropy: bool = True) -> Tuple[List[Dict[str, Any]], Tuple[float, float]]:
        """The actor's gradient of ``loss_fn(logp, entropy, sub)`` over ``micro``, accumulated: each
        micro-batch's statistics (tensors or floats), and (tokens, causal query-key pairs) the passes
        ran (the update's FLOP count: a shared prompt once, no padding). ``entropy=False``: a loss that
        reads no entropy (SFT, the preference losses) gets None, where computing it is extra work."""

    def optimizer_step(self) -> float:
        """Clips, steps and zeroes the actor's accumulated gradient; its norm."""

    def weight_source(self, owns_weights: bool) -> Any:
        """What a rollout engine syncs from: ``owns_weights``, an engine holding its own copy (vLLM)."""

    def rollout_engine(self, engine: RolloutEngine) -> RolloutEngine:
        """``engine`` as this strategy rolls out with it (built by the trainer or given)."""

    def actor_updated(self, engine_owns_weights: bool) -> None:
        """After each actor update: what the rollout reads is made current (before the weight sync)."""

    def save(self, output_dir: str, step: int, tokenizer: Any, state: Dict[str, Any], export_hf: bool) -> None:
        """A checkpoint of step ``step`` (collective); ``state``: the trainer's own (history, RNG)."""

    def load(self, path: Path) -> Dict[str, Any]:
        """Restores the checkpoint folder ``path``; returns the trainer state saved with it."""
