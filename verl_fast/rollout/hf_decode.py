"""A sampling decode loop for a Hugging Face causal LM over a static KV cache: the whole batch in one
call, no host synchronisation per token, and on a GPU each decode step captured once in a CUDA
graph and replayed.

Plain ``generate`` spends most of a small model's decode step in Python and kernel launches (a
0.4B 24-layer model launches ~1,000 kernels per token) and reads a flag back to the host every
token. Here the step -- one forward over a [B, 1] token batch, sampling, bookkeeping -- touches only
tensors of fixed address (the cache, the token/position buffers, the mask), so one captured graph
replays it for every token; finished rows are checked every ``check_every`` tokens, and leave the
batch once the rest fit a smaller one (``decode``: the batch and its cache compacted, one graph per
batch size). The prefill
runs the model's own sdpa attention; the decode steps an attention that reads each cached KV head
once for all the query heads that share it (``static_kv.grouped_attention``).

What it computes is what ``generate`` computes: the same forward (left padding, positions from the
attention mask), temperature then top-k then top-p over the float32 logits, a draw from the
resulting categorical distribution (the exponential race: argmax of log p - log E with E ~ Exp(1),
exactly categorical, and free of host syncs), pad after a row's EOS. The sampled tokens' log-probs
are taken from the raw logits divided by the temperature, as the HF engine reports them.

A vision-language model (Qwen2-VL / Qwen2.5-VL, ``Images``): the prefill runs the model's own forward
with the prompts' pixel values and image grids at their M-RoPE positions (the model's rope index), in
one chunk; each decode step is text only, and a text token after the prompt has all three M-RoPE
components equal to its text position plus the row's rope delta, so the step passes those positions
explicitly ([3, B, 1]) and nothing rests on state the model caches between calls. The image
placeholder tokens are never sampled (``Images.never``), as the HF engine's ``generate`` suppresses them.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from verl_fast.rollout import decode_memory, merged_projections
from verl_fast.rollout.static_kv import ATTENTION, Past, StaticKV, attention_set

try:
    from verl_fast.kernels import decode_sampling
except ImportError:  # no Triton: the torch sampling everywhere
    decode_sampling = None

logger = logging.getLogger(__name__)

# generation_config fields that change the next-token distribution beyond temperature / top-k /
# top-p (and the values that leave it alone): a model that sets one decodes with ``generate``.
_PLAIN_GENERATION = {
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,), "min_length": (None, 0), "min_new_tokens": (None, 0), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "sequence_bias": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "min_p": (None, 0.0), "exponential_decay_length_penalty": (None,), "guidance_scale": (None, 1.0),
    "renormalize_logits": (None, False),
}


def unsupported(module: torch.nn.Module) -> Optional[str]:
    """Why this model cannot use the loop (None when it can)."""
    cfg = getattr(module, "config", None)
    text = cfg.get_text_config() if cfg is not None else None  # a vision-language model's language model
    attn = getattr(text, "_attn_implementation", None)
    if attn != "sdpa":  # the 4-D boolean mask below is sdpa's format
        return f"attention implementation {attn!r} (the static-cache loop needs 'sdpa')"
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder model"
    layers = StaticCache(config=cfg, max_cache_len=1).layers  # the config's layer kinds; allocates nothing
    if not all(type(layer) is StaticLayer for layer in layers):  # sliding-window / linear-attention layers
        kinds = sorted({type(layer).__name__ for layer in layers})
        return f"cache layers {kinds} (the loop's mask addresses plain full-attention layers)"
    gen = getattr(module, "generation_config", None)
    for name, plain in _PLAIN_GENERATION.items():
        value = getattr(gen, name, None)
        if value not in plain:
            return f"generation_config.{name}={value!r} changes the sampling distribution"
    return None


@dataclass
class Images:
    """A vision-language prefill's inputs beside the prompts' token ids [P, W] (Qwen2-VL / Qwen2.5-VL)."""

    inputs: Dict[str, torch.Tensor]  # the prefill forward's keywords: pixel_values, image_grid_thw (none: no image)
    positions: torch.Tensor  # [3, P, W] the prompts' M-RoPE positions (the model's rope index)
    deltas: torch.Tensor  # [P] each prompt's rope delta: a text token's position beyond its text position
    never: torch.Tensor  # [K] token ids never sampled (the image placeholders)

    def padded(self, extra: int) -> "Images":
        """The same inputs for prompts left-padded by ``extra`` more columns."""
        return Images(self.inputs, torch.nn.functional.pad(self.positions, (extra, 0)), self.deltas, self.never)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           never: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] from float32 logits [B, V] (temperature 0: greedy); the ids
    ``never`` are drawn from none of them (taken out before top-k / top-p; the log-probs stay unfiltered)."""
    if temperature == 0:
        token = (logits if never is None else logits.index_fill(-1, never, float("-inf"))).argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scores = logits / temperature
    logp = torch.log_softmax(scores, -1)
    if never is not None:
        scores = scores.index_fill(-1, never, float("-inf"))
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:  # drop the least likely tokens whose total mass stays within 1 - top_p; keep >= 1
        ordered, order = torch.sort(scores, dim=-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    # exponential race: argmax_i (s_i - log E_i), E_i ~ Exp(1) draws i with probability softmax(s)_i;
    # E is kept above 0 so that a filtered token (-inf) can never win
    noise = torch.empty_like(scores).exponential_().clamp_(min=torch.finfo(torch.float32).tiny)
    token = (scores - noise.log()).argmax(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def _fsdp_modules(module: torch.nn.Module) -> Tuple[torch.nn.Module, ...]:
    """``module``'s FSDP2 (``fully_shard``) modules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return ()
    return tuple(m for m in module.modules() if isinstance(m, FSDPModule))


@contextlib.contextmanager
def _without_fsdp_hooks(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """FSDP2 modules (``_fsdp_modules``) whose parameters the caller has unsharded for the whole decode: their
    forward hooks would only re-check that state (and record stream events a graph capture cannot hold)."""
    saved = []
    for m in modules:
        saved.append((m, m._forward_pre_hooks, m._forward_hooks))
        m._forward_pre_hooks, m._forward_hooks = type(m._forward_pre_hooks)(), type(m._forward_hooks)()
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


def model_step(module, ids, mask, positions, cache, **inputs) -> torch.Tensor:
    """One forward over the cache: the last position's float32 logits [B, V]. ``inputs``: a
    vision-language prefill's image keywords."""
    out = module(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                 logits_to_keep=1, **inputs)
    return out.logits[:, -1].float()


def merge_adapters(module: torch.nn.Module, dtype: Optional[torch.dtype], copies: dict,
                   done: List[Tuple[torch.nn.Module, str, torch.nn.Module]]) -> None:
    """Each LoRA-adapted linear layer of ``module`` (peft's, adapters active and not merged into the
    base) replaced in its parent by a plain ``nn.Linear`` holding ``W + scale * B @ A`` over its active
    adapters, kept in ``dtype`` (or the base weight's) in ``copies``, refreshed at every rollout: the
    decode runs one GEMM per layer, as for a model without adapters (peft's forward runs three, and
    keeps the q/k/v and gate/up products from merging). Each swap is appended to ``done`` as (parent,
    name, adapted layer), what the caller puts back.

    Each adapter's product is added by one GEMM (``addmm_``: products accumulated in float32), into the
    copy itself when the base weight is in the copy's dtype (a LoRA actor's bf16 base: the adapters'
    factors taken in bf16, the sum rounded once), else into one float32 temporary. In bf16 that reads
    and writes ~4 bytes a weight, where merging through float32 temporaries moved ~36
    (docs/benchmarks.md, "Measurements behind the code's choices")."""
    for name, sub in list(module.named_modules()):
        base = getattr(sub, "base_layer", None)
        if (not isinstance(base, torch.nn.Linear) or not hasattr(sub, "lora_A") or getattr(sub, "merged", False)
                or getattr(sub, "disable_adapters", False) or any(getattr(sub, "use_dora", {}).values())):
            continue  # not LoRA, already merged, adapters off, or DoRA (whose scale peft's forward computes)
        key = f"{name}.adapters_merged"
        plain = copies.get(key)
        weight = base.weight
        want = dtype or weight.dtype
        if plain is None or (plain.weight.shape, plain.weight.device, plain.weight.dtype) != (weight.shape, weight.device, want):
            plain = torch.nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                                    device=weight.device, dtype=want).requires_grad_(False)
            copies[key] = plain
        # the sum, rounded once: in the copy itself when the base is in its dtype, else in float32
        if weight.dtype == want:
            total = plain.weight.copy_(weight.detach())
        else:
            total = weight.detach().to(torch.float32, copy=True)
        for adapter in sub.active_adapters:  # (peft turns fan_in_fan_out off on nn.Linear: W is [out, in])
            if adapter in sub.lora_A:
                total.addmm_(sub.lora_B[adapter].weight.detach().to(total.dtype),
                             sub.lora_A[adapter].weight.detach().to(total.dtype), alpha=sub.scaling[adapter])
        if total is not plain.weight:
            plain.weight.copy_(total)
        if base.bias is not None:
            plain.bias.copy_(base.bias.detach())
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, plain)
        done.append((parent, attr, sub))


@contextlib.contextmanager
def inference_state(module: torch.nn.Module) -> Iterator[None]:
    """For the length of a rollout, ``module``'s state that training or ``generate`` leaves on it and its
    decode never uses set as the model is built (put back at the end): gradient checkpointing off (only a
    training forward checkpoints; the update's out-of-memory re-plan turns it on mid-run,
    ``trainer/updates.py``) and no cached M-RoPE deltas (Qwen2-VL / Qwen2.5-VL keep the last ``generate``'s,
    or a forward's without positions, for calls that give none; the decode gives every position). The
    compiled forward reads both, and torch.compile guards on what it read: either changed cost the next
    rollout a compile of the whole forward again, as long as its first."""
    saved = []
    for m in module.modules():
        own = vars(m)
        if "gradient_checkpointing" in own:
            saved.append((m, "gradient_checkpointing", own["gradient_checkpointing"]))
            if getattr(type(m), "gradient_checkpointing", None) is False:  # the layers: their class's False
                del m.gradient_checkpointing
            else:  # the models: an attribute of their own, False as built
                m.gradient_checkpointing = False
        if own.get("rope_deltas") is not None:
            saved.append((m, "rope_deltas", own["rope_deltas"]))
            m.rope_deltas = None
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def own_code(fn):
    """``fn`` over a copy of its code object. torch.compile keeps a function's graphs, and counts its recompiles
    against ``torch._dynamo.config.recompile_limit`` (past which the calls run eager), per code object: each
    ``CompiledForward`` (one an engine, its model's) keeps its own rather than sharing the limit with every
    other model decoded in the process (a judge's, an asynchronous rollout's copy)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class CompiledForward:
    """The decode steps' forward compiled by torch.compile (Inductor): a step's norms, rotary, casts,
    masking and softmax fuse into a few kernels per layer where eager launches dozens (docs/hotpaths.md
    counts them). One
    compiled function serves every rollout: compiled for the first rollout's shapes, then once more
    with the lengths left symbolic when a rollout of another prompt width comes (torch.compile's
    automatic dynamic shapes), never again after that (whatever training leaves on the model:
    ``inference_state``); prompts are left-padded to a multiple of
    ``WIDTH`` so that nearby prompt lengths keep the first, static compile (not a conversation's next turn,
    whose new tokens run as they are, through this same compiled forward when the turn continues a held
    decoder: ``_Decoder.restart``). A Llama-family layer's q/k/v
    and gate/up products run merged, two GEMMs where there were five (``merged_projections``). Under
    autocast the linear layers run on copies of their weights in the autocast dtype, kept here and
    refreshed from the parameters at every rollout (what autocast would cast them to: the same
    numbers), because a compiled graph cannot use autocast's cast cache and would cast every weight
    at every token. The step's sampling and bookkeeping (``record``, or ``record_fused``) are compiled too. A compacted batch
    (``decode``) brings new row counts: the first compiles once more with the rows symbolic."""

    WIDTH = 64

    def __init__(self) -> None:
        self.fn = torch.compile(own_code(model_step))
        self.record = torch.compile(own_code(record))
        self.record_fused = torch.compile(own_code(record_fused))
        self.copies: dict = {}
        self.merged = merged_projections.Merged()
        self.inside: Optional[torch.nn.Module] = None  # the module whose weights are swapped now

    @contextlib.contextmanager
    def weights(self, module: torch.nn.Module) -> Iterator[None]:
        """For the length of a rollout: ``module``'s q/k/v and gate/up products merged (merged copies
        and forwards, ``merged_projections``), and under autocast its other linear weights and biases
        replaced by kept copies in the autocast dtype, and its training state as built (``inference_state``).
        Entered again inside itself (a multi-turn rollout holds it over its turns, ``HFGenerateEngine.holding``):
        nothing more."""
        if self.inside is module:
            yield
            return
        device = next(module.parameters()).device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        swapped, merged, adapters = [], [], []
        try:
            self.inside = module
            merge_adapters(module, dtype, self.copies, adapters)
            self.merged.install(module, dtype, merged)
            inside = {id(layer) for _, layers in merged for layer in layers}  # merged: no copies of their own
            for name, layer in module.named_modules() if dtype is not None else ():
                if not isinstance(layer, torch.nn.Linear) or id(layer) in inside:
                    continue
                for key, param in list(layer._parameters.items()):
                    if param is None or not param.is_floating_point() or param.dtype == dtype:
                        continue
                    copy = self.copies.get(f"{name}.{key}")
                    if copy is None or copy.shape != param.shape or copy.device != param.device:
                        copy = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype, device=param.device),
                                                  requires_grad=False)
                        self.copies[f"{name}.{key}"] = copy
                    copy.copy_(param.detach())
                    layer._parameters[key] = copy  # a tied lm_head gets its own copy; the embedding keeps fp32
                    swapped.append((layer, key, param))
            with inference_state(module):
                yield
        finally:
            self.inside = None
            for layer, key, param in swapped:
                layer._parameters[key] = param
            merged_projections.Merged.remove(merged)
            for parent, attr, adapted in adapters:
                setattr(parent, attr, adapted)


def prefill_mask(query: torch.Tensor, key: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """A prefill forward's [P, 1, q, k] boolean mask: query column ``query`` [q, 1] sees key column ``key`` [1, k]
    at or before it where ``attended`` [P, k] holds a token of the prompt; a left-pad query attends to itself only
    (with no key its states would be NaN)."""
    return (((key <= query)[None] & attended[:, None, :]) | (key == query)[None])[:, None]


class _Decoder:
    """The loop's state: static buffers and the step that advances them by one token."""

    def __init__(self, module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 sampling: Tuple[float, int, float], stop_ids: Sequence[int], pad_id: int,
                 compiled: Optional["CompiledForward"] = None, rows: Optional[torch.Tensor] = None,
                 fused: bool = False, past: Optional[Past] = None, images: Optional[Images] = None,
                 columns: int = 0):
        self.module = module
        self.sampling = (*sampling, None if images is None else images.never)  # sample()'s arguments after logits
        self.forward = compiled.fn if compiled is not None else model_step  # the decode steps' forward
        self.record = compiled.record if compiled is not None else record  # and their sampling
        W = input_ids.shape[1]
        B = input_ids.shape[0] if rows is None else rows.shape[0]
        device = input_ids.device
        C = 0 if past is None else past.columns  # the past's columns: the prompts follow them
        L = max(C + W + max_new_tokens, columns)
        self.graph: Optional["torch.cuda.CUDAGraph"] = None  # the step's graph, once captured (``restart``)
        self.addresses: Optional[Tuple[int, ...]] = None  # where the weights it read were (``_addresses``)
        self.prefilled = C + W  # the cache column of the first decoded token
        self.cache = StaticKV(module.config.get_text_config().num_hidden_layers, L, rows, fused=fused, past=past)
        self.seed = None  # the fused sampling's random key (None: the torch sampling, which also leaves out ``never``)
        if fused and decode_sampling is not None and decode_sampling.supports(*sampling[1:]) and images is None:
            self.seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.long, device=device)
            self.record = compiled.record_fused if compiled is not None else record_fused
        self.stop_ids = sorted(set(stop_ids)) or [-1]  # (and on the host: ``fits`` reads them, ``restart`` the pad)
        self.stop = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
        self.pad_id = pad_id
        self.pad = torch.tensor(pad_id, dtype=torch.long, device=device)
        self.tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        positions = attention_mask.long().cumsum(-1) - 1
        if past is not None:
            positions += past.position[:, None]
        positions.masked_fill_(attention_mask == 0, 1)  # as generate does for left padding
        valid = attention_mask.bool() if past is None else torch.cat([past.valid, attention_mask.bool()], 1)
        self.mrope = images is not None  # the decode steps' positions go in as [3, B, 1]
        self._prefill(input_ids, valid, positions if images is None else images.positions, C, rows, images)
        if images is not None:  # a text token's M-RoPE position: its text position plus the prompt's delta
            positions = positions + images.deltas[:, None]
        per_row = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        self.valid = torch.zeros((B, L), dtype=torch.bool, device=device)  # keys each row may attend to
        self.valid[:, : C + W] = per_row(valid)
        self.mask = self.valid[:, None, None, :]  # the decode step's [B, 1, 1, L] view
        self.position = per_row(positions[:, -1:]) + 1  # [B, 1]
        self.col = torch.tensor([C + W], dtype=torch.long, device=device)  # cache column of the next token
        self.t = torch.tensor([1], dtype=torch.long, device=device)  # output column of the next token
        self.cache.cols = self.col
        # the call's output rows; row i of the batch decodes output row origin[i] (-1: a filler)
        self.out_tokens, self.out_logprobs = self.tokens, self.logprobs
        self.origin = torch.arange(B, device=device)

    @property
    def rows(self) -> int:
        return self.done.shape[0]

    def fits(self, rows: int, columns: int, max_new_tokens: int, sampling: Tuple[float, int, float],
             stop_ids: Sequence[int], forward) -> bool:
        """Whether a call of ``rows`` rows needing ``columns`` cache columns (its past's, its prompts' and its
        new tokens') can ``restart`` in this decoder: the same rows (never compacted), room in the cache and
        the outputs, the same sampling, stop ids and forward (what its captured step computes)."""
        return (self.rows == rows and self.out_tokens is self.tokens and self.cache.length >= columns
                and self.tokens.shape[1] >= max_new_tokens and self.sampling[:3] == tuple(sampling)
                and self.sampling[3] is None and self.forward is forward
                and self.stop_ids == (sorted(set(stop_ids)) or [-1]))

    def restart(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: Past) -> None:
        """A conversation's next turn in this decoder's own buffers (``fits``): the past's columns written
        into the cache (the rest of it left as it is, never attended), the prompts prefilled after them,
        every per-row buffer rewritten in place, so that the step captured at its first call replays for
        this one. What each row computes is what a new decoder computes (its cache only wider)."""
        device = input_ids.device
        C, W = past.columns, input_ids.shape[1]
        if self.seed is not None:  # drawn as a new decoder draws it, before its prefill
            self.seed.copy_(torch.randint(0, 2 ** 62, (1,), dtype=torch.long, device=device))
        self.tokens.fill_(self.pad_id)
        self.logprobs.zero_()
        for store, old in ((self.cache.keys, past.keys), (self.cache.values, past.values)):
            for layer, tensor in enumerate(store):
                tensor[:, :, :C].copy_(old[layer])
                old[layer] = None
        positions = attention_mask.long().cumsum(-1) - 1 + past.position[:, None]
        positions.masked_fill_(attention_mask == 0, 1)
        valid = torch.cat([past.valid, attention_mask.bool()], 1)
        self.prefilled = C + W
        # the new tokens' forward through the decode steps' own, compiled: its norms, rotary and casts fused into a
        # few kernels a layer where the eager forward launches dozens (a turn's prefill of a few new tokens a
        # row is launch-bound); its attention stays sdpa, as the eager prefill's (no [rows, heads, new, cache]
        # scores materialised)
        self._prefill(input_ids, valid, positions, C, None, forward=self.forward)
        self.valid.zero_()
        self.valid[:, : C + W] = valid
        self.position.copy_(positions[:, -1:] + 1)
        self.col.fill_(C + W)
        self.t.fill_(1)
        self.cache.cols = self.col

    def compact(self, rows: int) -> None:
        """The batch cut to ``rows`` rows: the unfinished rows in their order, then finished ones as
        fillers (a finished row decodes pads, and its output is final), every per-row buffer and each
        layer's cache gathered into new tensors of that many rows (the larger ones freed layer by
        layer). Columns, positions and masks move with their rows, so each row's next forward is the one
        it would have had in the larger batch."""
        self._flush()
        order = torch.argsort(self.done.to(torch.int8), stable=True)[:rows]  # unfinished rows first
        for store in (self.cache.keys, self.cache.values):
            for layer, tensor in enumerate(store):
                store[layer] = tensor.index_select(0, order)
        self.origin = self.origin.index_select(0, order).masked_fill_(self.done.index_select(0, order), -1)
        for name in ("tokens", "logprobs", "valid", "position", "current", "done"):
            setattr(self, name, getattr(self, name).index_select(0, order))
        self.mask = self.valid[:, None, None, :]

    def _flush(self) -> None:
        """The batch's real rows written to their output rows (nothing to do before the first compaction)."""
        if self.tokens is self.out_tokens:
            return
        real = (self.origin >= 0).nonzero().squeeze(-1)
        where = self.origin.index_select(0, real)
        self.out_tokens.index_copy_(0, where, self.tokens.index_select(0, real))
        self.out_logprobs.index_copy_(0, where, self.logprobs.index_select(0, real))

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The output rows' tokens and log-probs [B, max_new_tokens], on the host."""
        self._flush()
        return self.out_tokens.cpu(), self.out_logprobs.cpu()

    def _prefill(self, input_ids, valid, positions, C, rows, images: Optional[Images] = None, forward=model_step):
        """The prompts' forward, each prompt once, in chunks of at most ``decode_memory.PREFILL_CHUNK`` columns (a later
        chunk's queries attend to the cache's earlier columns: activations and mask over a chunk, not the
        whole prompt), and each row's first token from its prompt's logits. ``valid`` [P, C + W]: the
        past's ``C`` columns (cached, not run again) and the prompts'. With ``images``, one chunk (the
        model places all of a forward's image features on that forward's placeholders), positions [3, P, W].
        ``forward``: ``model_step`` (eager), or a restart's compiled one (its cache made already)."""
        device = input_ids.device
        W = C + input_ids.shape[1]
        chunk = decode_memory.PREFILL_CHUNK if images is None else W - C
        chunked = W - C > chunk
        if C == 0 and not chunked and images is None and forward is model_step:
            # prompts of very different widths: each bucket of similar ones runs over its own columns only
            first = valid.int().argmax(1)  # each prompt's first column (left padding before it)
            buckets = width_buckets((W - first).tolist(), PREFILL_BUCKET_STEP, PREFILL_BUCKET_TOKENS)
            if len(buckets) > 1:
                return self._prefill_buckets(input_ids, valid, positions, rows, buckets)
        if chunked:  # the chunks' keys and values kept per prompt, copied to the rows that decode them after
            self.cache.rows = None
        for start in range(C, W, chunk):
            end = min(start + chunk, W)
            # keys attended: the first chunk's own (the cache returns them), a later chunk's (or a chunk after
            # a past) the whole cache's
            keys = end if start == 0 and self.cache.past is None and self.cache.keys[0] is None else self.cache.length
            query = torch.arange(start, end, device=device)[:, None]
            key = torch.arange(keys, device=device)[None, :]
            attended = torch.nn.functional.pad(valid, (0, max(keys - W, 0)))[:, :keys]
            mask = prefill_mask(query, key, attended)
            self.cache.cols = torch.arange(start, end, device=device)
            self.cache.seen = start
            logits = forward(self.module, input_ids[:, start - C : end - C], mask,
                             positions[..., start - C : end - C], self.cache, **({} if images is None else images.inputs))
        if chunked and rows is not None:
            for store in (self.cache.keys, self.cache.values):
                for layer, tensor in enumerate(store):
                    store[layer] = tensor.index_select(0, rows)
        self._first_token(logits, rows, W)

    def _prefill_buckets(self, input_ids, valid, positions, rows, buckets: List[Tuple[int, List[int]]]) -> None:
        """The prefill of ``_prefill`` (no past, one chunk, no images) in width ``buckets`` (``width_buckets``):
        each bucket's prompts over its last ``width`` columns, where all of their tokens are, attending to
        their own keys; each writes its rows of the cache (the rows that decode its prompts) at those
        columns. What each prompt's tokens attend to is what the whole batch's forward gives them."""
        device, (P, W) = input_ids.device, input_ids.shape
        self.cache.rows = None
        self.cache.batch = P if rows is None else rows.shape[0]
        logits = None
        for width, members in buckets:
            idx = torch.tensor(members, device=device)
            place = torch.full((P,), -1, dtype=torch.long, device=device)
            place[idx] = torch.arange(len(members), device=device)
            of_row = place if rows is None else place.index_select(0, rows)  # each cache row's prompt in the bucket
            dest = (of_row >= 0).nonzero().squeeze(1)
            self.cache.writes = (dest, of_row.index_select(0, dest))
            self.cache.cols = torch.arange(W - width, W, device=device)
            self.cache.seen = 0
            span = torch.arange(width, device=device)
            mask = prefill_mask(span[:, None], span[None, :], valid.index_select(0, idx)[:, W - width:])
            part = model_step(self.module, input_ids.index_select(0, idx)[:, W - width:], mask,
                              positions.index_select(0, idx)[:, W - width:], self.cache)
            if logits is None:
                logits = part.new_empty((P, part.shape[1]))
            logits.index_copy_(0, idx, part)
        self.cache.writes = None
        self._first_token(logits, rows, W)

    def _first_token(self, logits, rows, W) -> None:
        """Each row's first token drawn from its prompt's last ``logits`` [P, V]."""
        token, logp = sample(logits if rows is None else logits.index_select(0, rows), *self.sampling)
        self.cache.seen = W
        self.tokens[:, 0] = token
        self.logprobs[:, 0] = logp
        if hasattr(self, "done"):  # a restart: the buffers a captured step addresses, rewritten in place
            self.done.copy_(torch.isin(token, self.stop))
            self.current.copy_(token[:, None])
        else:
            self.done = torch.isin(token, self.stop)
            self.current = token[:, None].clone()

    def step(self) -> None:
        self.valid.index_fill_(1, self.col, True)
        position = self.position[None].expand(3, -1, -1) if self.mrope else self.position  # a view: graph-safe
        logits = self.forward(self.module, self.current, self.mask, position, self.cache)
        state = (logits, self.sampling, self.done, self.pad, self.stop, self.tokens, self.logprobs, self.current,
                 self.position, self.col, self.t)
        if self.seed is None:
            self.record(*state)
        else:
            self.record(*state, self.seed)


def record(logits, sampling, done, pad, stop, tokens, logprobs, current, position, col, t) -> None:
    """A decode step's sampling and bookkeeping, in place: the next tokens drawn from ``logits`` [B, V]
    (``sample``), pad and log-prob 0 for finished rows, written at output column ``t``, the rows that drew
    a stop token marked done, and the token, positions and columns advanced. Compiled with the forward
    (``CompiledForward.record``) it is a few fused kernels where eager runs ~20 (~8 of them over [B, V])."""
    token, logp = sample(logits, *sampling)
    token = torch.where(done, pad, token)
    logp = logp.masked_fill(done, 0.0)
    tokens.index_copy_(1, t, token[:, None])
    logprobs.index_copy_(1, t, logp[:, None])
    done |= torch.isin(token, stop)
    current.copy_(token[:, None])
    position.add_(1)
    col.add_(1)
    t.add_(1)


def record_fused(logits, sampling, done, pad, stop, tokens, logprobs, current, position, col, t, seed) -> None:
    """``record`` with the draw, the log-prob and the per-row bookkeeping in one kernel
    (``kernels.decode_sampling``: temperature or greedy, no top-k / top-p), its Philox key ``seed`` + ``t``."""
    decode_sampling.sample_step(logits, sampling[0], seed, t, done, pad, stop, tokens, logprobs, current, position)
    col.add_(1)
    t.add_(1)


class GraphPool:
    """Where the decode step's CUDA graphs are captured, kept from one rollout to the next, so that a
    rollout leaves the caching allocator as it found it. Each call captures its own graphs, one per
    batch size it compacts to (the buffers they address -- the cache, the rows' state -- are that
    call's; kept for the next call they would hold every batch size's cache through the update), but
    for a conversation's next turn that restarts in the previous turn's decoder (``decode``'s ``reuse``),
    which replays that decoder's graph while it is still the newest here.
    ``torch.cuda.graph`` empties the allocator's cache before every capture: the update's cached working
    set went back to the driver at each rollout and was allocated again in the next update (hundreds
    of ``cudaFree`` + ``cudaMalloc`` a step: docs/benchmarks.md); here the capture is begun and
    ended directly. A graph's private pool is freed with the graph, so each capture goes into the pool
    of the previous graph, kept here until then (its segments stay reserved between rollouts): a
    graph's pool holds only its step's temporaries (every buffer that outlives a step is allocated
    outside the capture), and a call replays one graph at a time, each after the last. One side stream
    runs the warm-up step and the capture (the allocator caches blocks per stream)."""

    def __init__(self) -> None:
        self.last: Optional["torch.cuda.CUDAGraph"] = None
        self.stream: Optional["torch.cuda.Stream"] = None
        self.captures = 0  # graphs captured so far (each call's batch sizes: its first step of each)

    def capture(self, decoder: "_Decoder") -> "torch.cuda.CUDAGraph":
        """Runs one real step on the side stream (warm-up), then captures the step (capturing runs nothing)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        # the previous graph is never replayed again: sharing its pool is safe (graphs of one pool
        # must replay in capture order, and only the newest one does)
        pool = self.last.pool() if self.last is not None else None
        with torch.cuda.stream(self.stream):
            decoder.step()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                decoder.step()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.last = graph
        self.captures += 1
        return graph


def bucket_rows(live: int, smallest: int) -> int:
    """The batch ``live`` unfinished rows decode in: the least of ``smallest`` x 2^k and ``smallest`` x
    3 x 2^(k-1) that holds them (8, 12, 16, 24, 32, 48, 64, 96, 128, ... for 8), so that a captured
    step has under 1.5x the rows it needs (above ``smallest``) and a call sees a few batch sizes only."""
    size = smallest
    while size < live:
        if size * 3 // 2 >= live and size * 3 // 2 > size:
            return size * 3 // 2
        size *= 2
    return size


# The fewest rows a decode compacts to: below it a step costs the weights' read, whatever its rows
MIN_ROWS = 8

# The prefill's width buckets (``width_buckets``): widths rounded up to a multiple of STEP columns, and what
# one more bucket's forward costs, counted in the prompt tokens it could have run instead (its launches
# and the host's walk over the layers)
PREFILL_BUCKET_STEP = 64
PREFILL_BUCKET_TOKENS = 4096


def width_buckets(needs: Sequence[int], step: int, overhead: int) -> List[Tuple[int, List[int]]]:
    """The prompts split into buckets of similar width for the prefill: [(width, prompt indices)], widest
    first, each prompt in the bucket of the least width that holds its ``needs`` columns (rounded up to
    ``step``; the batch's own width caps it). Minimises the columns run, each prompt counted at its
    bucket's width, plus ``overhead`` a bucket beyond the first: the rows of a ragged batch (a partial
    rollout's carried samples beside fresh prompts, a dataset's prompts of many lengths) run their own
    tokens rather than the widest prompt's padding."""
    if not needs:
        return []
    top = max(needs)
    rounded = [min(-(-max(n, 1) // step) * step, top) for n in needs]
    widths = sorted(set(rounded), reverse=True)
    counts = [rounded.count(w) for w in widths]
    # best[j]: the least cost of the first j widths, a bucket running widths[i:j] at widths[i]
    best, cut = [0.0] + [float("inf")] * len(widths), [0] * (len(widths) + 1)
    for j in range(1, len(widths) + 1):
        rows = 0
        for i in range(j - 1, -1, -1):
            rows += counts[i]
            cost = best[i] + rows * widths[i] + (overhead if i else 0)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], len(widths)
    while j:
        spans.append((cut[j], j))
        j = cut[j]
    out = []
    for i, j in reversed(spans):
        held = set(widths[i:j])
        out.append((widths[i], [p for p, w in enumerate(rounded) if w in held]))
    return out


@torch.no_grad()
def decode(module: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
           temperature: float, top_k: int, top_p: float, stop_ids: Sequence[int], pad_id: int,
           use_graph: bool, check_every: int = 16, graphs: Optional[GraphPool] = None,
           compiled: Optional[CompiledForward] = None, rows: Optional[torch.Tensor] = None,
           min_rows: Optional[int] = MIN_ROWS, log: Optional[List[Tuple[int, int]]] = None,
           fused: bool = False, past: Optional[Past] = None,
           keep: Optional[list] = None, images: Optional[Images] = None,
           times: Optional[Dict[str, float]] = None, reuse: Optional[_Decoder] = None,
           columns: int = 0, stamps: Optional[Dict[str, float]] = None,
           walked: Optional[Walked] = None) -> Tuple[torch.Tensor, torch.Tensor, str]:
    """New tokens [B, max_new_tokens] (pad after a row's stop token, and after an early exit once
    every row stopped) and their log-probs [B, max_new_tokens] (0 past the end), on the host, and
    how the steps ran: "graph" (replays) or "eager".

    ``input_ids`` / ``attention_mask``: [P, W] left-padded prompts on the model's device; ``rows``: [B]
    the prompt each output row decodes (None: each prompt once). The prefill runs each prompt once and
    copies its KV cache to the rows that decode it, as vLLM's prefix cache serves the samples of one
    prompt (16 prompts x 8 samples: an eighth of the prefill's work). The caller
    holds the model in eval mode, under its autocast, with parameters unsharded. ``use_graph``:
    replay a CUDA graph of the step (falls back to running it eagerly, with a logged reason, if
    capture fails); ``graphs``: where the graphs' memory is kept between calls (None: freed at the end);
    ``compiled``: run the decode steps' forward compiled (None: eager).

    Finished rows leave the batch: every ``check_every`` steps (the one host sync, which also ends the
    loop once every row stopped), when the unfinished rows fit a smaller batch of ``bucket_rows`` (down
    to ``min_rows``; None: never), the batch is compacted to it (``_Decoder.compact``: the cache shrinks
    with it) and its step captured in a graph of its own. Each row's forwards are the ones it has in
    the whole batch, so greedy tokens and log-probs are the uncompacted call's; sampled rows draw fresh
    Exp(1) noise per row and step from the one generator either way, so each row's distribution is
    the same (the draws themselves differ once the batch has changed). ``log``: (step, batch rows)
    appended at the first step and at each compaction, then (steps run, 0).

    ``fused``: the decode steps run the fused Triton kernels (Triton on the device, or its interpreter):
    a merged attention's rotary embedding and cache write in one (``StaticKV.write_rotated``), and the
    sampling and bookkeeping in one (``record_fused``, where no top-k / top-p filter is asked for; its
    draws come from Triton's Philox keyed from the device generator, so they differ from the torch
    sampling's, with the same distribution).

    A conversation's next turn (``rollout/kv_turns.py``): ``past`` holds each row's cached columns (one
    row per prompt, ``rows`` None), which the prompts (the new tokens) follow at each row's own
    positions; ``keep``: the decoder appended to it at the end, its cache and masks kept for the turn
    after (it needs ``min_rows`` None: a compaction drops the finished rows' caches).

    ``images``: a vision-language model's prompts' images and M-RoPE positions (``Images``; the fused
    sampling kernel, which cannot leave out the placeholder ids, gives way to the torch sampling).

    ``times``: the call's seconds written into it, ``prefill_s`` (the prefill and the first token; on a GPU
    the device's time between two events around it, so that the call never waits for the device to time it)
    and ``decode_s`` (the rest of the call's wall time, to the tokens on the host).

    ``reuse``: a decoder kept (``keep``) from the conversations' previous turn, whose buffers nothing else
    holds any more: where the call ``fits`` it (a ``past``, as many rows, room in its cache), it restarts in
    them (``_Decoder.restart``) and replays the step's graph it captured, if that is still the pool's newest,
    so a rollout's turns capture once; else a new decoder. ``columns``: a new decoder's cache at least this
    wide (the rollout's longest conversation, so that its later turns fit).

    ``stamps``: ``time.perf_counter()`` at the prefill's launch (``launched``) and once the tokens are on the host
    (``ended``) written into it, so that a caller can time its own work around the decode.

    ``walked``: ``Walked.of(module)``, read by a caller that holds the module unchanged over many calls, its weights
    swapped in as ``compiled.weights`` swaps them (``HFGenerateEngine.holding``); None: the module walked here."""
    if images is not None and past is not None:
        raise ValueError("decode: images go with a conversation's first turn only (past must be None with them)")
    if past is not None and rows is not None:
        raise ValueError("decode: past continues one row per prompt; rows must be None with it")
    if keep is not None and min_rows is not None:
        raise ValueError("decode: keep needs min_rows=None (a compaction drops the finished rows' caches)")
    if compiled is not None and past is None:  # (a continued turn's cache width moves with its past: not padded)
        extra = -input_ids.shape[1] % compiled.WIDTH
        input_ids = torch.nn.functional.pad(input_ids, (extra, 0), value=pad_id)
        attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0), value=0)
        images = images.padded(extra) if images is not None else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_without_fsdp_hooks(walked.fsdp if walked is not None else _fsdp_modules(module)))
        if compiled is not None:
            stack.enter_context(compiled.weights(module))
        start = time.perf_counter()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if times is not None and input_ids.is_cuda \
            else None
        if events:
            events[0].record(torch.cuda.current_stream(input_ids.device))
        sampling = (temperature, top_k, top_p)
        addresses = None if keep is None else walked.addresses if walked is not None else _addresses(module)
        if (reuse is not None and past is not None and rows is None and images is None
                and reuse.fits(input_ids.shape[0], past.columns + input_ids.shape[1] + max_new_tokens,
                               max_new_tokens, sampling, stop_ids, compiled.fn if compiled is not None else model_step)):
            dec = reuse
            if dec.addresses != addresses:  # its graph reads weights that have moved (e.g. gathered again)
                dec.graph = None
            dec.restart(input_ids, attention_mask, past)  # the new tokens' prefill: the compiled forward
        else:
            dec = _Decoder(module, input_ids, attention_mask, max_new_tokens, sampling, stop_ids, pad_id, compiled,
                           rows, fused=fused, past=past, images=images, columns=columns)  # the prefill: sdpa, eager
        dec.addresses = addresses
        if events:
            events[1].record(torch.cuda.current_stream(input_ids.device))
        elif times is not None:
            times["prefill_s"] = time.perf_counter() - start
        stack.enter_context(attention_set(module, ATTENTION))
        steps, graphed = _run_steps(dec, max_new_tokens, use_graph, check_every,
                                    graphs if graphs is not None else GraphPool(), min_rows, log)
        tokens, logprobs = dec.result()  # on the host: the device is done with both events
        if stamps is not None:
            stamps.update(launched=start, ended=time.perf_counter())
        tokens, logprobs = tokens[:, :max_new_tokens], logprobs[:, :max_new_tokens]  # a restart's may be wider
        if events:
            times["prefill_s"] = events[0].elapsed_time(events[1]) / 1e3
        if times is not None:
            times["decode_s"] = time.perf_counter() - start - times["prefill_s"]
    if keep is not None:
        keep.append(dec)
    if log is not None:
        log.append((steps, 0))
    return tokens, logprobs, "graph" if graphed else "eager"


@dataclass(frozen=True)
class Walked:
    """What ``decode`` finds by walking its module's submodules: its FSDP2 modules (``_without_fsdp_hooks``) and
    where the tensors a captured step reads live (``_addresses``). A caller that keeps the module as it is over
    many calls (a multi-turn rollout's turns, ``HFGenerateEngine.holding``) walks it once (``of``) and hands this
    to each call."""

    fsdp: Tuple[torch.nn.Module, ...]
    addresses: Tuple[int, ...]

    @classmethod
    def of(cls, module: torch.nn.Module) -> "Walked":
        """``module`` walked as it is now (its weights as the decode's contexts leave them)."""
        return cls(_fsdp_modules(module), _addresses(module))


def _addresses(module: torch.nn.Module) -> Tuple[int, ...]:
    """Where the tensors a captured step reads live: every parameter, buffer and tensor attribute of
    ``module``'s modules as the rollout's contexts left them (merged and autocast copies, FP8 copies,
    gathered shards). A graph replays the addresses it was captured with."""
    out: List[int] = []
    for m in module.modules():
        out += [t.data_ptr() for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        out += [v.data_ptr() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return tuple(out)


def _run_steps(dec: _Decoder, max_new_tokens: int, use_graph: bool, check_every: int, pool: GraphPool,
               min_rows: Optional[int], log: Optional[List[Tuple[int, int]]]) -> Tuple[int, bool]:
    """``decode``'s loop from the second token on: steps replayed from the current batch's graph (captured
    on its first step) or run eagerly, the batch compacted as rows finish. A failed capture is logged
    and the rest runs eagerly. Returns the steps run and whether they ran from graphs."""
    graph = dec.graph if dec.graph is not None and pool.last is dec.graph else None  # a restart's, still valid
    captured, steps = graph is not None, 1
    if log is not None:
        log.append((1, dec.rows))
    while steps < max_new_tokens:
        if steps % check_every == 0:
            live = int((~dec.done).sum())
            if live == 0:
                break
            if min_rows is not None and bucket_rows(live, min_rows) < dec.rows:
                graph = None  # the larger batch's graph is never replayed again
                dec.compact(bucket_rows(live, min_rows))
                if log is not None:
                    log.append((steps, dec.rows))
        if graph is None and use_graph and max_new_tokens - steps > 2:
            try:
                graph = pool.capture(dec)  # runs this step (the warm-up), captures the next
                captured = True
            except Exception as e:  # noqa: BLE001 - any capture failure: decode eagerly instead
                logger.warning("CUDA-graph decoding unavailable (%s: %s); decoding eagerly", type(e).__name__, e)
                use_graph, graph = False, None
                steps = int(dec.t.item())  # the warm-up step may have run
                continue
            steps += 1
            continue
        if graph is not None:
            graph.replay()
        else:
            dec.step()
        steps += 1
    dec.graph = graph if use_graph else None
    return steps, captured and use_graph
