"""SFT (``Step.PREFERENCE``'s phases with no pairs: the dataset's rows -> ``update``; no rollout, no
reference): the negative log-likelihood of the assistant / completion tokens, token-mean over every
trained token of the step (on every rank), one optimiser step per batch.

The rows (``sft_data.py``: TRL's ``messages``, ``prompt`` / ``completion`` and ``text`` formats) become
one ``Experience``: each row's tokens before its first trained token are the "prompt", the rest the
"response", and ``advantages`` holds 1 on trained tokens, 0 on the others (a later user turn). SFT is
then the policy gradient with advantage 1 on the demonstration, and runs through the strategy's
``train_actor`` as the RL update does: packed rows without padding where the strategy packs
(``models/packed.py``), LoRA, FSDP2, Megatron, the same checkpoints. Micro-batches: a token budget
(``actor.max_token_len_per_gpu``, or its auto on a GPU) or ``actor.micro_batch_size`` rows.

    verl-fast train algorithm.type=sft trainer.dataset=chat.jsonl actor.model_name=Qwen/Qwen2.5-0.5B
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from verl_fast import sft_data
from verl_fast.algos import dpo
from verl_fast.algos.algorithm import Step
from verl_fast.algos.losses import agg_loss
from verl_fast.config import Config
from verl_fast.data import RLDataProcessor
from verl_fast.experience import Experience
from verl_fast.sft_data import SFTExample
from verl_fast.trainer.batching import loss_normalisers, micro_batches, token_budget


class SFT:
    """The algorithm of supervised fine-tuning (module docstring)."""

    name = "sft"
    step = Step.PREFERENCE
    item_type = SFTExample
    samples = False
    needs_critic = False
    needs_reference = False

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._budget: Optional[int] = None

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
        if self.cfg.rollout.type == "vllm" or self.cfg.actor.type == "vllm":
            warnings.warn("rollout.type=vllm does not apply to algorithm.type=sft (it generates nothing); no vLLM "
                          "engine is started", UserWarning, stacklevel=3)
        t = self.cfg.trainer
        if t.gradient_accumulation_steps:
            t.train_batch_size = (t.per_device_train_batch_size or self.cfg.actor.micro_batch_size) \
                * t.gradient_accumulation_steps * world

    def encode(self, processor: RLDataProcessor, rows: List[Dict[str, Any]]) -> List[SFTExample]:
        return sft_data.encode(processor.tokenizer, rows, self.cfg.algorithm.sft_max_length)

    def pairs(self, batch: List[SFTExample], generate: Any, score: Any, metrics: Dict[str, Any]) -> List[SFTExample]:
        return batch

    def update(self, strategy: Any, batch: List[SFTExample], pad_id: int) -> Dict[str, float]:
        exp = experience(batch, pad_id, strategy.device)
        counts = loss_normalisers(exp.advantages, strategy.dp_group)
        stats, norm, _ = strategy.train_actor(exp, self._micro(strategy, exp),
                                              lambda logp, entropy, sub: nll(logp, sub, counts))
        trained = float(exp.advantages.sum())
        out = {"sft/loss": sum(s["loss_sum"] for s in stats) / max(trained, 1.0), "sft/tokens": trained,
               "actor/grad_norm": norm}
        strategy.actor_updated(False)
        return out

    def validation(self, processor: RLDataProcessor, rows: List[Dict[str, Any]], strategy: Any,
                   pad_id: int) -> "LossValidation":
        """The validation set's mean token NLL (``trainer.val_dataset``), as ``val/loss``."""
        examples = rows if rows and isinstance(rows[0], SFTExample) else self.encode(processor, rows)
        return LossValidation(examples, strategy, pad_id, self)

    def _micro(self, strategy: Any, exp: Experience) -> List[torch.Tensor]:
        rows = torch.arange(exp.num_sequences, device=exp.input_ids.device)
        a = self.cfg.actor
        if a.use_dynamic_bsz is False or (a.use_dynamic_bsz is None and (strategy.device.type != "cuda"
                                                                         or a.strategy == "megatron")):
            return micro_batches(rows, size=a.micro_batch_size)
        if self._budget is None:
            self._budget = a.max_token_len_per_gpu or token_budget(
                strategy.actor, strategy.optimizer, strategy.device, compiled=getattr(strategy, "compiled", False),
                half=strategy.autocast_dtype in (torch.bfloat16, torch.float16))
        return micro_batches(rows, exp.attention_mask.sum(-1), max_tokens=self._budget, group=strategy.dp_group,
                             packed=strategy.packs_sequences)


def experience(batch: List[SFTExample], pad_id: int, device: torch.device) -> Experience:
    """The rows as one Experience: "prompt" the tokens before the first trained one (at least one
    token), "response" the rest, ``advantages`` [N, L] the trained tokens' 1s."""
    prompts, responses, weights = [], [], []
    for e in batch:
        first = max(1, e.loss_mask.index(1))
        prompts.append(e.ids[:first])
        responses.append(e.ids[first:])
        weights.append(e.loss_mask[first:])
    ids, mask, rmask = dpo.sequence_tensors(prompts, responses, pad_id, device)
    adv = torch.zeros(rmask.shape, dtype=torch.float32)
    for row, w in enumerate(weights):
        adv[row, : len(w)] = torch.as_tensor(w, dtype=torch.float32)
    return Experience(input_ids=ids, attention_mask=mask, response_mask=rmask,
                      prompt_index=torch.arange(len(batch), device=device), advantages=adv.to(device))


def nll(logp: torch.Tensor, sub: Experience, counts: Dict[str, float]) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The micro-batch's share of the step's token-mean NLL over the trained tokens (``counts``: the
    step's trained tokens over the ranks, ``loss_normalisers``)."""
    weights = sub.advantages
    loss = agg_loss(-logp, weights, "token-mean", num_tokens=counts["num_tokens"])
    return loss, {"loss_sum": float(-(logp.detach() * weights).sum())}


class LossValidation:
    """The validation set's token-mean NLL under the current weights (no sampling)."""

    def __init__(self, examples: List[SFTExample], strategy: Any, pad_id: int, algorithm: SFT):
        if not examples:
            raise ValueError("the validation set (trainer.val_dataset) is empty")
        self.examples, self.strategy, self.pad_id, self.algorithm = examples, strategy, pad_id, algorithm

    def run(self, score: Any, reward: Any, seed: int) -> Tuple[Dict[str, float], List[Dict[str, Any]]]:
        s = self.strategy
        share = self.examples[s.dp_rank :: s.dp_size]
        exp = experience(share, self.pad_id, s.device)
        s.actor.eval()
        with torch.no_grad():
            logp = s.actor_logprobs(exp, self.algorithm._micro(s, exp))
        s.actor.train()
        total, count = float(-(logp * exp.advantages).sum()), float(exp.advantages.sum())
        if s.dp_size > 1:
            from verl_fast import distributed

            total, count = distributed.all_reduce_numbers([total, count], group=s.dp_group)
        return {"val/loss": total / max(count, 1.0)}, []
