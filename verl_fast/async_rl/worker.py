"""A rollout worker process of ``trainer.async_mode: full``: takes a step's prompts from the task
queue, decodes them (``decode.py``) with the newest weights it was pushed, and puts the samples,
each token tagged with its version, on the bounded result queue.

With ``partial`` the weights pushed mid-generation are loaded at the next token boundary (the
decode loop of ``decode.py``); without, at the next batch (a sequence never mixes versions; the
push is still received at once, into the worker's own staging copy, so the trainer never waits for
a whole generation), and the batch decodes with ``HFGenerateEngine`` (on a GPU its static-cache
loop with CUDA graphs, which reads the weights in place and so cannot take them mid-batch). Signals
are ignored here: the trainer stops the workers (``stop`` event), and a worker whose trainer died
exits on its own.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional

import torch

from verl_fast.async_rl import transport
from verl_fast.async_rl.decode import decode
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.hf_engine import HFGenerateEngine


@dataclass
class Task:
    step: int
    prompts: List[List[int]]
    specs: List[SamplingSpec]
    seed: int


@dataclass
class WorkerSetup:
    """What a worker needs to start (pickled into the spawned process)."""

    worker: int  # 0-based; its rank in the weight group is worker + 1
    world: int  # 1 + workers
    hf_config: Any
    names: List[str]  # the actor's parameter names, in order
    dtype: torch.dtype  # the model's and the pushed buffer's
    device: str
    engine: Dict[str, Any]  # the trainer's HFGenerateEngine.settings(): autocast dtype, fast / compiled decode
    transport: str  # transport.TRANSPORTS
    backend: str  # group: gloo or nccl
    port: int
    stop_ids: List[int]
    pad_id: int
    partial: bool
    tokenizer: Any = None  # without partial rollouts: HF generate's (HFGenerateEngine, fast decode on a GPU)
    threads: int = 1


def _model(setup: WorkerSetup) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(setup.hf_config, dtype=setup.dtype)
    names = [n for n, _ in model.named_parameters()]
    if names != setup.names:
        raise RuntimeError(f"rollout worker {setup.worker}: the model built from the actor's config has other "
                           f"parameters than the actor ({len(names)} vs {len(setup.names)})")
    return model.eval().requires_grad_(False)


def main(setup: WorkerSetup, tasks: Any, results: Any, stop: Any, announced: Any, acks: Any, pushes: Any,
         shared: Optional[torch.Tensor]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(setup.threads)
    parent = os.getppid()
    if setup.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(setup.device))
    group = None
    if setup.transport == "group":
        store = transport.rendezvous(setup.port, setup.worker + 1, setup.world)
        group = transport.process_group(setup.backend, store, setup.worker + 1, setup.world)
    model = _model(setup)
    params = transport.params_of(model)
    staged = torch.empty(transport.flat_size(params), dtype=setup.dtype, device=setup.device)
    sub = transport.Subscriber(setup.transport, setup.worker, staged, announced, acks, pushes, shared, group)
    alive = lambda: not stop.is_set() and os.getppid() == parent  # noqa: E731
    transport.wait_for_first(sub, alive)
    loaded = [-1]  # the version in the model

    def refresh(at_batch_start: bool) -> int:
        newest = sub.poll()
        if newest != loaded[0] and (setup.partial or at_batch_start):
            transport.unflatten_from(staged, params)
            loaded[0] = newest
        return loaded[0]

    engine = None if setup.partial else HFGenerateEngine(model, setup.tokenizer, **setup.engine)
    idle_since = time.perf_counter()
    while alive():
        refresh(at_batch_start=False)  # a push waits for every worker, idle ones too
        try:
            task: Task = tasks.get(timeout=0.005)
        except queue.Empty:
            continue
        refresh(at_batch_start=True)  # after the get: a task is queued only after the push it may need
        idle = time.perf_counter() - idle_since
        start = time.perf_counter()
        if engine is None:
            out = _run(model, task, setup, lambda: refresh(at_batch_start=False))
        else:
            out = _run_whole(engine, task, loaded[0])
        record = {"step": task.step, "worker": setup.worker, "gen_seconds": time.perf_counter() - start,
                  "idle_seconds": idle, **out}
        while alive():  # a full queue: keep joining weight pushes while waiting for room
            try:
                results.put(record, timeout=0.005)
                break
            except queue.Full:
                refresh(at_batch_start=False)
        idle_since = time.perf_counter()


def _run_whole(engine: HFGenerateEngine, task: Task, version: int) -> Dict[str, Any]:
    """The task's samples from ``engine`` (one version throughout), as ``_run`` gives them."""
    gen = engine.generate(task.prompts, task.specs)
    mask = gen.response_mask.bool()
    tokens = [gen.response_ids[i][mask[i]].tolist() for i in range(gen.num_sequences)]
    return {"prompt_index": gen.prompt_index.tolist(), "tokens": tokens,
            "logprobs": [gen.logprobs[i][mask[i]].tolist() for i in range(gen.num_sequences)],
            "versions": [[version] * len(t) for t in tokens], "finish_reasons": list(gen.finish_reasons)}


def _run(model: torch.nn.Module, task: Task, setup: WorkerSetup, between_tokens) -> Dict[str, Any]:
    """The task's samples as lists (prompt order, ``n`` per prompt): tokens, log-probs, versions."""
    generator = torch.Generator(device=setup.device).manual_seed(task.seed)
    groups: Dict[SamplingSpec, List[int]] = {}
    for i, spec in enumerate(task.specs):
        groups.setdefault(replace(spec, seed=None), []).append(i)
    per_prompt: Dict[int, list] = {}
    dtype = setup.engine["autocast_dtype"]
    autocast = (torch.autocast(torch.device(setup.device).type, dtype=dtype)
                if dtype is not None else torch.autocast("cpu", enabled=False))
    with autocast:
        for spec, members in groups.items():
            decoded = decode(model, [task.prompts[i] for i in members], spec, generator, setup.stop_ids,
                             setup.pad_id, between_tokens)
            for i, samples in zip(members, decoded):
                per_prompt[i] = samples
    out: Dict[str, list] = {"prompt_index": [], "tokens": [], "logprobs": [], "versions": [], "finish_reasons": []}
    for i in range(len(task.prompts)):
        for d in per_prompt[i]:
            out["prompt_index"].append(i)
            out["tokens"].append(d.tokens)
            out["logprobs"].append(d.logprobs)
            out["versions"].append(d.versions)
            out["finish_reasons"].append(d.finish_reason)
    return out
