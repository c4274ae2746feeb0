"""Where a step's time goes: per-phase wall times, tokens/s per GPU, an MFU estimate of the update
phase and peak GPU memory, as plain numbers in the step's metrics dict.

Keys (all floats): ``time/<phase>`` for generation, reward, old_logprob, ref, values, advantages,
update_actor, update_critic, weight_sync, checkpoint (only the phases a step ran);
``perf/tokens_per_s_per_gpu`` (prompt + response tokens of the step / step time / ranks);
``perf/mfu_update`` (GPU only, device in PEAK_BF16_FLOPS); ``perf/peak_memory_gib`` (GPU only) and
``perf/phase_peak_memory_gib/<phase>`` (the peak while that phase ran: which phase holds the step's);
what can make one step slower than the next: ``perf/gc_s`` and ``perf/gc_collections`` (the cyclic
garbage collector's pauses during the step, generation 2 counted apart in ``perf/gc_full``), and on a
GPU ``perf/cuda_mallocs`` / ``perf/cuda_frees`` (the caching allocator's calls to the driver: growth
and the frees of an out-of-memory retry or ``empty_cache``) and ``perf/alloc_retries``, and
``perf/kernel_compiles`` / ``perf/kernel_compile_s`` (Triton kernels compiled, or loaded from
Triton's disk cache, during the step: a launch with arguments of a new specialization), and
``perf/graph_compiles`` (torch.compile graphs compiled during the step: a recompile for a new shape
or grad mode of ``actor.compile_blocks`` or the compiled decode; Inductor's kernels do not pass
through the Triton hooks above).

GPU work is asynchronous: a phase's time is taken between two device synchronisations, one at each
phase boundary (never inside a phase), so each phase is charged the GPU work it queued.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional

import torch

# Dense bf16 tensor-core peak per device (no sparsity), by a substring of the device name; the
# first match wins, so longer names come first.
PEAK_BF16_FLOPS = (
    ("GH200", 989e12), ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("H20", 148e12),
    ("B200", 2250e12), ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
    ("L40", 181e12), ("L4", 121e12), ("A10", 125e12),
)


def peak_bf16_flops(device: torch.device) -> Optional[float]:
    """The device's dense bf16 peak in FLOP/s, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def update_flops(num_params: int, num_layers: int, attn_width: int, tokens: float, pairs: float,
                 trained: Optional[int] = None) -> float:
    """Forward + backward FLOPs of training on ``tokens`` tokens whose queries attend ``pairs``
    query-key pairs in all (causal: a sequence of n tokens has n (n + 1) / 2): per token 2 per
    parameter forward, 2 for the input gradients backward and 2 per ``trained`` parameter (all of them
    when None) for the weight gradients (6 per parameter training all; a LoRA run's frozen base: 4),
    and per pair the score and value products (2 matmuls of ``attn_width``, x3 for the backward)."""
    trained = num_params if trained is None else trained
    return float((4.0 * num_params + 2.0 * trained) * tokens + 12.0 * num_layers * attn_width * pairs)


_GC = {"s": 0.0, "n": 0, "full": 0, "start": 0.0}


def _time_gc(phase: str, info: Dict[str, int]) -> None:
    if phase == "start":
        _GC["start"] = time.perf_counter()
        return
    _GC["s"] += time.perf_counter() - _GC["start"]
    _GC["n"] += 1
    _GC["full"] += info.get("generation") == 2


_JIT = {"s": 0.0, "n": 0, "start": 0.0}


def _count_kernel_compiles() -> None:
    """Chains a counter onto Triton's compile hooks (once per process; hooks already set keep running)."""
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one before 3.4 (no hooks to chain onto)
        return
    runtime = getattr(knobs, "runtime", None)
    if not (hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")):
        return
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    if getattr(before, "_verl_fast", False):
        return

    def starting(**kwargs):
        _JIT["start"] = time.perf_counter()
        return before(**kwargs) if before is not None else None  # True from a hook skips the compile

    def done(**kwargs):
        _JIT["n"] += 1
        _JIT["s"] += time.perf_counter() - _JIT["start"]
        return after(**kwargs) if after is not None else None

    starting._verl_fast = True
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = starting, done


def _allocator_calls(device: torch.device) -> Dict[str, float]:
    stats = torch.cuda.memory_stats(device)
    return {"perf/cuda_mallocs": stats.get("num_device_alloc", 0), "perf/cuda_frees": stats.get("num_device_free", 0),
            "perf/alloc_retries": stats.get("num_alloc_retries", 0)}


def _graph_compiles() -> int:
    """torch.compile's count of graphs compiled in this process (0 while nothing imported dynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


class StepPerf:
    """Times one step's phases and gathers the figures above. One instance per trainer; ``begin``
    at the start of each step, ``phase(name)`` around each phase, ``figures`` at its end."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.peak = peak_bf16_flops(device)
        # DTensor parameters (FSDP2) report their global size; frozen ones (a LoRA base) take part in the
        # forward and the input gradients but have no weight gradients
        self.num_params = sum(p.numel() for p in model.parameters())
        self.trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        cfg = getattr(getattr(model, "module", model), "config", None)
        self.num_layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
        heads = getattr(cfg, "num_attention_heads", 0) or 0
        head_dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // max(heads, 1))
        self.attn_width = int(heads * head_dim)
        if _time_gc not in gc.callbacks:
            gc.callbacks.append(_time_gc)
        if device.type == "cuda":
            _count_kernel_compiles()
        # name -> a context manager around each timed phase (the trainer's watchdog), or None
        self.watch: Optional[Callable[[str], ContextManager[Any]]] = None
        self.begin()

    def begin(self) -> None:
        self.times: Dict[str, float] = {}
        self.tokens = 0.0
        self.flops = 0.0
        self._gc_before = dict(_GC)
        self._jit_before = dict(_JIT)
        self._graphs_before = _graph_compiles()
        self.phase_peaks: Dict[str, int] = {}  # bytes, per phase name
        self._open: List[str] = []  # the phases running now, outermost first
        self._step_peak = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._allocator_before = _allocator_calls(self.device)

    def _fold_peak(self) -> None:
        """The allocator's peak since its last reset, into the step's and each open phase's."""
        peak = torch.cuda.max_memory_allocated(self.device)
        self._step_peak = max(self._step_peak, peak)
        for name in self._open:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), peak)

    def _sync(self) -> None:
        if self.device.type == "cuda":  # this thread's stream only: an async rollout decodes on its own
            torch.cuda.current_stream(self.device).synchronize()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block; on a GPU also its peak memory (the allocator's peak is reset at each phase's
        start, after folding what came before into the step's and the enclosing phases')."""
        self._sync()
        cuda = self.device.type == "cuda"
        if cuda:
            self._fold_peak()
            torch.cuda.reset_peak_memory_stats(self.device)
        self._open.append(name)
        start = time.perf_counter()
        try:
            with self.watch(name) if self.watch is not None else contextlib.nullcontext():
                yield
        finally:
            self._sync()
            key = f"time/{name}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start
            if cuda:
                self._fold_peak()
            self._open.remove(name)

    def count_step_tokens(self, attention_mask: torch.Tensor) -> None:
        """Prompt + response tokens of this rank's sequences ([N, T] 0/1 mask)."""
        self.tokens += float(attention_mask.sum())

    def count_update(self, tokens: float, pairs: float) -> None:
        """One forward + backward in the actor update that ran ``tokens`` tokens attending ``pairs``
        query-key pairs (what the passes ran: a shared prompt counts once, padding not at all)."""
        self.flops += update_flops(self.num_params, self.num_layers, self.attn_width, tokens, pairs, self.trained)

    def figures(self) -> Dict[str, float]:
        """Phase times, update MFU and peak memory of this rank; call before the ranks' metrics are
        averaged (the averages are then per-GPU figures)."""
        out = dict(self.times)
        update = self.times.get("time/update_actor")
        if self.peak and update and self.flops:
            out["perf/mfu_update"] = self.flops / update / self.peak
        if self.device.type == "cuda":
            self._fold_peak()
            out["perf/peak_memory_gib"] = self._step_peak / 2**30
            out.update({f"perf/phase_peak_memory_gib/{name}": peak / 2**30 for name, peak in self.phase_peaks.items()})
            out.update({k: float(v - self._allocator_before[k]) for k, v in _allocator_calls(self.device).items()})
        out["perf/tokens"] = self.tokens
        out["perf/gc_s"] = _GC["s"] - self._gc_before["s"]
        out["perf/gc_collections"] = float(_GC["n"] - self._gc_before["n"])
        out["perf/gc_full"] = float(_GC["full"] - self._gc_before["full"])
        out["perf/graph_compiles"] = float(_graph_compiles() - self._graphs_before)
        if self.device.type == "cuda":
            out["perf/kernel_compiles"] = float(_JIT["n"] - self._jit_before["n"])
            out["perf/kernel_compile_s"] = _JIT["s"] - self._jit_before["s"]
        return out


def throughput(metrics: Dict[str, float]) -> Dict[str, float]:
    """``perf/tokens_per_s_per_gpu`` from the (rank-averaged) token count and the step's time."""
    step = metrics.get("time/step")
    tokens = metrics.get("perf/tokens")
    if not step or tokens is None:
        return {}
    return {"perf/tokens_per_s_per_gpu": tokens / step}
