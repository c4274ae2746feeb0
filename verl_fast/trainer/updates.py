"""The step's optimiser steps through the strategy's one training entry (``forward_backward`` then
``optimizer_step``, ``strategies/protocol.py``): the micro-batches cut from an ``Experience`` (by rows,
or under a token budget where the strategy allows it), the actor's PPO epochs and shuffled
mini-batches, the critic's epochs, and one step over rows an algorithm built itself (SFT's, the
preference algorithms'). Losses aggregate over the whole mini-batch (``batching.loss_normalisers``).
"""

from __future__ import annotations

import gc
import logging
import math
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from verl_fast import distributed
from verl_fast.algos.policy_losses import SYNC_GAP
from verl_fast.config import Config
from verl_fast.records.experience import Experience
from verl_fast.strategies import memory_plan
from verl_fast.trainer.batching import loss_normalisers, micro_batches, padded_budget, token_budget
from verl_fast.trainer.guardrails import nonfinite_step

logger = logging.getLogger(__name__)

# loss(logp, entropy, sub, counts) -> (loss, stats): an algorithm's actor loss on one micro-batch
ActorLoss = Callable[..., Tuple[torch.Tensor, Dict[str, Any]]]


def free_device_memory(device: torch.device) -> None:
    """What the failed passes held, returned to the device (their tensors collected, the allocator's cache emptied)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Updates:
    """The optimiser steps of one trainer (module docstring); ``perf``: the step's FLOP counter."""

    def __init__(self, cfg: Config, strategy: Any, perf: Any):
        self.cfg, self.strategy, self.perf = cfg, strategy, perf
        self.device, self.dp_group, self.world = strategy.device, strategy.dp_group, strategy.dp_size
        self.auto_budget: Optional[int] = None  # actor.max_token_len_per_gpu's auto (token_budget)
        self._budget_kind: Dict[str, bool] = {}  # how the passes keep activations, as auto_budget counts them
        self._budget_shape: Optional[memory_plan.Shape] = None  # the actor's, as auto_budget counted it
        self.last_budget: Optional[int] = None  # the token budget the latest micro-batches were cut under
        self.skipped: List[str] = []  # the last actor update's steps skipped for a non-finite gradient, named
        # given the engine / actor log-prob gap the update's first forward measured (policy_losses.py's
        # SYNC_GAP, every rank's tokens), before the first optimiser step (the trainer's sync guardrail)
        self.sync_gap_check: Optional[Callable[[float], None]] = None
        # the experience whose gap was checked: a rollout meets the engine's policy once, in the first update
        # over it (a second update over the same rows starts from a policy that has moved since)
        self._gap_checked: Optional[weakref.ReferenceType] = None
        self.split = 1  # the micro-batches' budget (tokens or rows) divided by this: a re-plan's (``_safer_plan``)
        self.replanned = False  # an out-of-memory step has been re-planned (once a run)

    # ---- micro-batches

    def micro(self, exp: Experience, rows: Optional[torch.Tensor] = None, for_update: bool = True,
              size: Optional[int] = None) -> List[torch.Tensor]:
        """Micro-batches of ``rows`` (every row of ``exp`` by default): by count, or under a token
        budget (``actor.use_dynamic_bsz``; unset: on a GPU, where the strategy budgets tokens), counted
        packed where the passes pack rows; rows with images run padded (``fsdp_strategy.prepared``), so
        theirs count rows x longest, under the auto budget for rows padded to ``exp``'s width."""
        a = self.cfg.actor
        if rows is None:
            rows = torch.arange(exp.num_sequences, device=self.device)
        by_tokens = a.use_dynamic_bsz
        if by_tokens is None:
            by_tokens = self.device.type == "cuda" and self.strategy.budgets_tokens
        if by_tokens:
            packs = self.strategy.packs_sequences and exp.vision is None
            # a micro-batch's width is at most the experience's (``Experience.select`` only cuts columns)
            budget = self.token_budget(0 if packs else exp.input_ids.shape[1])
            self.last_budget = budget
            return micro_batches(rows, exp.attention_mask.sum(-1), max_tokens=max(1, budget // self.split),
                                 group=self.dp_group, packed=packs)
        size = size or (a.micro_batch_size if for_update else max(a.micro_batch_size, 16))
        return micro_batches(rows, size=max(1, size // self.split))

    def token_budget(self, padded_width: int = 0) -> int:
        """``actor.max_token_len_per_gpu``; its auto is resolved at the first use (before the first
        update, so the memory the update will take is still free) and kept for the run, counted for
        packed rows; ``padded_width``: the auto for rows that run padded to that width, which keep more
        a token (``batching.padded_budget``)."""
        if self.cfg.actor.max_token_len_per_gpu is not None:
            return self.cfg.actor.max_token_len_per_gpu
        if self.auto_budget is None:
            s = self.strategy
            # how the passes keep their activations, as the budget was counted (a re-plan may turn
            # checkpointing on later: the budget is the run's, and so is the padded rows' count of it)
            self._budget_kind = dict(compiled=getattr(s, "compiled_counted", False),
                                     checkpointed=getattr(s, "checkpointing", False),
                                     half=s.autocast_dtype in (torch.bfloat16, torch.float16))
            self._budget_shape = memory_plan.shape_of(s.actor)
            self.auto_budget = token_budget(s.actor, s.optimizer, self.device,
                                            casts_weights=s.autocast_dtype is not None and getattr(s, "bf16", None) is None,
                                            state_bytes=memory_plan.OPTIMIZER_STATE_BYTES[self.cfg.actor.optimizer],
                                            **self._budget_kind)
            logger.info("actor.max_token_len_per_gpu (auto): %d tokens per micro-batch", self.auto_budget)
        if not padded_width or self.device.type != "cuda":  # the CPU's fixed budget counts no memory
            return self.auto_budget
        return padded_budget(self.auto_budget, self._budget_shape, padded_width, **self._budget_kind)

    def budget_metrics(self) -> Dict[str, float]:
        """The auto budget the latest micro-batches were cut under (padded rows': theirs), and whether an
        out-of-memory step has been re-planned so far (``perf/update_replanned``: 1 from that step on)."""
        out = {"perf/update_replanned": float(self.replanned)}
        if self.auto_budget is not None:
            out["perf/token_budget"] = float(self.last_budget or self.auto_budget)
        return out

    def _norm_length(self, section) -> float:
        """seq-mean-token-sum-norm's divisor for the actor or critic ``section``: one constant for
        every micro-batch of every step."""
        return float(section.loss_scale_factor or self.cfg.rollout.max_new_tokens)

    # ---- steps

    def step(self, exp: Experience, micro: List[torch.Tensor], loss_fn: Callable[..., Any],
             entropy: bool = True, before_step: Optional[Callable[[List[Dict]], None]] = None
             ) -> Tuple[List[Dict], float]:
        """One optimiser step of the actor over ``micro`` with ``loss_fn(logp, entropy, sub)`` (entropy
        None with ``entropy=False``): each micro-batch's statistics and the gradient norm (the passes'
        work counted in ``perf``); ``before_step(stats)`` runs between the backward and the step."""
        stats = self.passes(exp, micro, loss_fn, entropy, before_step)
        return stats, self.strategy.optimizer_step()

    def passes(self, exp: Experience, micro: List[torch.Tensor], loss_fn: Callable[..., Any],
               entropy: bool = True, before_step: Optional[Callable[[List[Dict]], None]] = None) -> List[Dict]:
        """``step``'s forward and backward passes and its ``before_step``, without the optimiser step."""
        stats, cost = self.strategy.forward_backward(exp, micro, loss_fn, entropy=entropy)
        self.perf.count_update(*cost)
        if before_step is not None:
            before_step(stats)
        return stats

    def fitted_step(self, exp: Experience, rows: torch.Tensor, loss_fn: Callable[..., Any],
                    before_step: Callable[[List[torch.Tensor]], Optional[Callable[[List[Dict]], None]]],
                    entropy: bool = True) -> Tuple[List[torch.Tensor], List[Dict], float]:
        """``step`` over ``rows`` cut into micro-batches (``micro``): the micro-batches, their statistics and
        the gradient norm; ``before_step(micro)`` gives the step's ``before_step``. A step whose passes run
        out of device memory is re-planned once a run where a safer plan exists (``_safer_plan``): its
        partial gradients dropped, the memory freed, the passes run again, one line logged. Only the
        passes are retried: an optimiser step that fails part-way has moved some states already."""
        micro = self.micro(exp, rows)
        while True:
            try:
                stats = self.passes(exp, micro, loss_fn, entropy, before_step=before_step(micro))
                break
            except torch.OutOfMemoryError as e:
                error = str(e).splitlines()[0] if str(e) else "out of memory"
            # outside the except clause: the error's traceback, which holds the failed passes' tensors, is gone
            change = self._safer_plan(micro)
            if change is None:
                raise torch.OutOfMemoryError(f"{error} (the actor update has no safer plan left: {self._limits()})")
            self.strategy.optimizer.zero_grad(set_to_none=True)
            free_device_memory(self.device)
            logger.warning("actor update: out of memory at micro-batches of up to %d rows (%s); retrying the step "
                           "with %s", max((len(idx) for idx in micro), default=0), error, change)
            micro = self.micro(exp, rows)
        return micro, stats, self.strategy.optimizer_step()

    def _safer_plan(self, micro: List[torch.Tensor]) -> Optional[str]:
        """What the re-plan of an out-of-memory step changes, in words (None: nothing left to change, or
        several ranks, whose passes must stay in step): gradient checkpointing turned on where the
        strategy can (``recompute_activations``), else the micro-batches halved where one holds more
        than one row. Only a strategy that says how (``recompute_activations``: the FSDP one) in a run of
        one process re-plans: Megatron's ranks (tensor or pipeline parallel too) and gradient buffers are
        not one process's to change."""
        recompute = getattr(self.strategy, "recompute_activations", None)
        if self.replanned or recompute is None or distributed.world_size() > 1:
            return None
        if recompute():
            change = "gradient checkpointing on"
        elif max((len(idx) for idx in micro), default=0) > 1:
            self.split *= 2
            change = f"micro-batches of half the budget ({self.split} x smaller than planned)"
        else:
            return None
        self.replanned = True
        return change

    def _limits(self) -> str:
        if distributed.world_size() > 1 or getattr(self.strategy, "recompute_activations", None) is None:
            return ("a run of several processes, or Megatron's, re-plans only at start-up; set "
                    "actor.gradient_checkpointing or a smaller actor.max_token_len_per_gpu")
        if self.replanned:
            return "re-planned once already"
        return "one row a micro-batch, activations recomputed"

    def _sync_gap(self, exp: Experience, micro: List[torch.Tensor]) -> Callable[[List[Dict]], None]:
        """``before_step`` of the update's first step: the token-weighted SYNC_GAP of its micro-batches over
        every rank (read once the backward ran: the gradient norm's read follows anyway) to ``sync_gap_check``."""
        def check(stats: List[Dict]) -> None:
            weighted = [(st[SYNC_GAP], exp.response_mask[idx].sum()) for idx, st in zip(micro, stats) if SYNC_GAP in st]
            total = float(sum(v * w for v, w in weighted)) if weighted else 0.0
            tokens = float(sum(w for _, w in weighted)) if weighted else 0.0
            if self.world > 1:
                total, tokens = distributed.all_reduce_numbers([total, tokens], group=self.dp_group)
            if tokens > 0:
                self.sync_gap_check(total / tokens)
        return check

    def actor(self, exp: Experience, loss: ActorLoss, skip_idle: bool, step: int) -> Dict[str, float]:
        """``actor.ppo_epochs`` passes over ``exp`` in shuffled mini-batches of ``actor.ppo_mini_batch_size``
        rows, one optimiser step each, with ``loss(logp, entropy, sub, counts)``; the statistics
        weighted by response tokens over every rank. ``skip_idle``: samples whose advantage is 0
        everywhere are left out of the backward (they add exactly nothing; the normalisers still
        count them), where the strategy lets ranks run different numbers of passes; ``pg_loss`` is
        still the mini-batches' loss (a left-out sample's share is 0: its tokens count in the mean),
        the other statistics are over the samples trained on. ``step``: the trainer's, which seeds
        the shuffle (a resumed run shuffles the same)."""
        a = self.cfg.actor
        N = exp.num_sequences
        rows = torch.arange(N, device=self.device)
        skip = skip_idle and self.strategy.uneven_micro_batches
        active = exp.advantages.abs().sum(-1) > 0 if skip else torch.ones(N, dtype=torch.bool, device=self.device)
        mini = a.ppo_mini_batch_size or N
        totals: Dict[str, float] = {}
        peaks: Dict[str, List[Any]] = {}  # the "*_max" statistics: the largest, not the mean
        weight, every, norms = 0.0, 0.0, 0.0  # tokens trained on, the mini-batches' tokens (every rank's), norms
        self.strategy.actor.train()
        self.skipped = []
        steps = a.ppo_epochs * math.ceil(N / mini)
        for epoch in range(a.ppo_epochs):
            order = rows
            if a.ppo_epochs > 1 or mini < N:
                g = torch.Generator().manual_seed(self.cfg.trainer.seed * 7 + step * 131 + epoch)
                order = rows[torch.randperm(N, generator=g).to(self.device)]
            for start in range(0, N, mini):
                mb = order[start : start + mini]
                counts = loss_normalisers(exp.response_mask[mb], self.dp_group, self._norm_length(a))
                every += counts["num_tokens"] * counts["dp_size"]
                first = (epoch == 0 and start == 0 and self.sync_gap_check is not None
                         and (self._gap_checked is None or self._gap_checked() is not exp))
                if first:
                    self._gap_checked = weakref.ref(exp)
                micro, stats, norm = self.fitted_step(
                    exp, mb[active[mb]], lambda logp, entropy, sub: loss(logp, entropy, sub, counts),
                    lambda micro: self._sync_gap(exp, micro) if first else None)
                skipped = nonfinite_step(epoch * math.ceil(N / mini) + start // mini, steps, norm, stats)
                if skipped is not None:  # the strategy did not step (guardrails name it)
                    self.skipped.append(skipped)
                    norm = 0.0  # actor/grad_norm: the mean of the steps taken
                for idx, st in zip(micro, stats):
                    w = float(exp.response_mask[idx].sum())
                    for k, v in st.items():
                        if k.endswith("_max"):
                            peaks.setdefault(k, []).append(v)
                        else:
                            totals[k] = totals.get(k, 0.0) + v * w
                    weight += w
                norms += norm
        totals = {k: float(v) for k, v in totals.items()}  # the statistics' one read back (actor_loss)
        largest = {k: max(float(v) for v in values) for k, values in peaks.items()}
        if self.world > 1:  # weighted by every rank's tokens, as one process would weight them
            keys = sorted(totals)
            summed = distributed.all_reduce_numbers([totals[k] for k in keys] + [weight], group=self.dp_group)
            totals, weight = dict(zip(keys, summed[:-1])), summed[-1]
            if largest:
                keys = sorted(largest)
                largest = dict(zip(keys, distributed.all_reduce_numbers([largest[k] for k in keys], "max",
                                                                        group=self.dp_group)))
        means = {k: v / max(every if k == "pg_loss" else weight, 1e-9) for k, v in totals.items()}
        # statistics named with a group of their own ("rollout_correction/...") keep it; the rest are the actor's
        out = {k if "/" in k else f"actor/{k}": v for k, v in {**means, **largest}.items()}
        out.setdefault("actor/pg_loss", 0.0)  # every advantage 0: the policy loss is exactly 0
        out["actor/grad_norm"] = norms / max(steps - len(self.skipped), 1)
        out["actor/active_fraction"] = float(active.float().mean())
        return {**out, **self.budget_metrics()}

    def critic(self, exp: Experience, loss: Callable[..., Any]) -> Dict[str, float]:
        """``actor.ppo_epochs`` optimiser steps of the critic over ``exp`` with ``loss(values, sub,
        counts, N)``, micro-batches of ``critic.micro_batch_size`` rows."""
        c, critic = self.cfg.critic, self.strategy.critic
        N = exp.num_sequences
        counts = loss_normalisers(exp.response_mask, self.dp_group, self._norm_length(c))
        totals: Dict[str, float] = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
        for _ in range(self.cfg.actor.ppo_epochs):
            micro = self.micro(exp, size=c.micro_batch_size)
            results = critic.forward_backward(exp, micro, lambda values, sub: loss(values, sub, counts, N))
            critic.optimizer_step()
            for stats in results:
                totals["vf_loss"] += stats["vf_loss"]
                totals["vf_clipfrac"] += stats["vf_clipfrac"]
        epochs = self.cfg.actor.ppo_epochs
        return {"critic/vf_loss": totals["vf_loss"] / epochs, "critic/vf_clipfrac": totals["vf_clipfrac"] / epochs,
                "critic/values_mean": float((exp.values * exp.response_mask).sum() / exp.response_mask.sum())}
