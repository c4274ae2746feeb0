"""vLLM rollout inside the trainer's process: ``VLLMInferenceEngine``.

``vllm.LLM`` runs in this process (no HTTP server, no engine subprocess): prompts go in as token ids,
the actor's weights go in as tensors after every optimizer step and are loaded in place (no disk
reload, no engine restart), and the prefix cache is dropped after each update. The launcher calls
``verl_fast.rollout.vllm_env.configure_vllm_env()`` first (the ``verl-fast`` CLI does); where nobody
has set ``VLLM_ENABLE_V1_MULTIPROCESSING``, the engine calls it itself (the seeds' snippets build an
engine directly).

    configure_vllm_env()
    engine = VLLMInferenceEngine(path, dtype="bfloat16", max_model_len=1024)
    out = engine.generate(prompt_token_ids, [SamplingSpec(n=8, max_tokens=256)] * len(prompt_token_ids))
    engine.sleep()                                   # before training (GPU: frees KV cache / weights)
    engine.sync_from(actor)                          # after each optimizer step (HF, FSDP1, FSDP2, Megatron)
    engine.wake_up()                                 # before the next rollout
    engine.metrics()  # {"prefix_cache_hit_rate": ..., "kv_cache_usage_peak": ..., "weight_update_s": ...}

Choices:
- Log-probs are the sampled tokens' log-probs under the distribution actually sampled from
  (vLLM ``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p), i.e. what
  ``response_logprobs(..., temperature=T)`` computes for the actor when top-k / top-p are off.
  Pass ``logprobs_mode="raw_logprobs"`` for log-probs of the unscaled logits.
- Speculative decoding and guided (structured) decoding are refused: RL rollout must sample from the
  policy itself, and both change what is sampled or how, so the samples would no longer be the
  policy's own.
- Weight sync (``sync_from``): a ``WeightSync`` plan built at the first call and reused, moving each
  rank's own TP shard from where the actor's shards live (``rollout/weight_sync.py``). Where vLLM
  keeps the loaded layout (GPU builds) it writes straight into the engine's parameter tensors; on
  the CPU (which repacks linear weights after loading) it goes through vLLM's reload path.
  ``update_weights(named_tensors)`` loads whole HF-named tensors instead (any source).
- Under torchrun, engines built with ``distributed_executor_backend="external_launcher"`` join the
  trainer's world: consecutive ranks form a TP group; the groups generate independently.
- Greedy requests with ``n > 1`` (which vLLM refuses) are sent as ``n`` requests of one sample.
- Sleep mode: on CUDA with ``enable_sleep_mode`` (on by default there) ``sleep()`` releases the KV
  cache only (``sleep_level=0``: the weights stay resident for the next sync to write into), or
  also offloads the weights to the host (``sleep_level=1``, the default) or discards them
  (``sleep_level=2``: the next ``sync_from`` / ``update_weights`` must refill them before
  ``wake_up``, which refuses otherwise). A sync while asleep brings the weights back first and
  writes them; the KV cache returns at ``wake_up``. The memory released and the time each
  transition took are measured (``metrics()``: ``sleep_freed_gib``, ``sleep_s``, ``wake_s``). On
  the CPU it is a no-op: vLLM-CPU has no sleep mode (said once at INFO level).
- LoRA: with ``enable_lora=True``, ``update_lora(peft_model)`` saves the adapter (only the adapter)
  to a private temporary folder and reloads it in place under one ``LoRARequest``; every later
  ``generate`` uses it. Base weights then stay as loaded.
- Lifetime: one engine per process at a time; ``close()`` (or garbage collection) runs vLLM's
  shutdown, which destroys torch.distributed's default group too (see ``close``).
- ``metrics()`` reads vLLM's per-step scheduler stats through a stat logger added to the engine.
  On the CPU vLLM's KV block is 128 tokens unless ``block_size`` is passed, and only full blocks
  are shared, so prompts shorter than a block never hit the prefix cache.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import replace
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from verl_fast.rollout import fp8_sync, vlm_prompts, vlm_weights
from verl_fast.rollout import vllm_compat as compat
from verl_fast.records.generation import GenerationOutput, SamplingSpec, pad_completions
from verl_fast.records.prompts import VisionInputs
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout.vllm_env import IN_PROCESS, configure_vllm_env
from verl_fast.models import vision as vision_model
from verl_fast.models.lora import is_peft
from verl_fast.models.wrapping import hf_module
from verl_fast.ops.reshard.layout import clean_name

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]
LORA_NAME = "verl_fast_actor"
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30

_LIVE: "weakref.WeakSet[VLLMInferenceEngine]" = weakref.WeakSet()  # engines not closed yet


def leave_engines_to_exit() -> None:
    """For a process about to end without the interpreter's teardown (``verl_fast.cli.main.program``):
    cancels the open engines' shutdown at exit. vLLM 0.32 runs it from an exit handler, and for an
    in-process engine it unfreezes the heap and collects it twice (seconds: docs/benchmarks.md) to free
    memory that the process's end frees anyway."""
    for engine in list(_LIVE):
        if engine.llm is not None:
            compat.cancel_shutdown_at_exit(engine.llm)


def check_engine_kwargs(engine_kwargs: Dict[str, Any]) -> None:
    """Refuses speculative and guided decoding (before vLLM is imported, so at config time)."""
    for key in compat.SPECULATIVE_KWARGS:
        if engine_kwargs.get(key) is not None:
            raise ValueError(
                f"speculative decoding ({key}={engine_kwargs[key]!r}) is not supported for RL rollout: "
                "the draft model proposes tokens and the log-probs no longer come from one forward of "
                "the policy being trained; remove it")
    for key in compat.GUIDED_KWARGS:
        if engine_kwargs.get(key) is not None:
            raise ValueError(
                f"guided (structured) decoding ({key}) is not supported for RL rollout: it masks the "
                "policy's distribution, so samples and log-probs are not the policy's; remove it")


def capture_sizes(max_batch: int) -> List[int]:
    """Decode batch sizes to capture CUDA graphs for: vLLM's own stride (1, 2, 4, then multiples of 8,
    of 16 past 256), up to and including ``max_batch``; a batch between two sizes runs padded to the
    next one, a larger one without a graph."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"cudagraph_batch must be an int >= 1, got {max_batch!r}")
    sizes = [s for s in [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_batch, 16)) if s < max_batch]
    return sizes + [max_batch]


def _describe_bytes(per_tag: Dict[str, int]) -> str:
    return ", ".join(f"{n / 2**20:.1f} MiB under '{tag}'" for tag, n in sorted(per_tag.items()))


def _holders() -> str:
    return "; ".join(compat.sleep_allocator_holders()) or "none found"


def _set_aside_leftovers(whose: str, held: Dict[str, int]) -> None:
    """Memory that no running engine owns but vLLM's sleep allocator still books (tensors vLLM's own
    objects keep past a shutdown; on 0.26 a 16-float one held through a cell): named, then taken off
    the books so that the next engine in the process loads."""
    logger.warning("%s left %s on vLLM's sleep-mode allocator, set aside so that a next engine loads; live "
                   "tensors there: %s", whose, _describe_bytes(held), _holders())
    compat.set_aside_sleep_allocations()


def _vllm_in_process(external: bool) -> Any:
    """vLLM, imported set up to run its engine inside this process (``external``: torchrun's external
    launcher, which runs it in each rank's process anyway); one line when the environment says otherwise."""
    if not external and IN_PROCESS not in os.environ:  # nobody chose: this class is the in-process engine
        configure_vllm_env()
    with _collector_paused():
        vllm = compat.import_vllm()
        vllm.LLM  # noqa: B018  (vLLM imports its engine lazily, at the first touch of the name)
    # The modules' objects live as long as the process: out of the collector's sight from here on, as
    # vLLM itself freezes the heap once its engine has started (what the imports left as garbage,
    # ~17k objects, is freed when an engine's shutdown unfreezes the heap).
    gc.freeze()
    if not external and not compat.in_process_mode():
        if os.environ.get(IN_PROCESS) != "0":
            raise RuntimeError(
                f"VLLMInferenceEngine runs vLLM inside this process and needs {IN_PROCESS}=0, but the "
                f"environment has {IN_PROCESS}={os.environ[IN_PROCESS]!r}: unset it or set it to 0 before "
                "the engine is built (verl_fast.rollout.vllm_env.configure_vllm_env() does)")
        raise RuntimeError(
            f"vLLM read {IN_PROCESS} before it was set to 0 (vLLM caches its environment variables once an "
            "engine has started in this process): call verl_fast.rollout.vllm_env.configure_vllm_env() "
            "before the first engine, or vllm.envs.disable_envs_cache() before this one")
    return vllm


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for a stretch of vLLM's start, back as it was after.

    vLLM's imports and engine build leave ~650k long-lived objects: with the collector on, its
    generational passes walk the growing heap ~1,900 times (~3 s of a 13 s start on the CPU) and
    vLLM's own ``gc.collect()`` calls (~0.4 s each) walk all of it again. Paused, and the heap frozen
    once vLLM's modules are in (``_vllm_in_process``), the start takes ~9 s there."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_sleep_allocator(enable_sleep_mode: bool) -> None:
    """On a GPU, a sleep-mode engine loads only into an empty sleep-mode allocator: what engines
    collected without close() left there is set aside; what a live reference still holds is refused,
    naming the holders."""
    compat.collect()  # an earlier engine dropped without close() still holds device memory until then
    held = compat.sleep_allocator_usage()
    if enable_sleep_mode and held and not any(engine.llm is not None for engine in _LIVE):
        _set_aside_leftovers("engines collected without close()", held)
        held = {}
    if enable_sleep_mode and held:
        raise RuntimeError(
            f"an earlier vLLM engine in this process still holds {_describe_bytes(held)} of vLLM's "
            "sleep-mode allocator (something keeps a reference to its model or KV cache); vLLM "
            "loads a sleep-mode engine only into an empty allocator: close() the earlier engine and "
            "drop what refers to its tensors, or pass enable_sleep_mode=False; live tensors there: "
            + _holders())


def _fitted(expected: torch.Tensor, engine: Optional[torch.Tensor]) -> torch.Tensor:
    """``expected`` laid out as the engine's tensor where it can be (else as it is: then it differs)."""
    if engine is None:
        return expected
    fitted = vlm_weights.fit_to_engine(expected.to(engine.device), engine)
    return expected if fitted is None else fitted


class VLLMInferenceEngine(RolloutEngine):
    """``vllm.LLM`` in this process, with in-place weight updates (see the module docstring).

    Keyword arguments map to vLLM's ``EngineArgs`` of the same names; the rest go through
    ``**engine_kwargs``. Defaults that differ from vLLM's: ``gpu_memory_utilization=0.5`` (the actor
    shares the GPU), ``enforce_eager`` on the CPU (no compile step), ``kv_cache_memory_bytes`` 1 GiB on
    the CPU unless ``VLLM_CPU_KVCACHE_SPACE`` is set (vLLM would reserve a large share of host RAM),
    and ``disable_log_stats=False`` (``metrics()`` reads the stats).
    ``kv_cache_memory_bytes``: KV-cache size (bytes) instead of ``gpu_memory_utilization``.
    ``cpu_threads``: on the CPU, torch's intra-op threads while vLLM generates or loads weights
    (the trainer's count is restored after each call; ``None`` leaves it alone). ``"auto"`` (the
    default): this process's share of the cores it may run on (``LOCAL_WORLD_SIZE`` processes share
    them). On a quiet machine every core's thread speeds generation up (docs/benchmarks.md); on a
    machine whose cores other jobs keep busy, OpenMP workers spin-wait for each other and 1 thread can
    be much faster.
    ``enable_chunked_prefill``: off by default on the CPU (a vLLM-CPU 0.32 bug with seeded requests,
    see ``vllm_compat.default_chunked_prefill``), vLLM's default elsewhere.
    ``cudagraph_batch``: the largest decode batch the caller sends; CUDA graphs are captured for the
    sizes up to it only (``capture_sizes``), which shortens the engine's start (vLLM's default list
    goes up to 512 sequences). Ignored when eager or when ``compilation_config`` is given.
    """

    owns_weights = True
    takes_images = True  # a Qwen2-VL / Qwen2.5-VL engine: each prompt's pictures go with its request
    packages = (("vllm", "vllm"),)

    @classmethod
    def check_config(cls, cfg) -> None:
        mode = cfg.trainer.async_mode
        if mode != "off" and cfg.rollout.enable_sleep_mode:
            raise ValueError(f"trainer.async_mode={mode} is not supported with rollout.enable_sleep_mode=true (the "
                             "engine generates while the update runs); set rollout.enable_sleep_mode=false")
        if mode == "full":
            raise ValueError("trainer.async_mode=full is not supported with rollout.type=vllm (its workers decode "
                             "with verl_fast/async_rl/decode.py); use rollout.type=hf or auto")

    @classmethod
    def prepare_process(cls, cfg) -> None:
        configure_vllm_env()  # before vLLM is imported: it reads its variables once

    @classmethod
    def build(cls, cfg, actor, tokenizer, *, model_path=None, autocast_dtype=None, source=None) -> RolloutEngine:
        from verl_fast.rollout.factory import build_vllm

        return build_vllm(cls, cfg, actor, tokenizer, model_path, autocast_dtype, source)

    def __init__(
        self,
        model_name_or_path: Optional[str] = None,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_model_len: Optional[int] = None,
        enable_chunked_prefill: Optional[bool] = None,
        seed: int = 0,
        enforce_eager: Optional[bool] = None,
        kv_cache_memory_bytes: Optional[int] = None,
        enable_sleep_mode: Optional[bool] = None,
        sleep_level: int = 1,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        logprobs_mode: str = "processed_logprobs",
        tokenizer: Optional[str] = None,
        cpu_threads: Union[int, str, None] = "auto",
        cudagraph_batch: Optional[int] = None,
        model_name: Optional[str] = None,
        record_routing: bool = False,
        fp8_weights: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        if (model_name is None) == (model_name_or_path is None):  # model_name: the name user code often passes
            raise TypeError("VLLMInferenceEngine needs the model exactly once: model_name_or_path or model_name")
        model_name_or_path = model_name_or_path or model_name
        check_engine_kwargs(engine_kwargs)
        if isinstance(sleep_level, bool) or sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0 (KV cache only), 1 (KV cache; weights offloaded) or 2 "
                             f"(KV cache and weights discarded), got {sleep_level}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        external = engine_kwargs.get("distributed_executor_backend") == "external_launcher"
        start = time.perf_counter()
        vllm = _vllm_in_process(external)
        self.import_seconds = time.perf_counter() - start  # vLLM's modules (cached after a first engine)
        self.record_routing = record_routing  # MoE: each token's experts per layer (GenerationOutput.routed_experts)
        self.fp8_weights = fp8_weights  # block-FP8 projections, quantised at each sync (rollout/fp8_sync.py)
        if record_routing:
            compat.check_routed_experts()
            engine_kwargs["enable_return_routed_experts"] = True
        on_cpu = compat.is_cpu_platform()
        if enforce_eager is None:
            enforce_eager = on_cpu
        if kv_cache_memory_bytes is None and on_cpu and not compat.kv_cache_space_from_env():
            kv_cache_memory_bytes = CPU_DEFAULT_KV_CACHE_BYTES
        if cpu_threads == "auto":
            cpu_threads = compat.cores_per_local_process()
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int)
                                        or cpu_threads < 1):
            raise ValueError(f"cpu_threads must be an int >= 1, 'auto' or None, got {cpu_threads!r}")
        self._threads = cpu_threads if on_cpu else None
        self._sleep_supported = compat.sleep_mode_available()
        if enable_sleep_mode is None:
            enable_sleep_mode = self._sleep_supported
        if enable_chunked_prefill is None:
            enable_chunked_prefill = compat.default_chunked_prefill()
        elif enable_chunked_prefill and on_cpu:
            logger.warning("enable_chunked_prefill=True on the CPU: vLLM-CPU 0.32 crashes on seeded requests "
                           "whose prompt gets split across steps; leave it unset to have it off")
        if enable_chunked_prefill is not None:
            engine_kwargs["enable_chunked_prefill"] = enable_chunked_prefill
        if enable_lora:
            engine_kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank)
        if cudagraph_batch is not None and not enforce_eager and "compilation_config" not in engine_kwargs:
            engine_kwargs["compilation_config"] = {"cudagraph_capture_sizes": capture_sizes(cudagraph_batch)}
        engine_kwargs.setdefault("disable_log_stats", False)
        engine_kwargs.setdefault("use_tqdm_on_load", False)  # no loading bar beside the trainer's progress bar
        if not on_cpu:
            _check_sleep_allocator(enable_sleep_mode)
        start = time.perf_counter()  # the engine alone: vllm.LLM()
        with _collector_paused(), compat.quiet_numa_notice():
            self.llm = vllm.LLM(
                model=str(model_name_or_path), tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
                dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                kv_cache_memory_bytes=kv_cache_memory_bytes, enable_sleep_mode=enable_sleep_mode,
                logprobs_mode=logprobs_mode, **engine_kwargs)
        self.init_seconds = time.perf_counter() - start
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.external_launcher = external
        self._sync = None  # WeightSync, built at the first sync_from
        self._tower_synced = False  # a vision-language model's vision tower, sent by a sync since the build
        self._placeholders = compat.placeholder_ids(self.llm)  # never sampled (a vision-language model's)
        self.sleep_freed_bytes = 0
        self.dtype = compat.model_dtype(self.llm)  # weights are cast to it on update
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        tok = self._tokenizer = self.llm.get_tokenizer()
        pad = getattr(tok, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (getattr(tok, "eos_token_id", None) or 0)
        self._sleeping: set = set()  # what sleep() released: "kv_cache", "weights"
        self._weights_stale = False  # sleep_level 2 discarded the weights and nothing has refilled them
        self._sleep_s = self._wake_s = None
        self._waking_s = 0.0  # wakes since the last sleep
        self._warned_sleep = False
        self._lora_dir: Optional[str] = None
        self._lora_request = None
        self._submitted = 0  # requests given to submit(), for their ids
        self._streamed: Dict[str, Tuple[str, bool]] = {}  # the engine's request id -> (ours, with log-probs)
        self._last_update_s: Optional[float] = None
        self._stats = compat.attach_stats(self.llm)
        _LIVE.add(self)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: Union[SamplingSpec, Sequence[SamplingSpec], Any, Sequence[Any], None] = None,
        vision: Optional[Sequence[Optional[VisionInputs]]] = None,
    ) -> GenerationOutput:
        """``n`` completions per prompt, grouped by prompt in prompt order (see ``GenerationOutput``).

        ``prompts``: token-id lists (or strings). ``sampling``: one ``SamplingSpec`` (or
        ``vllm.SamplingParams``) for all prompts, or one per prompt; ``None`` means ``SamplingSpec()``.
        ``logprobs`` is filled when every request asks for log-probs (``SamplingSpec.logprobs``, or
        ``SamplingParams.logprobs`` not None), else None. Responses end with their EOS / stop token,
        which the response mask covers; ``texts`` are the responses' strings (special tokens skipped, as
        vLLM's detokeniser writes them; decoded in one batch after generation unless stop strings need
        vLLM's own detokenisation during it).
        ``vision``: a vision-language model's images, one ``VisionInputs`` (or None: a text prompt) per
        prompt, whose token ids hold each image's placeholder expanded (``rollout/vlm_prompts.py``).
        """
        if self._sleeping:
            raise RuntimeError("the engine is asleep: call wake_up() before generate()")
        prompts = list(prompts)
        if vision is not None and len(vision) != len(prompts):
            raise ValueError(f"vision must hold one entry per prompt: {len(prompts)} prompts, {len(vision)} entries")
        requests, owners, textless = [], [], set()  # textless: prompts whose SamplingSpec asks for no texts
        for i, (prompt, spec) in enumerate(zip(prompts, self._per_prompt(sampling, len(prompts)))):
            if isinstance(spec, SamplingSpec) and not spec.detokenize:
                textless.add(i)
            params, copies = self._to_vllm_params(spec)
            request = self._to_vllm_prompt(prompt, i)
            if vision is not None and vision[i] is not None:
                request = vlm_prompts.image_request(request, vision[i], self._image_token(), i)
            requests.extend([(request, params)] * copies)
            owners.extend([i] * copies)
        if not requests:
            return pad_completions([], [], [], self.pad_token_id)
        with compat.torch_threads(self._threads):
            outputs = self.llm.generate([r for r, _ in requests], [p for _, p in requests], use_tqdm=False,
                                        lora_request=self._lora_request)
        want_logprobs = all(p.logprobs is not None for _, p in requests)
        tokens, logprobs, index, texts, reasons, routed = [], [], [], [], [], []
        undecoded = []  # completions of requests without vLLM's detokenisation: decoded below in one call
        for (_, params), owner, out in zip(requests, owners, outputs):
            if vision is not None and vision[owner] is not None:
                vlm_prompts.check_expansion(prompts[owner], out.prompt_token_ids, owner)
            self._stats.count(out)
            for completion in out.outputs:
                tokens.append(list(completion.token_ids))
                if self.record_routing:
                    routed.append(compat.completion_routed_experts(
                        completion, len(out.prompt_token_ids) + len(completion.token_ids)))
                if want_logprobs:
                    logprobs.append(compat.completion_logprobs(completion))
                index.append(owner)
                if not params.detokenize and owner not in textless:
                    undecoded.append(len(texts))
                texts.append(completion.text)
                reasons.append(completion.finish_reason or "length")
        if undecoded:
            decoded = compat.decode_responses(self._tokenizer, [tokens[i] for i in undecoded])
            for i, text in zip(undecoded, decoded):
                texts[i] = text
        return pad_completions(tokens, logprobs if want_logprobs else None, index, self.pad_token_id,
                               texts=texts, finish_reasons=reasons,
                               routed_experts=routed if self.record_routing else None)

    # ------------------------------------------------------------------ one request at a time

    streams = True

    def submit(self, prompt: Prompt, spec: SamplingSpec) -> str:
        """Adds one request (one sample) to the running engine and returns its id at once; ``step``
        runs the engine. Continuous batching across turns: a multi-turn rollout submits a
        trajectory's next turn when its observation is in, while the others decode."""
        if self._sleeping:
            raise RuntimeError("the engine is asleep: call wake_up() before submit()")
        params, _ = self._to_vllm_params(replace(spec, n=1))
        self._submitted += 1
        ours = f"verl_fast-{self._submitted}"
        given = self.llm.llm_engine.add_request(ours, self._to_vllm_prompt(prompt, 0), params,
                                                lora_request=self._lora_request)
        self._streamed[given or ours] = (ours, params.logprobs is not None)
        self._streamed.setdefault(ours, self._streamed[given or ours])
        return ours

    def step(self) -> List[Tuple[str, List[int], Optional[List[float]], str]]:
        """One engine step: ``(request id, tokens, log-probs or None, finish reason)`` of each submitted
        request that finished in it."""
        with compat.torch_threads(self._threads):
            outputs = self.llm.llm_engine.step()
        done = []
        for out in outputs:
            if not out.finished or out.request_id not in self._streamed:
                continue
            ours, with_logprobs = self._streamed.pop(out.request_id)
            self._streamed = {k: v for k, v in self._streamed.items() if v[0] != ours}
            self._stats.count(out)
            completion = out.outputs[0]
            done.append((ours, list(completion.token_ids),
                         compat.completion_logprobs(completion) if with_logprobs else None,
                         completion.finish_reason or "length"))
        return done

    @staticmethod
    def _per_prompt(sampling, count: int) -> List[Any]:
        if sampling is None:
            sampling = SamplingSpec()
        if isinstance(sampling, SamplingSpec) or compat.is_sampling_params(sampling):
            return [sampling] * count
        if not isinstance(sampling, (list, tuple)):
            raise TypeError("sampling must be SamplingSpec or vllm.SamplingParams, or a list of them, "
                            f"got {type(sampling).__name__}")
        if len(sampling) != count:
            raise ValueError(f"sampling must be one spec or one per prompt ({count}), got {len(sampling)}")
        return sampling

    def _to_vllm_params(self, spec):
        """``(vllm.SamplingParams, copies)`` for one prompt; refuses guided decoding. vLLM refuses
        greedy sampling with ``n > 1``, so that becomes ``n`` copies of a one-sample request. A
        vision-language model never samples its image / video placeholders (each in a sequence stands for
        a picture the trainer's passes are given; ``models/vision.placeholder_ids``)."""
        if compat.is_sampling_params(spec):
            field = compat.guided_field(spec)
            if field:
                raise ValueError(
                    f"guided (structured) decoding (SamplingParams.{field}) is not supported for RL "
                    "rollout: it masks the policy's distribution, so samples and log-probs are not the "
                    "policy's")
            return spec, 1
        if not isinstance(spec, SamplingSpec):
            raise TypeError(f"sampling must be SamplingSpec or vllm.SamplingParams, got {type(spec).__name__}")
        spec.validate()
        copies = spec.n if spec.temperature == 0 else 1
        params = compat.sampling_params(
            n=spec.n // copies, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
            max_tokens=spec.max_tokens, stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None, seed=spec.seed,
            logprobs=0 if spec.logprobs else None,
            logit_bias={t: compat.BANNED_LOGIT_BIAS for t in self._placeholders} or None,
            # vLLM detokenises every request at every step on the host (inside the decode loop); without
            # stop strings to match, the texts come from one batch decode after generation instead
            detokenize=bool(spec.stop))
        return params, copies

    def _image_token(self) -> int:
        token = next(iter(self._placeholders), None)
        if token is None:
            raise ValueError("prompts with images need a vision-language model (Qwen2-VL / Qwen2.5-VL); this "
                             "engine's model has no image token")
        return token

    @staticmethod
    def _to_vllm_prompt(prompt: Prompt, i: int):
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        return {"prompt_token_ids": ids}

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors into the running engine in place; drops the prefix cache.

        Accepts a ``state_dict().items()`` of the actor (DTensors of an FSDP2 model are gathered with
        ``full_tensor()``). Tensors of a PEFT model (``lora_A`` / ``base_layer`` names) are refused:
        use ``update_lora``."""
        start = time.perf_counter()
        weights = []
        for name, tensor in named_tensors:
            if ".lora_A." in name or ".lora_B." in name or ".base_layer." in name:
                raise ValueError(f"{name!r} is a PEFT model's tensor: push adapters with "
                                 "update_lora(peft_model), or merge_and_unload() the actor first")
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            tensor = tensor.detach()
            if tensor.is_floating_point() and self.dtype is not None and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)  # e.g. an fp32 actor into a bf16 engine
            weights.append((name, tensor))
        self._wake(["weights"])  # after sleep(): weights must be resident before they are written
        with compat.torch_threads(self._threads):
            compat.reload_weights(self.llm, weights)
        self._weights_stale = False
        self._last_update_s = time.perf_counter() - start

    def sync_from(self, model: torch.nn.Module) -> Dict[str, float]:
        """Pushes ``model``'s current weights (an HF model, FSDP1 or FSDP2, the trainer's Megatron actor;
        a PEFT model's adapter) into the engine in place; collective over the actor's ranks. Returns ``{"bytes": ...}``,
        the bytes this rank received from others. See the module docstring."""
        if is_peft(model):
            self.update_lora(model)
            return {"bytes": 0}
        start = time.perf_counter()
        if self.fp8_weights:
            self._wake(["weights"])
            with compat.torch_threads(self._threads), compat.quiet_reload():
                compat.reload_weights(self.llm, list(fp8_sync.fp8_tensors(model, self.dtype or torch.bfloat16)))
            self._weights_stale = False
            self._last_update_s = time.perf_counter() - start
            return {"bytes": 0}
        if vision_model.is_vision_model(model):
            tensors, tower = self._vision_language_tensors(model)
            self.update_weights(tensors)
            if tower:
                compat.reset_encoder_cache(self.llm)
            return {"bytes": 0}
        if self._sync is None:
            self._sync = self._weight_sync(model)
        self._wake(["weights"])  # after sleep(): weights must be resident before they are written
        if self._sync.direct:
            self._sync.run(model, self._engine_parameters())
            self.llm.reset_prefix_cache()
        else:
            tensors = self._sync.run(model)
            with compat.torch_threads(self._threads), compat.quiet_reload():
                compat.reload_weights(self.llm, tensors.items())
        self._weights_stale = False
        self._last_update_s = time.perf_counter() - start
        return {"bytes": self._sync.received_bytes}

    def _vision_language_tensors(self, model: torch.nn.Module) -> Tuple[Iterator[Tuple[str, torch.Tensor]], bool]:
        """A Qwen2-VL / Qwen2.5-VL actor's HF-named tensors for vLLM's loader (which maps the names:
        ``rollout/vlm_weights.py``): the language model, and the vision tower at the first sync (the
        engine's placeholder weights) or while it trains (``actor.freeze_vision_tower: false``); and
        whether the tower is among them."""
        params = [(clean_name(k), v) for k, v in hf_module(model).named_parameters()]
        tower = not self._tower_synced or any(v.requires_grad for k, v in params if vlm_weights.is_vision(k))
        self._tower_synced = True
        return ((k, v) for k, v in params if tower or not vlm_weights.is_vision(k)), tower

    def _weight_sync(self, model: torch.nn.Module, direct: Optional[bool] = None):
        from verl_fast import distributed
        from verl_fast.ops.reshard import ModelSpec
        from verl_fast.ops.reshard.vllm import consecutive_tp_ranks
        from verl_fast.rollout.weight_sync import WeightSync

        world = distributed.world_size()
        # an external-launcher engine is one TP rank of a group of consecutive ranks; any other
        # engine holds the whole model in this process
        tp = self.tensor_parallel_size if self.external_launcher else 1
        config = getattr(model, "hf_config", None) or hf_module(model).config  # hf_config: a Megatron actor
        spec = ModelSpec.from_hf_config(config, dtype=self.dtype)
        return WeightSync(spec, tp, consecutive_tp_ranks(world, tp), world, self.dtype or spec.dtype,
                          direct=not compat.is_cpu_platform() if direct is None else direct)

    def weight_differences(self, model: torch.nn.Module) -> Optional[List[str]]:
        """The engine's parameter groups (vLLM's names: ``qkv_proj``, ``gate_up_proj`` fused) whose weights are
        not ``model``'s as a sync writes them (the resharding engine's direct layout, in the engine's dtype);
        None for an engine of several processes, a LoRA adapter or FP8 weights."""
        from verl_fast import distributed
        from verl_fast.rollout import sync_check

        if is_peft(model) or self.fp8_weights or distributed.world_size() > 1:
            return None
        self._wake(["weights"])
        engine = self._engine_parameters()
        if vision_model.is_vision_model(model):
            named = ((clean_name(k), v.detach()) for k, v in hf_module(model).named_parameters())
            expected = {k: _fitted(v, engine.get(k)) for k, v in vlm_weights.engine_tensors(named).items()}
        else:
            expected = self._weight_sync(model, direct=True).run(model)
        # vLLM-CPU may repack a linear weight into oneDNN's own buffer and leave the parameter empty
        unreadable = {k for k, v in engine.items() if not v.numel() and expected.get(k, v).numel()}
        groups = sync_check.differing_groups({k: v for k, v in engine.items() if k not in unreadable},
                                             {k: v for k, v in expected.items() if k not in unreadable},
                                             {k: v.dtype for k, v in engine.items()})
        return groups if groups or not unreadable else None

    def _engine_parameters(self) -> Dict[str, torch.Tensor]:
        if not hasattr(self, "_params"):
            self._params = compat.model_parameters(self.llm)
        return self._params

    def update_lora(self, peft_model) -> None:
        """Pushes a PEFT model's adapter: saved to a private folder, reloaded in place in the engine."""
        if not compat.lora_enabled(self.llm):
            raise ValueError("this engine was built without LoRA: pass enable_lora=True (and max_lora_rank)")
        if not is_peft(peft_model):
            raise TypeError(f"update_lora needs a PEFT model (peft.PeftModel), got {type(peft_model).__name__}")
        start = time.perf_counter()
        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="verl_fast_lora_")
        peft_model.save_pretrained(self._lora_dir)
        # the adapter's slots were allocated with the weights: after sleep() they are off the GPU too
        self._wake(["weights"])
        compat.load_lora(self.llm, compat.lora_request(LORA_NAME, 1, self._lora_dir, load_inplace=True))
        self._lora_request = compat.lora_request(LORA_NAME, 1, self._lora_dir)
        self.llm.reset_prefix_cache()
        self._last_update_s = time.perf_counter() - start

    # ------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """Releases the KV cache (and offloads or drops the weights) until ``wake_up``; a logged
        no-op where vLLM has no sleep mode (the CPU) or it was not enabled."""
        if not (self._sleep_supported and self.enable_sleep_mode):
            if not self._warned_sleep:
                why = "this platform has no vLLM sleep mode" if not self._sleep_supported else \
                    "the engine was built with enable_sleep_mode=False"
                logger.info("VLLMInferenceEngine.sleep(): %s; rollout memory stays allocated "
                            "during training", why)
                self._warned_sleep = True
            return
        if self._sleeping:
            return
        start, free = time.perf_counter(), compat.free_device_bytes()
        compat.sleep(self.llm, self.sleep_level)
        self.sleep_freed_bytes = compat.free_device_bytes() - free
        self._sleeping = {"kv_cache", "weights"} if self.sleep_level > 0 else {"kv_cache"}
        self._weights_stale = self.sleep_level == 2
        self._sleep_s = time.perf_counter() - start
        self._wake_s, self._waking_s = self._waking_s, 0.0  # the cycle that ended here

    def wake_up(self) -> None:
        """Brings back what ``sleep`` released; refuses weights that sleep level 2 discarded and no
        sync has refilled since (generation would read whatever the new memory held)."""
        if self._weights_stale:
            raise RuntimeError("sleep_level=2 discarded the engine's weights and nothing has written them "
                               "since: call sync_from(model) or update_weights(...) before wake_up()")
        self._wake(["weights", "kv_cache"])

    def _wake(self, tags: List[str]) -> None:
        tags = [t for t in tags if t in self._sleeping]
        if not tags:
            return
        start = time.perf_counter()
        compat.wake_up(self.llm, self.sleep_level, tags)
        self._sleeping -= set(tags)
        self._waking_s += time.perf_counter() - start  # summed until the next sleep

    # ------------------------------------------------------------------ metrics and shutdown

    def metrics(self) -> Dict[str, float]:
        """vLLM's stats since the last call: ``prefix_cache_hit_rate`` (hit tokens / queried prompt
        tokens; only full KV blocks are cached), ``kv_cache_usage_peak`` (fraction of KV blocks in
        use at the busiest step), ``preempted_requests``, ``generated_tokens``; plus
        ``weight_update_s`` (the last update's seconds), ``sleep_freed_gib`` (device memory the
        last ``sleep`` released; absent where sleep frees nothing), ``sleep_s`` / ``wake_s`` (the
        last sleep's seconds, and those of the wakes between the sleep before it and it: the weights
        before a sync, the KV cache before a rollout)."""
        w = self._stats.take()
        out = {
            "prefix_cache_hit_rate": w["hits"] / w["queries"] if w["queries"] else 0.0,
            "kv_cache_usage_peak": w["peak_kv_usage"],
            "preempted_requests": float(w["preempted"]),
            "generated_tokens": float(w["generated"]),
        }
        if self._last_update_s is not None:
            out["weight_update_s"] = self._last_update_s
        if self.sleep_freed_bytes:
            out["sleep_freed_gib"] = self.sleep_freed_bytes / 2**30
        if self._sleep_s is not None:
            out.update(sleep_s=self._sleep_s, wake_s=self._wake_s)
        return out

    def close(self) -> None:
        """Shuts the engine down and frees its memory.

        vLLM 0.32's in-process shutdown (also run when an un-closed engine is garbage-collected)
        tears down process-wide state: vLLM's parallel groups AND torch.distributed's default group,
        even one the trainer created. So: one engine per process at a time, closed after the
        trainer's last collective (or left to process exit)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        # our references to the engine's parameters go first: vLLM 0.26's sleep-mode allocator refuses
        # a second engine in the process while any memory of the first is still allocated
        self._sync = None
        self.__dict__.pop("_params", None)
        self.llm = None
        compat.shutdown(llm)
        del llm  # the last reference: collect() can free the engine now
        compat.collect()
        held = compat.sleep_allocator_usage() if torch.cuda.is_available() else {}
        if held:
            _set_aside_leftovers("the closed vLLM engine", held)
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None
