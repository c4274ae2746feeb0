"""The trainer's ``SUPERVISED`` step (``algos/algorithm.py``; SFT): the batch's rows as one
``Experience`` (the algorithm's), micro-batched as the RL update's (``updates.Updates.micro``: a token
budget or ``actor.micro_batch_size`` rows) and re-planned as it is on running out of device memory
(``Updates.fitted_step``), one optimiser step through the strategy's
``forward_backward`` / ``optimizer_step`` with the algorithm's loss (token-mean over the step's trained tokens on every rank:
``batching.loss_normalisers``); and the validation set's loss (``LossValidation``)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from verl_fast import distributed
from verl_fast.trainer.batching import loss_normalisers


def update(trainer: Any, batch: List[Any]) -> Dict[str, float]:
    """One optimiser step of ``trainer``'s actor on ``batch`` (this rank's share); ``sft/loss`` (this
    rank's part of the step's token-mean NLL), ``sft/tokens`` (this rank's trained tokens), the gradient norm."""
    alg, strategy, updates = trainer.algorithm, trainer.strategy, trainer.updates
    exp = alg.experience(batch, trainer.tokenizer.pad_token_id, trainer.device)
    counts = loss_normalisers(exp.advantages, trainer.dp_group)
    strategy.actor.train()
    rows = torch.arange(exp.num_sequences, device=trainer.device)
    # re-planned once a run if its passes run out of device memory, as the RL update is
    _, stats, norm = updates.fitted_step(exp, rows, lambda logp, entropy, sub: alg.loss(logp, sub, counts),
                                         before_step=lambda micro: None, entropy=False)
    trainer.perf.count_step_tokens(exp.attention_mask)
    strategy.actor_updated(False)
    # over the step's trained tokens of every rank (num_tokens: their count / ranks), so the ranks' mean
    # that the trainer logs is the step's loss
    out = {"sft/loss": float(sum(s["loss_sum"] for s in stats)) / max(counts["num_tokens"], 1.0),
           "sft/tokens": float(exp.advantages.sum()), "actor/grad_norm": norm}
    return {**out, **updates.budget_metrics()}


class LossValidation:
    """The validation set's token-mean NLL under the current weights (no sampling), as ``val/loss``."""

    def __init__(self, trainer: Any, examples: List[Any]):
        if not examples:
            raise ValueError("the validation set (trainer.val_dataset) is empty")
        self.trainer, self.examples = trainer, examples

    def run(self, score: Any, reward: Any, seed: int) -> Tuple[Dict[str, float], List[Dict[str, Any]]]:
        t = self.trainer
        share = self.examples[t.rank :: t.world]
        # every rank runs as many rows (FSDP ranks must run the same passes): a short share is topped up
        # with copies of an example whose tokens then weigh nothing
        filler = -(-len(self.examples) // t.world) - len(share)
        exp = t.algorithm.experience(share + self.examples[:1] * filler, t.tokenizer.pad_token_id, t.device)
        if filler:
            exp.advantages[len(share):] = 0
        t.strategy.actor.eval()
        with torch.no_grad():
            logp = t.strategy.actor_logprobs(exp, t.updates.micro(exp, for_update=False))
        t.strategy.actor.train()
        total, count = float(-(logp * exp.advantages).sum()), float(exp.advantages.sum())
        if t.world > 1:
            total, count = distributed.all_reduce_numbers([total, count], group=t.dp_group)
        return {"val/loss": total / max(count, 1.0)}, []
