"""Rollout with Hugging Face ``generate`` on the actor itself (no second copy of the weights)."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from verl_fast.distributed import MEMORY_FRACTION, collective_device, usable_bytes
from verl_fast.models import routing, vision as vision_model, vision_attention
from verl_fast.models.wrapping import hf_module, is_sharded
from verl_fast.records.generation import GenerationOutput, SamplingSpec, pad_completions, texts_of
from verl_fast.rollout import decode_memory, fp8_linear, hf_decode, kv_turns, static_kv, sync_check
from verl_fast.rollout.base import RolloutEngine

logger = logging.getLogger(__name__)
FAST_DECODE = ("auto", "on", "off")


def eos_token_ids(model, tokenizer) -> List[int]:
    """The ids that end a response: the model's generation config's EOS ids, then the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _fsdp1(model) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDP) for m in model.modules())


def _full_params(model):
    """Whole parameters for the length of a ``generate`` call on a sharded actor. Ranks decode for
    different numbers of steps (their sequences end at different times), so no collective may run
    inside: FSDP1 summons the full parameters; FSDP2 modules are unsharded once and kept so."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    if isinstance(model, FSDP):
        return _summoned(model, FSDP)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return _unsharded(modules) if modules else contextlib.nullcontext()


def _routes(recorded: torch.Tensor, grouped, prompts, width: int, n: int) -> List[List[torch.Tensor]]:
    """Per prompt and sample, ``[prompt + response tokens, layers, k]`` experts from the decoding rows'
    ``recorded [rows, width + steps, layers, k]`` (prompts left-padded to ``width``; response token t was
    fed at step t + 1, so the last one has none: -1)."""
    out = []
    for i, samples in enumerate(grouped):
        per_sample = []
        for j, (toks, _, _) in enumerate(samples):
            row = recorded[i * n + j]
            seq = torch.full((len(prompts[i]) + len(toks),) + tuple(row.shape[1:]), routing.UNRECORDED,
                             dtype=row.dtype)
            have = min(row.shape[0], width + len(toks)) - (width - len(prompts[i]))
            seq[:have] = row[width - len(prompts[i]) : width - len(prompts[i]) + have]
            per_sample.append(seq)
        out.append(per_sample)
    return out


@contextlib.contextmanager
def _summoned(model, fsdp_cls):
    """FSDP1: the full parameters summoned once, and inside, each FSDP unit's forward runs its wrapped
    module directly. FSDP1's own forward would all-gather and reshard again at every call; with flat
    parameters (``use_orig_params=False``) that reshard frees the storage of the summoned views, and
    the summon's exit then fails ("Expects tensor to be unsharded")."""
    units = [m for m in model.modules() if isinstance(m, fsdp_cls)]
    with fsdp_cls.summon_full_params(model, writeback=False, recurse=True):
        for unit in units:
            unit.forward = unit.module.forward  # an instance attribute: nn.Module.__call__ finds it first
        try:
            yield
        finally:
            for unit in units:
                del unit.forward


@contextlib.contextmanager
def _unsharded(modules):
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    for m in modules:
        m.unshard()  # one all-gather per module, the same on every rank
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


@dataclass(frozen=True)
class _Held:
    """What a decode call reads off the model, read once by ``HFGenerateEngine.holding`` for the calls inside."""

    module: torch.nn.Module  # the held model
    device: torch.device  # HFGenerateEngine.device
    sharded: bool  # is_sharded
    unsupported: Optional[str]  # why the static-cache loop cannot decode it (_model_unsupported)
    walked: hf_decode.Walked  # its FSDP2 modules and weights' addresses, the compiled loop's copies swapped in


class HFGenerateEngine(RolloutEngine):
    """Hugging Face decoding on the actor itself over left-padded prompt batches, one call per
    distinct sampling spec.

    ``fast_decode``: ``on`` decodes with verl_fast.rollout.hf_decode (static KV cache, the whole
    batch at once, no host sync per token; on a GPU each token's step is a replayed CUDA graph);
    ``off`` calls ``model.generate`` in chunks of ``max_batch_size`` sequences; ``auto`` is ``on``
    on a GPU. Models the loop cannot serve (another attention implementation, extra logits
    processors in their generation_config) and stop strings go to ``generate``, and so does any
    later call once the loop has failed (the reason is logged). Both give the same distribution.
    ``compile_decode``: the loop's decode steps run their forward compiled by torch.compile
    (``hf_decode.CompiledForward``; an unsharded actor only), compiled at the first rollout of
    each batch shape. ``compact_rows``: finished rows leave the loop's batch (``hf_decode.decode``'s
    ``min_rows``); ``auto`` is ``off`` on a GPU, where a step's time barely falls with its rows.
    ``fused_kernels``: the loop's decode steps run its fused Triton kernels (``hf_decode.decode``'s
    ``fused``: rotary + cache write, and the sampling tail, each one kernel); ``auto`` is ``on`` on a GPU,
    ``off`` (the default) the torch / Inductor forms.

    Log-probs of the sampled tokens come from the raw logits divided by the temperature (what the
    trainer's log-prob pass computes), not from the top-k/top-p-filtered scores.
    """

    owns_weights = False
    takes_images = True  # the prefill takes the images' pixel values and grids
    waves_by_default = True  # a call pads its batch to the longest prompt and decodes to the longest response

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.rollout.quantization not in (None, "fp8"):
            raise ValueError(f"rollout.quantization={cfg.rollout.quantization} is not supported with rollout.type=hf "
                             "(generate runs the actor's own weights); use rollout.type=vllm, or quantization fp8")
        if cfg.rollout.kv_cache_dtype != "auto":
            raise ValueError(f"rollout.kv_cache_dtype={cfg.rollout.kv_cache_dtype} is not supported with "
                             "rollout.type=hf (its static KV cache is in the actor's dtype); use rollout.type=vllm")

    @classmethod
    def build(cls, cfg, actor, tokenizer, *, model_path=None, autocast_dtype=None, source=None) -> "HFGenerateEngine":
        """Decoding on ``actor`` itself (``model_path`` and ``source`` are not needed: nothing to sync)."""
        from verl_fast.rollout.factory import compiles_decode

        cls.check_config(cfg)
        return cls(actor, tokenizer, autocast_dtype=autocast_dtype, fast_decode=cfg.rollout.hf_fast_decode,
                   record_routing=cfg.rollout.record_routing or cfg.actor.routing_replay,
                   compile_decode=compiles_decode(actor, cfg.rollout.hf_compile_decode),
                   quantization=cfg.rollout.quantization, compact_rows=cfg.rollout.hf_compact_rows,
                   fused_kernels=cfg.rollout.hf_fused_kernels)

    def __init__(self, model, tokenizer, max_batch_size: int = 64, autocast_dtype: Optional[torch.dtype] = None,
                 fast_decode: str = "auto", record_routing: bool = False, compile_decode: bool = False,
                 quantization: Optional[str] = None, compact_rows: str = "auto", fused_kernels: str = "off"):
        for name, value in (("fast_decode", fast_decode), ("compact_rows", compact_rows),
                            ("fused_kernels", fused_kernels)):
            if value not in FAST_DECODE:
                raise ValueError(f"{name} must be one of {list(FAST_DECODE)}, got {value!r}")
        if fused_kernels == "on" and hf_decode.decode_sampling is None:
            raise ValueError("fused_kernels=on needs Triton (rollout.hf_fused_kernels); use auto or off")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.autocast_dtype = autocast_dtype
        self.fast_decode = fast_decode
        self.compact_rows = compact_rows
        self.fused_kernels = fused_kernels
        # MoE: each sequence's experts per token and layer, from hooks on the routers (models.routing)
        self.record_routing = record_routing
        if record_routing and not routing.routers(hf_module(model)):
            raise ValueError("record_routing needs a mixture-of-experts model (Qwen2-MoE / Qwen3-MoE); this one "
                             "has no top-k routers")
        self.fast_failed: Optional[str] = None
        self.vision_language = vision_model.is_vision_model(model)
        self._told: set = set()  # the reasons already logged for decoding through generate
        self.last_mode: Optional[str] = None  # how the last call decoded: graph, eager or generate
        self._last: Dict[str, float] = {}  # the loop's figures since metrics() last read them, summed over calls
        self._call: Dict[str, float] = {}  # the same since call_metrics() last read them
        self._figures_lock = threading.Lock()  # an async rollout decodes while the trainer reads them
        self._held = threading.local()  # .module: the model ``holding`` keeps entered on this thread
        self._graphs = hf_decode.GraphPool()  # the decode graph's memory, reused by the next call's graph
        self._compiled = hf_decode.CompiledForward() if compile_decode else None
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or fp8 for the HF engine, got {quantization!r}")
        if quantization and is_sharded(model):
            raise ValueError("rollout.quantization=fp8 with rollout.type=hf needs an unsharded actor (one process)")
        # rollout.quantization fp8: the decoder's linear layers run on FP8 copies (rollout/fp8_linear.py)
        self._fp8 = fp8_linear.FP8Decode() if quantization == "fp8" else None
        if self.pad_token_id is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token")

    def settings(self) -> dict:
        """The keyword arguments that build this engine's twin over another model (the asynchronous
        modes' rollout copies decode as the trainer's engine does)."""
        return {"max_batch_size": self.max_batch_size, "autocast_dtype": self.autocast_dtype,
                "fast_decode": self.fast_decode, "compile_decode": self._compiled is not None,
                "quantization": "fp8" if self._fp8 is not None else None, "compact_rows": self.compact_rows,
                "fused_kernels": self.fused_kernels}

    def _module(self):
        return hf_module(self.model)  # FSDP1 / DDP keep the HF model in .module

    def weight_differences(self, model: torch.nn.Module) -> Optional[List[str]]:
        """None differ where the engine decodes with ``model`` itself; else the groups of its own copy
        (e.g. the HF model a Megatron actor exports to) that differ from ``model``'s."""
        mine, theirs = self._module(), hf_module(model)
        if mine is theirs:
            return [] if self._fp8 is None else self._fp8.weight_differences(theirs)
        if is_sharded(self.model) or is_sharded(model):
            return None
        engine = dict(mine.named_parameters())
        return sync_check.differing_groups(engine, dict(theirs.named_parameters()),
                                           {k: v.dtype for k, v in engine.items()})

    @property
    def device(self) -> torch.device:
        held = self._held_facts()
        if held is not None:
            return held.device
        if is_sharded(self.model):  # shards may be offloaded to the CPU: compute runs where collectives do
            return collective_device()
        return next(self._module().parameters()).device

    def _held_facts(self, module=None) -> Optional["_Held"]:
        """What ``holding`` read off the model it holds on this thread (of ``module``, where given), else None."""
        held = getattr(self._held, "facts", None)
        return held if held is not None and (module is None or held.module is module) else None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Union[SamplingSpec, Sequence[SamplingSpec]],
                 vision: Optional[Sequence[Optional[Any]]] = None) -> GenerationOutput:
        """``vision``: each prompt's images (``VisionInputs``, None for a text prompt) for a
        vision-language actor (the images go through the prefill; the decode steps are text only)."""
        specs = [sampling] * len(prompts) if isinstance(sampling, SamplingSpec) else list(sampling)
        if len(specs) != len(prompts):
            raise ValueError(f"one sampling spec per prompt expected: {len(prompts)} prompts, {len(specs)} specs")
        for spec in specs:
            spec.validate()
        # generate() samples from the global RNG: seed it once per call (per-request seeds would
        # force one generate call per prompt), and batch the prompts whose other settings agree.
        seeds = [s.seed for s in specs if s.seed is not None]
        if seeds:
            torch.manual_seed(seeds[0])
        groups: Dict[SamplingSpec, List[int]] = {}
        served: Dict[Tuple[str, ...], bool] = {}  # whether the loop serves a spec, by its stop strings
        for i, spec in enumerate(specs):
            if spec.stop not in served:  # (what ``_fast_reason`` reads of a spec: a call's hundreds share it)
                served[spec.stop] = self._fast_reason(spec) is None
            groups.setdefault(self._batch_key(spec, served[spec.stop]), []).append(i)
        results: Dict[int, List[Tuple[List[int], List[float], str]]] = {}
        routes: Dict[int, List[torch.Tensor]] = {}
        for members in groups.values():
            # one call for the group: as many samples as its largest n per prompt at most, to its longest limit
            spec = replace(specs[members[0]], seed=None, n=max(specs[i].n for i in members),
                           max_tokens=max(specs[i].max_tokens for i in members))
            # the static-cache loop takes the whole group at once (its batch is the point), as far as the
            # GPU's memory holds it
            per_call = (self._fast_prompts_per_call(prompts, members, spec) if self._fast_reason(spec) is None
                        else max(1, self.max_batch_size // spec.n))
            for start in range(0, len(members), per_call):
                chunk = members[start : start + per_call]
                grouped, routed = self._generate([prompts[i] for i in chunk], spec,
                                                 None if vision is None else [vision[i] for i in chunk],
                                                 counts=[specs[i].n for i in chunk],
                                                 caps=[specs[i].max_tokens for i in chunk])
                for k, i in enumerate(chunk):
                    results[i] = grouped[k]
                    if routed is not None:
                        routes[i] = routed[k]
        completions, logprobs, index, reasons, routed_all = [], [], [], [], []
        for i in range(len(prompts)):
            for j, (toks, lps, reason) in enumerate(results[i]):
                completions.append(toks)
                logprobs.append(lps)
                index.append(i)
                reasons.append(reason)
                if self.record_routing:
                    routed_all.append(routes[i][j])
        wanted = [k for k, i in enumerate(index) if specs[i].detokenize]
        texts = [""] * len(completions)
        for k, text in zip(wanted, texts_of(self.tokenizer, [completions[k] for k in wanted])):
            texts[k] = text
        return pad_completions(completions, logprobs, index, self.pad_token_id, texts, reasons,
                               routed_all if self.record_routing else None)

    def _batch_key(self, spec: SamplingSpec, served: bool) -> SamplingSpec:
        """The settings that put requests in one call: all but the seed (the call seeds once) and whether the
        texts are wanted (decoded after the call, sample by sample); where the
        static-cache loop serves them (without expert routes recorded), all but the samples per prompt and the
        token limit too, since its rows are any prompts' samples and a row's tokens past its own limit are cut.
        A partial rollout's round (fresh prompts with n samples beside carried samples with n = 1, each with
        the tokens it has left) is then one call, not one per limit, each decoding its own longest row.
        ``served``: the static-cache loop serves ``spec`` (``_fast_reason`` None)."""
        if self.record_routing or not served:
            return replace(spec, seed=None, detokenize=True)
        return replace(spec, seed=None, detokenize=True, n=1, max_tokens=1)

    def _fast_prompts_per_call(self, prompts: Sequence[Sequence[int]], members: List[int], spec: SamplingSpec) -> int:
        """How many of a sampling group's prompts the static-cache loop decodes at once: all of them, or on
        a GPU as many as its room holds (``decode_memory.bytes_per_prompt``; a greedy prompt decodes once; a
        mixed group, ``_batch_key``, counted at its largest sample count and limit, ``spec``'s).
        Where that cuts the group, the sampled values differ from an uncut call's (one draw sequence per
        call), never their distribution."""
        room = self._room_bytes()
        if room is None:
            return len(members)
        step = hf_decode.CompiledForward.WIDTH  # the compiled loop pads prompts to a multiple of it
        width = -(-max(len(prompts[i]) for i in members) // step) * step
        rows = 1 if spec.temperature == 0.0 else spec.n
        element = self.kv_element_bytes()
        config = self._module().config
        fits = decode_memory.prompts_per_call(config, width, spec.max_tokens, rows, len(members), room, element)
        if fits < len(members):
            per_prompt = decode_memory.bytes_per_prompt(config, width, spec.max_tokens, rows, element)
            logger.info("HF decode: %d of %d prompts per call (%.1f GiB of room at %.0f MiB a prompt)", fits,
                        len(members), room / 2**30, per_prompt / 2**20)
        return fits

    def kv_element_bytes(self) -> int:
        """Bytes of one element of the loop's cache: the autocast dtype's keys and values (StaticKV), else
        the model's."""
        if self.autocast_dtype is not None:
            return torch.empty((), dtype=self.autocast_dtype).element_size()
        return next(self._module().parameters()).element_size()

    def turn_cache(self) -> Optional["kv_turns.TurnCache"]:
        """A multi-turn rollout's cache of each conversation's keys and values between turns
        (``rollout/kv_turns.py``), where the static-cache loop decodes; else None."""
        if self.vision_language or self._fast_reason(SamplingSpec()) is not None:  # (a later turn: no images)
            return None
        return kv_turns.TurnCache(self, eos_token_ids(self._module(), self.tokenizer))

    def _room_bytes(self) -> Optional[float]:
        """The device bytes the loop's rows may take (None off a GPU: no limit): ``MEMORY_FRACTION`` of what
        this process may still allocate and its allocator holds unused, less the bf16 copies a compiled
        loop keeps (counted whether made yet or not)."""
        device = self.device
        if device.type != "cuda":
            return None
        room = MEMORY_FRACTION * usable_bytes(device)
        if self._compiled is not None:
            room -= 2 * sum(p.numel() for p in self._module().parameters())
        return max(room, 0.0)

    def _fast_reason(self, spec: SamplingSpec) -> Optional[str]:
        """Why this call goes to ``generate`` rather than the static-cache loop (None: it does not). Of the
        spec it reads the stop strings only (``generate`` asks once per distinct value)."""
        kind = self.device.type if self.fast_decode == "auto" else None
        if self.fast_decode == "off" or (kind is not None and kind != "cuda"):
            return f"fast_decode={self.fast_decode}" + (f" on {kind}" if kind else "")
        if self.fast_failed:
            return self.fast_failed
        if self.record_routing:  # the routers' hooks must run at every step (a replayed CUDA graph runs none)
            return "record_routing"
        if spec.stop:
            return "stop strings"
        held = self._held_facts()
        return held.unsupported if held is not None else self._model_unsupported()

    def _model_unsupported(self) -> Optional[str]:
        """Why the model cannot use the static-cache loop (None: it can)."""
        return ((self.vision_language and vision_model.decode_unsupported(self._module()))
                or hf_decode.unsupported(self._module()))

    @torch.no_grad()
    def _generate(self, prompts: List[Sequence[int]], spec: SamplingSpec,
                  vision: Optional[Sequence[Optional[Any]]] = None, counts: Optional[List[int]] = None,
                  caps: Optional[List[int]] = None) -> List[List[Tuple[List[int], List[float], str]]]:
        """Per prompt, its samples (tokens, log-probs, reason). ``counts`` / ``caps``: each prompt's samples and
        token limit where they differ (``_batch_key``: the static-cache loop's calls; ``spec`` then holds
        their largest); by default ``spec.n`` and ``spec.max_tokens`` for every prompt."""
        counts = counts or [spec.n] * len(prompts)
        caps = caps or [spec.max_tokens] * len(prompts)
        uniform = len(set(counts)) == 1
        if self._fast_reason(spec) is not None and not (uniform and len(set(caps)) == 1):
            return self._generate_each(prompts, spec, vision, counts, caps)  # the loop failed since the grouping
        module = self._module()
        device = self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            if len(p):
                ids[row, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                mask[row, width - len(p):] = 1
        eos = eos_token_ids(module, self.tokenizer)
        greedy = spec.temperature == 0.0
        copies = spec.n if greedy else 1  # greedy samples are identical: decode once, copy n times
        # the rows each prompt decodes, and each decoded row's copies in the output
        decoded = torch.tensor([1 if greedy else n for n in counts])
        copied = torch.tensor(counts if greedy else [1] * sum(counts))
        recording = routing.record(module) if self.record_routing else contextlib.nullcontext()
        with self.decoding(module), recording as rec:
            new, logp, self.last_mode = self.decode_fast(module, ids, mask, spec, eos, copies, vision=vision,
                                                         counts=None if uniform else decoded)
            if new is None:  # (``_batch_key`` and the check above: generate's calls are uniform)
                images = {} if vision is None else vision_model.image_inputs(module, ids.to(device), vision)
                new, logp = self._decode_generate(module, ids, mask, spec, eos, copies, images)
                self.last_mode = "generate"
        if not spec.logprobs:
            logp = None
        elif logp is not None:
            logp = logp.repeat_interleave(copied, dim=0)
        rows = new.shape[0]
        new = new.repeat_interleave(copied, dim=0)
        owners = torch.arange(len(prompts)).repeat_interleave(torch.tensor(counts)).tolist()
        grouped = self._split(new, logp, prompts, spec, eos, owners, caps)
        if rec is None:
            return grouped, None
        return grouped, _routes(rec.stacked(rows).repeat_interleave(copied, dim=0), grouped, prompts, width, spec.n)

    def _generate_each(self, prompts, spec: SamplingSpec, vision, counts: List[int], caps: List[int]):
        """``_generate`` of a mixed call through ``generate``: one call per samples-and-limit pair."""
        grouped: List[Any] = [None] * len(prompts)
        pairs: Dict[Tuple[int, int], List[int]] = {}
        for i, pair in enumerate(zip(counts, caps)):
            pairs.setdefault(pair, []).append(i)
        for (n, cap), members in pairs.items():
            part, _ = self._generate([prompts[i] for i in members], replace(spec, n=n, max_tokens=cap),
                                     None if vision is None else [vision[i] for i in members])
            for i, samples in zip(members, part):
                grouped[i] = samples
        return grouped, None

    @contextlib.contextmanager
    def decoding(self, module):
        """What a decode of ``module`` (the engine's model) runs under: eval mode, whole parameters, the FP8
        copies (rollout.quantization fp8), the autocast dtype and a vision tower's batched segment attention
        (``models/vision_attention``). Inside ``holding(module)`` on the same thread: nothing more (entered)."""
        if getattr(self._held, "module", None) is module:
            yield
            return
        was_training = module.training
        module.eval()
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype is not None
                    else contextlib.nullcontext())
        try:
            fp8 = self._fp8.swapped(module) if self._fp8 is not None else contextlib.nullcontext()
            with _full_params(self.model), fp8, autocast, vision_attention.batched(module):
                yield
        finally:
            module.train(was_training)

    @contextlib.contextmanager
    def holding(self, module):
        """``decoding(module)`` and, where the loop decodes compiled, its weight copies (``CompiledForward.
        weights``), entered once for the many decode calls of a multi-turn rollout (``kv_turns.TurnCache.hold``)
        rather than at each, and what a call reads off the model (``_Held``: its device, whether it is sharded,
        whether the loop serves it, its FSDP2 modules and its weights' addresses) read once: the walks over the
        model's modules and the copies of its weights are a turn's host time otherwise. The calls inside, on this
        thread, find them entered; the weight swap is the module's own, seen from every thread, so no other
        thread decodes ``module`` while it is held."""
        sharded = is_sharded(self.model)
        compiled = self._compiled if self._compiled is not None and not sharded else None
        with self.decoding(module):
            self._held.module = module
            try:
                with compiled.weights(module) if compiled is not None else contextlib.nullcontext():
                    # what each call would read off the model again, read once: it stays as it is while held
                    self._held.facts = _Held(module, self.device, sharded, self._model_unsupported(),
                                             hf_decode.Walked.of(module))
                    yield
            finally:
                self._held.module = self._held.facts = None

    def call_metrics(self) -> dict:
        """The loop's figures since ``call_metrics`` last read them (read after each call: that call's),
        which it hands over: ``metrics``' keys bar ``cuda_graph``."""
        with self._figures_lock:
            figures, self._call = self._call, {}
        return figures

    def decode_fast(self, module, ids, mask, spec: SamplingSpec, eos: List[int], copies: int,
                    past: Optional[static_kv.Past] = None, keep: Optional[list] = None,
                    vision: Optional[Sequence[Optional[Any]]] = None, reuse: Any = None, columns: int = 0,
                    stamps: Optional[Dict[str, float]] = None, counts: Optional[torch.Tensor] = None):
        """(new tokens, log-probs, mode) on the host from hf_decode, or Nones where it does not apply (the
        reason logged once). ``past`` / ``keep`` / ``reuse`` / ``columns`` / ``stamps``: a conversation's next turn
        (``hf_decode.decode``; its rows not compacted). ``vision``: a vision-language actor's prompts' images
        (None a text prompt). ``counts``: the rows each prompt decodes, in prompt order (None: ``spec.n //
        copies`` each)."""
        per_prompt = counts if counts is not None else spec.n // copies
        reason = self._fast_reason(spec)
        if reason is not None:
            if reason not in self._told:
                self._told.add(reason)
                logger.info("HF rollout decodes through generate: %s", reason)
            return None, None, None
        device = self.device
        held = self._held_facts(module)
        sharded = held.sharded if held is not None else is_sharded(self.model)
        rows, images = None, None
        if self.vision_language:  # each prompt prefilled once with its own images
            images = self._images(module, ids.to(device), mask.to(device), vision)
            rows = torch.arange(ids.shape[0]).repeat_interleave(per_prompt)
        elif past is None:  # each distinct prompt prefilled once (a prompt's samples, a trajectory's first turn),
            width = ids.shape[1]  # its cache copied to the rows that decode it
            distinct, prompt_of = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
            ids, mask, rows = distinct[:, :width], distinct[:, width:], prompt_of.repeat_interleave(per_prompt)
        times: Dict[str, float] = {}
        captures = self._graphs.captures
        try:
            out = hf_decode.decode(
                module, ids.to(device), mask.to(device), spec.max_tokens,
                spec.temperature, spec.top_k, spec.top_p, list(eos) + list(spec.stop_token_ids), self.pad_token_id,
                use_graph=device.type == "cuda" and not _fsdp1(self.model), graphs=self._graphs,
                compiled=self._compiled if not sharded else None,
                rows=None if rows is None else rows.to(device),
                min_rows=None if keep is not None else self._min_rows(device), past=past, keep=keep, images=images,
                fused=self.fused_kernels == "on" or (self.fused_kernels == "auto" and device.type == "cuda"
                                                     and hf_decode.decode_sampling is not None), times=times,
                reuse=reuse, columns=columns, stamps=stamps, walked=held.walked if held is not None else None)
            times["graph_captures"] = float(self._graphs.captures - captures)
            times["decode_calls"] = 1.0
            with self._figures_lock:
                for figures in (self._last, self._call):  # summed until metrics() / call_metrics() read them
                    for key, value in times.items():
                        figures[key] = figures.get(key, 0.0) + value
            return out
        except Exception as e:  # noqa: BLE001 - the loop is an optimisation: generate still works
            self.fast_failed = f"the static-cache loop failed before ({type(e).__name__}: {e})"
            logger.warning("fast HF decoding failed, using generate from now on: %s: %s", type(e).__name__, e)
            return None, None, None

    @staticmethod
    def _images(module, ids: torch.Tensor, mask: torch.Tensor, vision) -> hf_decode.Images:
        """A vision-language prefill's ``hf_decode.Images`` for left-padded prompts ``ids`` [P, W] on the
        device: their images (``vision``, None a text prompt, or None for all) and M-RoPE positions."""
        inputs = vision_model.image_inputs(module, ids, vision if vision is not None else [None] * ids.shape[0])
        positions, deltas = vision_model.rope_positions(module, ids, mask, inputs)
        never = torch.tensor(vision_model.placeholder_ids(module), dtype=torch.long, device=ids.device)
        return hf_decode.Images({k: v for k, v in inputs.items() if k != "mm_token_type_ids"}, positions, deltas, never)

    def _min_rows(self, device: torch.device) -> Optional[int]:
        """``decode``'s ``min_rows`` for ``compact_rows`` (None: the whole batch to the longest row)."""
        compact = self.compact_rows == "on" or (self.compact_rows == "auto" and device.type != "cuda")
        return hf_decode.MIN_ROWS if compact else None

    def metrics(self) -> dict:
        """``cuda_graph``: 1 when the last call decoded by graph replays, 0 otherwise; where the static-cache
        loop decoded, its ``prefill_s`` / ``decode_s``, the CUDA graphs it captured (``graph_captures``) and its
        calls (``decode_calls``: a multi-turn rollout's turns go through it one call each), summed over the
        calls since the last ``metrics()``, which hands them over (a step's figures are that step's)."""
        with self._figures_lock:
            figures, self._last = self._last, {}
        if not self.last_mode:
            return {}
        return {"cuda_graph": float(self.last_mode == "graph"), **(figures if self.last_mode != "generate" else {})}

    def _decode_generate(self, module, ids, mask, spec: SamplingSpec, eos: List[int], copies: int,
                         images: Optional[Dict[str, torch.Tensor]] = None):
        """``generate``'s tokens and log-probs; ``images``: a vision-language model's image keywords."""
        width = ids.shape[1]
        device = self.device
        greedy = spec.temperature == 0.0
        kwargs = dict(max_new_tokens=spec.max_tokens, do_sample=not greedy, num_return_sequences=spec.n // copies,
                      pad_token_id=self.pad_token_id, eos_token_id=eos or None, return_dict_in_generate=True,
                      output_logits=spec.logprobs, use_cache=True)
        if not greedy:
            kwargs.update(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k if spec.top_k > 0 else 0)
        if spec.stop:
            kwargs.update(stop_strings=list(spec.stop), tokenizer=self.tokenizer)
        if self.vision_language:  # a sampled image placeholder would stand for an image the passes lack
            kwargs["suppress_tokens"] = vision_model.placeholder_ids(module)
        out = module.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs, **(images or {}))
        new = out.sequences[:, width:].cpu()
        logp = None
        if spec.logprobs and out.logits:
            logits = torch.stack(out.logits, dim=1).float().cpu()  # [rows, steps, V]
            if not greedy:
                logits = logits / spec.temperature
            logp = torch.log_softmax(logits, dim=-1).gather(-1, new[:, : logits.shape[1], None]).squeeze(-1)
        return new, logp

    def _split(self, new: torch.Tensor, logp: Optional[torch.Tensor], prompts, spec: SamplingSpec, eos: List[int],
               owners: List[int], caps: List[int]):
        """Rows of new tokens -> per prompt, (tokens up to and with the stop token, log-probs, reason);
        ``owners``: each row's prompt; ``caps``: each prompt's token limit (a row's later tokens are cut, which
        leaves those kept as a call with that limit samples them)."""
        stop_ids = set(eos) | set(spec.stop_token_ids)
        grouped: List[List[Tuple[List[int], List[float], str]]] = [[] for _ in prompts]
        for row in range(new.shape[0]):
            toks = new[row, : caps[owners[row]]].tolist()
            end, reason = len(toks), "length"
            for t, tok in enumerate(toks):
                if tok in stop_ids:
                    end, reason = t + 1, "stop"  # the EOS token belongs to the response
                    break
            if reason == "length" and spec.stop:
                # generate stopped on a stop string: trailing pad tokens are not part of the response
                while end > 0 and toks[end - 1] == self.pad_token_id and self.pad_token_id not in stop_ids:
                    end -= 1
                reason = "stop" if end < len(toks) else reason
            lps = logp[row, :end].tolist() if logp is not None else [0.0] * end
            grouped[owners[row]].append((toks[:end], lps, reason))
        return grouped
