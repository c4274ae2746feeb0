"""``trainer.async_mode: one_step``: the rollout of step t+1 runs in a thread while step t scores,
computes its log-probs and updates.

The thread generates with a copy of the policy at version t (the weights before step t's update),
never with weights being updated: a Hugging Face engine gets a frozen copy of the actor of its own
(``HFGenerateEngine`` over it; in the autocast dtype under autocast), refreshed from the actor between
generations; an engine that owns its weights (vLLM) is itself the copy, synced between generations. Every sample is then exactly one
version old when it trains (the first step's: zero), and its tokens carry the behaviour log-probs
of that version; ``algorithm.rollout_correction`` weights each token by
``exp(old_logprob - behaviour_logprob)``, truncated.

Seeds are the synchronous run's (``seed_of(step)``), so with the weights unchanged (lr 0) the samples
and losses are the synchronous ones. A checkpoint holds the generation in flight (waited for), so a
resumed run trains on the same samples as an uninterrupted one.

The HF engine seeds torch's global generator for its sampling (``hf_engine.py``): the trainer's
own thread must not draw from it meanwhile (its passes use explicit generators; dropout in the
actor would). On a GPU the thread decodes on a CUDA stream of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import threading
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch

from verl_fast.async_rl.records import AsyncStats, Sampled, check_staleness, staleness_figures
from verl_fast.models.wrapping import hf_module
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.rollout.operator import RolloutOperator


def _snapshot_operator(operator: RolloutOperator) -> RolloutOperator:
    """``operator`` over an HF engine of its own, on a frozen copy of the actor's module. Parameters
    that do not train (a LoRA actor's base) are shared with the actor, not copied: nothing writes them.
    Under autocast the copies of the trained ones are in the autocast dtype, as full's workers and a vLLM
    engine hold their weights (half an fp32 copy's memory; the decode computes in that dtype anyway)."""
    engine = operator.engine
    actor = hf_module(engine.model)
    dtype = engine.autocast_dtype
    memo: dict = {}
    for p in actor.parameters():
        if not p.requires_grad:
            memo[id(p)] = p
        elif dtype is not None and p.is_floating_point() and id(p) not in memo:  # made here: no fp32 copy first
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
    module = copy.deepcopy(actor, memo=memo).eval().requires_grad_(False)
    own = HFGenerateEngine(module, engine.tokenizer, **engine.settings())
    out = copy.copy(operator)  # a subclass's get_generation_kwargs included
    out.engine = own
    return out


class OneStepRollout:
    """Generation one step ahead (see the module docstring). ``weight_source``: what an engine that
    owns its weights syncs from; ``autocast``: the actor's autocast, entered around each generation."""

    mode = "one_step"

    def __init__(self, operator: RolloutOperator, actor: torch.nn.Module, weight_source: Callable[[], Any],
                 seed_of: Callable[[int], int], autocast: Callable[[], ContextManager], pad_id: int,
                 max_staleness: int = 1):
        self.owns = operator.engine.owns_weights
        self.operator = operator if self.owns else _snapshot_operator(operator)
        self.actor, self.weight_source = actor, weight_source
        self.seed_of, self.autocast, self.pad_id = seed_of, autocast, pad_id
        self.max_staleness = max_staleness
        self.version = -1  # the policy version the rollout copy holds (-1: not yet synced)
        self._batch_of: Optional[Callable[[int], List[Any]]] = None
        self._total = 0
        self._pending: Optional[concurrent.futures.Future] = None
        self._pending_prompts: Optional[List[List[int]]] = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="one_step rollout")
        self._busy = 0.0  # seconds generated since the last take
        self._lock = threading.Lock()
        self._stats = AsyncStats()
        cuda = next(actor.parameters()).device.type == "cuda"
        # the decode's stream at high priority: its small per-token kernels take the SMs as the update's
        # blocks free them, so the rollout runs near its own pace and the update fills the gaps
        # (a CUDA graph replayed into it takes the stream's priority)
        self._stream = torch.cuda.Stream(priority=-1) if cuda else None  # -1: above the default stream's 0

    def begin(self, batch_of: Callable[[int], List[Any]], total: int) -> None:
        """``batch_of(step)``: the step's prompts (the trainer's data order); ``total``: the run's steps."""
        self._batch_of, self._total = batch_of, total

    # ---------------------------------------------------------------- the trainer's calls

    def take(self, step: int, batch: Sequence[Any], metrics: Dict[str, Any]):
        """Step ``step``'s samples of ``batch`` (those generated one step ahead, else generated now),
        after which step ``step + 1``'s generation starts on the current weights."""
        start = time.perf_counter()
        sampled = None
        if self._pending is not None:
            prompts, sampled = self._pending_prompts, self._pending.result()
            self._pending = None
            if sampled.step != step or prompts != [list(r.prompt_ids) for r in batch]:
                sampled = None  # generated for other prompts (train_step called by hand): not these
        waited = time.perf_counter() - start
        if sampled is None:
            self._sync(step)
            sampled = self._generate(step, list(batch))
        check_staleness(sampled, step, self.max_staleness)
        with self._lock:
            busy, self._busy = self._busy, 0.0
        metrics.update(staleness_figures(sampled, step))
        metrics.update(self._stats.step_figures(waited, busy, sampled.gen_seconds, 0))
        metrics["async/policy_version"] = float(step)
        if self._batch_of is not None and step + 1 < self._total:
            self._sync(step)
            self._submit(step + 1, self._batch_of(step + 1))
        return sampled.gen

    def quiesce(self, version: int) -> None:
        """Waits for the generation in flight (kept for its step) and syncs the copy to ``version``:
        before a validation, which samples with the current weights."""
        if self._pending is not None:
            self._pending.result()
        if self.owns:
            self._sync(version)

    def state_dict(self) -> Dict[str, Any]:
        """The generation in flight, finished (checkpoints: nothing generated is lost)."""
        if self._pending is None:
            return {}
        return {"pending": self._pending.result().to_state(), "prompts": self._pending_prompts}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state.get("pending"):
            return
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(Sampled.from_state(state["pending"], self.pad_id))
        self._pending, self._pending_prompts = future, state["prompts"]

    def close(self, version: int) -> None:
        """Ends the generation in flight (its samples dropped: a checkpoint has already kept them) and
        leaves an engine that owns its weights on ``version``, the actor's final one, as ``off`` does."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self.owns:
            self._sync(version)

    # ---------------------------------------------------------------- inside

    @torch.no_grad()
    def _sync(self, version: int) -> None:
        """The rollout copy holds the actor's current weights, ``version`` (no generation is in flight)."""
        if self.version == version:
            return
        if self.owns:
            self.operator.engine.sync_from(self.weight_source())
        else:
            for dst, src in zip(self.operator.engine.model.parameters(), hf_module(self.actor).parameters()):
                if dst is not src:  # a shared frozen parameter is already the actor's
                    dst.copy_(src)
        self.version = version

    def _submit(self, step: int, batch: List[Any]) -> None:
        ready = None
        if self._stream is not None:  # the copy was written on this thread's stream
            ready = torch.cuda.Event()
            ready.record()
        self._pending_prompts = [list(r.prompt_ids) for r in batch]
        self._pending = self._executor.submit(self._generate, step, batch, ready)

    def _generate(self, step: int, batch: List[Any], ready=None) -> Sampled:
        version = self.version
        start = time.perf_counter()
        stream = contextlib.nullcontext() if self._stream is None else torch.cuda.stream(self._stream)
        with stream, self.autocast():
            if ready is not None:
                self._stream.wait_event(ready)
            gen = self.operator.rollout(batch, seed=self.seed_of(step))
        seconds = time.perf_counter() - start
        with self._lock:
            self._busy += seconds
        return Sampled.of_one_version(step, gen, version, seconds)
