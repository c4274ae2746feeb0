"""SFT (``Step.SUPERVISED``: the dataset's rows -> one actor update, ``trainer/supervised.py``; no
rollout, no reference): the negative log-likelihood of the assistant / completion tokens, token-mean
over every trained token of the step (on every rank), one optimiser step per batch.

The rows (``sft_data.py``: TRL's ``messages``, ``prompt`` / ``completion`` and ``text`` formats) become
one ``Experience``: each row's tokens before its first trained token are the "prompt", the rest the
"response", and ``advantages`` holds 1 on trained tokens, 0 on the others (a later user turn). SFT is
then the policy gradient with advantage 1 on the demonstration, and runs through the strategy's
``forward_backward`` / ``optimizer_step`` as the RL update does, micro-batched as the trainer cuts the RL update's: packed rows
without padding where the strategy packs (``models/packed.py``), LoRA, FSDP2, Megatron, the same
checkpoints. Micro-batches: a token budget (``actor.max_token_len_per_gpu``, or its auto; on a GPU by
default) or ``actor.micro_batch_size`` rows.

    verl-fast train algorithm.type=sft trainer.dataset=chat.jsonl actor.model_name=Qwen/Qwen2.5-0.5B
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from verl_fast.data import sft_data
from verl_fast.algos import dpo, pair_rows
from verl_fast.algos.algorithm import Step
from verl_fast.algos.loss_terms import agg_loss
from verl_fast.config import Config
from verl_fast.data import RLDataProcessor
from verl_fast.records.experience import Experience
from verl_fast.data.sft_data import SFTExample


class SFT:
    """The algorithm of supervised fine-tuning (module docstring)."""

    name = "sft"
    step = Step.SUPERVISED
    item_type = SFTExample
    samples = False
    needs_critic = False
    needs_reference = False

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @staticmethod
    def check(cfg: Config) -> None:
        if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            raise ValueError("actor.use_kl_loss / algorithm.use_kl_in_reward is not supported with algorithm.type=sft "
                             "(no reference model); turn them off")

    @classmethod
    def build(cls, cfg: Config) -> "SFT":
        return cls(cfg)

    def configure(self, world: int) -> None:
        dpo.warn_unused_critic(self.cfg)
        t = self.cfg.trainer
        if t.gradient_accumulation_steps:
            t.train_batch_size = (t.per_device_train_batch_size or self.cfg.actor.micro_batch_size) \
                * t.gradient_accumulation_steps * world

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[SFTExample]:
        a = self.cfg.algorithm
        return sft_data.encode(processor.tokenizer, rows, a.sft_max_length, a.sft_columns, a.sft_truncation,
                               processor.image_limits)

    def experience(self, batch: List[SFTExample], pad_id: int, device: torch.device) -> Experience:
        return experience(batch, pad_id, device)

    def loss(self, logp: torch.Tensor, sub: Experience,
             counts: Dict[str, float]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        return nll(logp, sub, counts)


def experience(batch: List[SFTExample], pad_id: int, device: torch.device) -> Experience:
    """The rows as one Experience: "prompt" the tokens before the first trained one (at least one
    token), "response" the rest, ``advantages`` [N, L] the trained tokens' 1s."""
    prompts, responses, weights = [], [], []
    for e in batch:
        first = max(1, e.loss_mask.index(1))
        prompts.append(e.ids[:first])
        responses.append(e.ids[first:])
        weights.append(e.loss_mask[first:])
    exp = pair_rows.rows_experience(prompts, responses, range(len(batch)), pad_id, device)
    adv = torch.zeros(exp.response_mask.shape, dtype=torch.float32)
    for row, w in enumerate(weights):
        adv[row, : len(w)] = torch.as_tensor(w, dtype=torch.float32)
    exp.advantages = adv.to(device)
    if any(e.vision is not None for e in batch):  # each row's images go with its tokens
        exp.vision = [e.vision for e in batch]
    return exp


def nll(logp: torch.Tensor, sub: Experience, counts: Dict[str, float]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The micro-batch's share of the step's token-mean NLL over the trained tokens (``counts``: the
    step's trained tokens over the ranks, ``loss_normalisers``)."""
    weights = sub.advantages
    loss = agg_loss(-logp, weights, "token-mean", num_tokens=counts["num_tokens"])
    # a tensor: read back once the update is queued (trainer/supervised.py), not per micro-batch
    return loss, {"loss_sum": -(logp.detach() * weights).sum()}
