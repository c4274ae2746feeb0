"""``trainer.async_mode: full``: rollout workers in processes of their own (``worker.py``) fill a
bounded queue while the trainer trains; weights go to them by version (``transport.py``).

Placement (``placement``): on the CPU the workers are CPU processes and the weights travel over a
gloo group; with one GPU the workers share it and read the weights from one CUDA IPC buffer; with
several GPUs each worker takes a GPU the trainer does not use and the weights are an NCCL broadcast.

Bounded staleness: the prompts of step ``s`` are handed to the workers only once the trainer holds
version ``s - max_staleness`` or newer, and a worker samples every token with the newest weights it
was pushed (from the next token with ``partial_rollouts``, else from its next batch), so no token
the trainer trains on at version ``s`` is more than ``max_staleness`` versions old (checked on
arrival). The result queue holds at most ``max_staleness`` batches.

Checkpoints: nothing in flight is saved. Every step's prompts come from the trainer's data order,
so a resumed run hands the steps it has not trained to fresh workers: no prompt is lost and no
sample trained twice. A resumed run is not bit-identical to an uninterrupted one: which version
samples which token depends on when the pushes land (timing), in either run.
"""

from __future__ import annotations

import queue
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from verl_fast import openmp_env
from verl_fast.async_rl import transport
from verl_fast.async_rl.records import AsyncStats, Sampled, check_staleness, staleness_figures
from verl_fast.async_rl.worker import Task, WorkerSetup, main
from verl_fast.models.wrapping import hf_module
from verl_fast.records.generation import texts_of
from verl_fast.rollout.hf_engine import eos_token_ids
from verl_fast.rollout.operator import RolloutOperator


def placement(workers: int, device: torch.device, device_count: int) -> Tuple[List[str], str, str]:
    """``(each worker's device, transport, group backend)`` for a trainer on ``device`` with
    ``device_count`` GPUs on the host."""
    if device.type != "cuda":
        return ["cpu"] * workers, "group", "gloo"
    if device_count <= 1:  # one GPU: shared (NCCL cannot run two ranks on one device)
        return [str(device)] * workers, "shared", "nccl"
    index = device.index if device.index is not None else 0
    free = [f"cuda:{i}" for i in range(device_count) if i != index]
    if workers > len(free):
        raise ValueError(f"trainer.async_workers={workers} needs a GPU each beside the trainer's; this host has "
                         f"{len(free)} more; lower async_workers")
    return free[:workers], "group", "nccl"


class FullAsyncRollout:
    """The trainer's side of full mode (see the module docstring). ``transport_kind`` overrides the
    placement's (tests run the shared-buffer path on the CPU)."""

    mode = "full"

    def __init__(self, cfg: Any, actor: torch.nn.Module, tokenizer: Any, operator: RolloutOperator,
                 seed_of: Callable[[int], int], transport_kind: Optional[str] = None):
        t = cfg.trainer
        self.max_staleness, self.partial = t.max_staleness, t.partial_rollouts
        self.module = hf_module(actor)
        self.pushed = transport.PushedWeights(self.module)  # a LoRA actor's adapters merged into the base
        self.operator, self.seed_of, self.tokenizer = operator, seed_of, tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = eos_token_ids(self.module, tokenizer)
        self.device = self.pushed.device
        count = torch.cuda.device_count() if self.device.type == "cuda" else 0
        self.devices, kind, self.backend = placement(t.async_workers, self.device, count)
        self.kind = transport_kind or kind
        # the workers decode as the trainer's HF engine does (fast decode, compiled steps, autocast), on
        # weights held in its autocast dtype when it has one (as vLLM holds bf16 weights): half the bytes
        # pushed and read per token, and no per-token casts inside the captured decode step
        self.engine_settings = operator.engine.settings()
        self.dtype = self.engine_settings["autocast_dtype"] or self.pushed.dtype
        self._batch_of: Optional[Callable[[int], List[Any]]] = None
        self._total = 0
        self._procs: List[Any] = []
        self._stats = AsyncStats()
        self._reset()

    def _reset(self) -> None:
        self.version = -1  # the newest version pushed
        self._issued = -1  # the newest step handed to the workers
        self._prompts: Dict[int, List[List[int]]] = {}
        self._ready: Dict[int, Sampled] = {}
        self._busy = 0.0

    def begin(self, batch_of: Callable[[int], List[Any]], total: int) -> None:
        self._batch_of, self._total = batch_of, total

    # ---------------------------------------------------------------- the trainer's calls

    def take(self, step: int, batch: Sequence[Any], metrics: Dict[str, Any]):
        if not self._procs:
            self._start()
        push_start = time.perf_counter()
        if self.version != step:
            self.publisher.publish(self.pushed, step, self._alive)
            self.version = step
        metrics["time/weight_push"] = time.perf_counter() - push_start
        self._issue(step, batch)
        if self._prompts.get(step) != [list(r.prompt_ids) for r in batch]:
            raise RuntimeError(f"trainer.async_mode=full generates fit()'s steps in its data order; step {step} was "
                               "called with other prompts")
        depth = len(self._ready) + self._results.qsize()
        start = time.perf_counter()
        while step not in self._ready:
            self._receive(step)
        waited = time.perf_counter() - start
        sampled = self._ready.pop(step)
        del self._prompts[step]
        check_staleness(sampled, step, self.max_staleness)
        busy, self._busy = self._busy, 0.0
        metrics.update(staleness_figures(sampled, step))
        metrics.update(self._stats.step_figures(waited, busy, sampled.gen_seconds, depth))
        metrics["async/policy_version"] = float(step)
        return sampled.gen

    def quiesce(self, version: int) -> None:
        """Nothing to wait for: the workers' copies are their own, the trainer validates on its own."""

    def state_dict(self) -> Dict[str, Any]:
        return {}  # in-flight samples are regenerated after a resume (module docstring)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def close(self, version: int) -> None:
        """Stops the workers (the stop event; those still running after 30 s are terminated); their
        samples in flight are dropped (the steps they were for are regenerated by a resumed run)."""
        if not self._procs:
            return
        self._stop.set()
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
        self._procs = []
        self.group = None
        self._reset()

    # ---------------------------------------------------------------- inside

    def _start(self) -> None:
        # the workers' torch loads after their start: on a GPU machine their OpenMP pools wait passively
        # (every process's pool spinning slowed `full` below the synchronous samples/s: docs/async.md);
        # this process's own pool read the variable when it loaded torch
        # (`verl-fast` sets it before that)
        openmp_env.use()
        ctx = torch.multiprocessing.get_context("spawn")
        workers = len(self.devices)
        self._tasks, self._results, self._stop = ctx.Queue(), ctx.Queue(maxsize=self.max_staleness), ctx.Event()
        announced, pushes, acks = ctx.Value("q", -1), ctx.Value("q", 0), ctx.Array("q", [-1] * workers)
        flat = torch.empty(self.pushed.numel, dtype=self.dtype, device=self.device)  # filled by a casting copy
        shared = None
        if self.kind == "shared":
            shared = flat.share_memory_() if not flat.is_cuda else flat
        store, port = None, 0
        if self.kind == "group":
            store = transport.rendezvous(0, 0, workers + 1)
            port = store.port
        for w, device in enumerate(self.devices):
            setup = WorkerSetup(w, workers + 1, self.module.config, self.pushed.names, self.dtype, device,
                                self.engine_settings, self.kind, self.backend, port, self.stop_ids, self.pad_id,
                                self.partial, None if self.partial else self.tokenizer)
            p = ctx.Process(target=main, args=(setup, self._tasks, self._results, self._stop, announced, acks, pushes,
                                               shared), daemon=True, name=f"verl_fast rollout worker {w}")
            p.start()
            self._procs.append(p)
        self.group = transport.process_group(self.backend, store, 0, workers + 1) if store is not None else None
        self.publisher = transport.Publisher(self.kind, flat, announced, acks, pushes, self.group)

    def _alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _issue(self, step: int, batch: Sequence[Any]) -> None:
        """Hands the workers every step up to ``step + max_staleness`` (the window the staleness allows)."""
        last = step  # without begin() (train_step called by hand) only the step itself is known
        if self._batch_of is not None:
            last = max(step, min(step + self.max_staleness, self._total - 1))
        for s in range(max(self._issued + 1, step), last + 1):
            rows = list(batch) if s == step else self._batch_of(s)
            prompts = [list(r.prompt_ids) for r in rows]
            seed = self.seed_of(s)
            self._prompts[s] = prompts
            self._tasks.put(Task(s, prompts, self.operator.specs(rows, seed), seed))
            self._issued = s

    def _receive(self, step: int) -> None:
        try:
            record = self._results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"rollout worker {dead[0].name} exited (code {dead[0].exitcode}) while step "
                                   f"{step} waited for samples; its error is in the log above") from None
            return
        if record["step"] not in self._prompts:  # a step already trained (cannot happen: each is issued once)
            raise RuntimeError(f"a rollout worker returned samples for step {record['step']}, which is not pending")
        record["texts"] = texts_of(self.tokenizer, record["tokens"])
        self._busy += record["gen_seconds"] / len(self._procs)
        self._ready[record["step"]] = Sampled.from_state(record, self.pad_id)
