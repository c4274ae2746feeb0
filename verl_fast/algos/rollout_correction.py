"""Rollout / trainer mismatch correction (``algorithm.rollout_correction``): truncated importance
weights ``w = min(exp(old_logprob - rollout_logprob), cap)`` per response token, from the rollout
engine's own log-probs of the tokens it sampled. The rollout engine (vLLM's kernels, bf16, another
batch shape) samples from a distribution slightly off the trainer's ``pi_old``; weighting each
token's policy loss by ``w`` (detached) makes the gradient that of samples drawn from ``pi_old``,
truncated at ``cap`` to bound its variance (truncated IS, as verl's rollout IS and TRL's vLLM IS
correction). ``actor_loss`` multiplies the per-token policy loss by the weights. Where the update
makes one optimiser step over the whole batch (one epoch, one mini-batch, no KL in the reward), ``pi_old``
is the policy the update's own forward computes: the trainer skips the old-log-prob pass and
``actor_loss`` takes the weights from that forward, detached. ``RolloutCorrection`` is the
policy-gradient algorithms' ``correct_rollout`` where it is on; ``engine_logprobs`` says whether the
rollout engine is asked for its log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

from verl_fast.config import Config
from verl_fast.records.experience import Experience
from verl_fast.ops.masked import masked_mean


def engine_logprobs(cfg: Config) -> bool:
    """Whether the rollout engine returns its log-probs of its samples (``SamplingSpec.logprobs``): only
    where the correction reads them (the trainer recomputes them with the actor, and asking vLLM for
    them costs a top-k per sampled token; on vLLM-CPU a torch.compile in the first step, ~2 s)."""
    return cfg.algorithm.rollout_correction


@dataclass(frozen=True)
class RolloutCorrection:
    """``algorithm.rollout_correction`` with its ``rollout_correction_cap``."""

    cap: float

    def weigh(self, exp: Experience, metrics: Dict[str, Any], engine: str) -> None:
        """``exp.rollout_is_weights`` from its old log-probs and the log-probs of the rollout engine
        named ``engine``; their spread as ``rollout_correction/*`` in ``metrics``. Without old
        log-probs (the update's forward is ``pi_old``), nothing yet: ``actor_loss`` weighs each
        micro-batch and the update reports the spread."""
        if exp.rollout_logprobs is None:
            raise ValueError(f"algorithm.rollout_correction needs the rollout engine's log-probs of its samples; "
                             f"{engine} returned none (a RolloutOperator's generation kwargs may have turned "
                             "SamplingSpec.logprobs off)")
        if exp.old_logprobs is None:
            return
        exp.rollout_is_weights, stats = truncated_is_weights(exp.old_logprobs, exp.rollout_logprobs,
                                                             exp.response_mask, self.cap)
        metrics.update({f"rollout_correction/{k}": float(v) for k, v in stats.items()})


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                         cap: float) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Weights ``[N, L]`` (0 off the mask, no gradient) and their spread over the response tokens, as
    0-d tensors (nothing read back: the update calls this per micro-batch): ``is_weight_mean``,
    ``is_weight_max``, ``is_capped_fraction`` (tokens whose weight hit ``cap``), ``mismatch_kl`` (the
    mean of ``rollout - old``: a k1 estimate of KL(rollout || old))."""
    if cap <= 0:
        raise ValueError(f"rollout_correction_cap must be > 0, got {cap}")
    if rollout_logprobs.shape != old_logprobs.shape:
        raise ValueError(f"rollout_logprobs {tuple(rollout_logprobs.shape)} and old_logprobs "
                         f"{tuple(old_logprobs.shape)} must have the same shape [N, L]")
    mask = response_mask.to(torch.float32)
    log_ratio = (old_logprobs.float() - rollout_logprobs.float()).detach()
    raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))  # exp() of a large log-ratio overflows
    weights = torch.clamp(raw, max=cap) * mask
    stats = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_weight_max": weights.max() if weights.numel() else weights.new_zeros(()),  # >= 0, 0 off the mask
        "is_capped_fraction": masked_mean((raw >= cap).float(), mask),
        "mismatch_kl": masked_mean(-log_ratio, mask),
    }
    return weights, stats
