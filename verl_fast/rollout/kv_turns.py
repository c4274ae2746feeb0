"""Multi-turn continuation for the HF engine's static-cache decode: each conversation's keys and values
kept from one turn to the next, so that a turn prefills only its new tokens (the tool or environment
messages after the model's last turn) instead of the whole conversation again.

A ``TurnCache`` (``HFGenerateEngine.turn_cache()``) serves one multi-turn rollout. Its ``generate(keys,
prompts, specs)`` takes each conversation's whole token list, as ``RolloutEngine.generate`` does, under a
key of the caller's (its trajectory). Where the tokens cached under the key begin the prompt, only the
rest is prefilled, at the row's own positions after them; otherwise (a first turn, or tokens that differ)
the whole prompt is. After the call each row keeps the columns of its tokens: the prompt's, and those of
its sampled tokens but the last (the decode's last token was sampled, never fed: the next turn feeds it
first). ``drop(key)`` frees a finished conversation's rows.

The rows of one call are packed (``static_kv.Past``): each row's cached columns right-aligned in ``C``
columns, the most any row has, gathered from the decodes that hold them in one copy per layer, the new
tokens left-padded after them; columns no row needs are left behind, so the cache is about as wide as
the longest conversation's. A row attends to its own tokens at the positions the whole conversation
gives them, so the logits are those of the re-prefilled conversation (to float rounding of the cached
keys): greedy rows decode its tokens, sampled rows draw from its distribution (with the same noise, the
same tokens). Rows of one call share its sampling (temperature, top-k, top-p) and may differ in
``max_tokens``: the call decodes to the largest and each row's tokens are cut at its own.

A call whose conversations are exactly the rows of the previous call's decoder (every conversation of a
lockstep rollout, turn after turn) restarts in that decoder's buffers (``hf_decode.decode``'s ``reuse``):
the cache is gathered into itself, and on a GPU the step's CUDA graph captured at the first turn replays for
every later one. ``reserve(tokens)`` sizes the first decoder's cache for the rollout's longest conversation,
so that the later turns fit it.

Counted per call (``calls``): rows, tokens prefilled (fed through the model), tokens served from the
cache (what re-prefilling the conversations would have fed again) and whether the call restarted the
previous decoder (``restarted``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import contextlib
import itertools
import time

import torch

from verl_fast.records.generation import GenerationOutput, SamplingSpec
from verl_fast.rollout import decode_memory, hf_decode, static_kv

# Whether a call restarts the previous call's decoder where it fits (the A/B switch of tests and benchmarks)
RESTART = True

# One decode's rows in a call: their places in the call, their decoded tokens [m, T] and how many of each are its
# response [m] (on the host), their log-probs [m, T] (None: not asked for) and why each ended
Part = Tuple[List[int], torch.Tensor, torch.Tensor, Optional[torch.Tensor], List[str]]


@dataclass
class _Store:
    """A finished decode's per-layer keys and values [B, kv_heads, L, head_dim], shared by its rows, and the
    columns each row keeps, ``kept`` [B, W] bool on their device (its conversation's tokens, in order: a call's
    gather index is built from it there, without a copy to or from the host)."""

    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    kept: torch.Tensor


@dataclass
class _Cached:
    """A conversation's cached tokens: row ``row`` of ``store`` holds them, at the columns its ``kept`` marks."""

    tokens: List[int]
    store: _Store
    row: int


def cut(tokens: torch.Tensor, limits: Sequence[int], stops: Sequence[int]) -> Tuple[torch.Tensor, List[str]]:
    """How many of each row's decoded ``tokens`` [B, T] are its response -- up to and with its first stop token,
    at most its entry of ``limits`` -- [B], and why it ended there ("stop" or "length")."""
    steps = tokens.shape[1]
    limit = torch.tensor(list(limits), dtype=torch.long, device=tokens.device)
    within = torch.arange(steps, device=tokens.device)[None, :] < limit[:, None]
    hit = torch.isin(tokens, torch.tensor(sorted(stops), dtype=tokens.dtype, device=tokens.device)) & within
    stopped = hit.any(1)
    # argmax returns the first of equal maxima: the first stop token's column
    n = torch.where(stopped, hit.to(torch.uint8).argmax(1) + 1, limit)
    return n, ["stop" if s else "length" for s in stopped.tolist()]


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token lists left-padded to the longest: ids and attention mask [len(rows), width]."""
    width = max(1, max(len(r) for r in rows))
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    mask = torch.arange(width)[None, :] >= width - lengths[:, None]
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    ids[mask] = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.long)  # row by row, in order
    return ids, mask.long()


def padded(parts: Sequence[Part], rows: int, pad: int) -> GenerationOutput:
    """The parts' rows as one output of ``rows`` rows in the call's order, right-padded as ``pad_completions``
    lays them out (log-probs 0 where a part has none), with no texts."""
    width = max([1] + [int(n.max()) for _, _, n, _, _ in parts if len(n)])
    ids = torch.full((rows, width), pad, dtype=torch.int64)
    mask = torch.zeros((rows, width), dtype=torch.int64)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    reasons = [""] * rows
    for members, tokens, n, lps, why in parts:
        index = torch.tensor(members, dtype=torch.long)
        w = min(width, tokens.shape[1])
        inside = torch.arange(w)[None, :] < n[:, None]
        ids[index, :w] = tokens[:, :w].to(torch.int64).masked_fill(~inside, pad)
        mask[index, :w] = inside.to(torch.int64)
        if lps is not None:
            logprobs[index, :w] = lps[:, :w].to(torch.float32).masked_fill(~inside, 0.0)
        for k, i in enumerate(members):
            reasons[i] = why[k]
    return GenerationOutput(prompt_index=torch.arange(rows, dtype=torch.int64), response_ids=ids, response_mask=mask,
                            logprobs=logprobs, finish_reasons=reasons)


def pack(cached: Sequence[Optional[_Cached]], device: torch.device) -> static_kv.Past:
    """The rows' cached columns right-aligned in as many columns as the longest holds (a row without a
    cache: none valid), one gather per layer and source decode, its index built on the device from one copy of
    the rows' lengths and places (a copy from the host waits for the device's queue: made before any gather)."""
    lengths = [0 if c is None else len(c.tokens) for c in cached]
    C, B = max(lengths), len(cached)
    sources: Dict[int, Tuple[_Store, List[int]]] = {}
    for b, c in enumerate(cached):
        if c is not None:
            sources.setdefault(id(c.store), (c.store, []))[1].append(b)
    groups = list(sources.values())
    members = [b for _, group in groups for b in group]
    index = torch.tensor(lengths + [cached[b].row for b in members] + members, dtype=torch.long).to(device)
    position, rows, places = index[:B], index[B : B + len(members)], index[B + len(members):]
    valid = torch.arange(C, device=device)[None, :] >= (C - position)[:, None]  # each row's last columns
    layers = len(groups[0][0].keys)
    whole = len(groups) == 1 and len(members) == B  # one source, every row: no scatter
    keys: List[Any] = [None] * layers
    values: List[Any] = [None] * layers
    start = 0
    for store, group in groups:
        _, heads, length, dim = store.keys[0].shape
        src, where = rows[start : start + len(group)], places[start : start + len(group)]
        start += len(group)
        # each row's source columns, right-aligned: a stable sort of its kept marks puts its kept columns last, in
        # order (column 0 where it has none: never attended)
        order = torch.sort(store.kept.index_select(0, src).to(torch.uint8), dim=1, stable=True).indices
        width = min(C, order.shape[1])
        cols = torch.zeros((len(group), C), dtype=torch.long, device=device)
        cols[:, C - width:] = order[:, order.shape[1] - width:]
        cols.masked_fill_(~(valid if whole else valid.index_select(0, where)), 0)
        # flat row index of [row, head, column] in a [B * heads * length, dim] view of the source
        flat = ((src[:, None, None] * heads + torch.arange(heads, device=device)[None, :, None]) * length
                + cols[:, None, :]).reshape(-1)
        for out, held in ((keys, store.keys), (values, store.values)):
            for layer in range(layers):
                part = held[layer].reshape(-1, dim).index_select(0, flat).view(len(group), heads, C, dim)
                if whole:
                    out[layer] = part
                    continue
                if out[layer] is None:
                    out[layer] = part.new_zeros((B, heads, C, dim))
                out[layer].index_copy_(0, where, part)
    return static_kv.Past(keys, values, valid, position)


class TurnCache:
    """Each conversation's keys and values between the turns of one rollout (see the module docstring).
    ``engine``: the ``HFGenerateEngine`` that decodes; ``eos``: the ids that end a response."""

    def __init__(self, engine: Any, eos: Sequence[int]):
        self.engine, self.eos = engine, list(eos)
        self.rows: Dict[Hashable, _Cached] = {}
        self.calls: List[Dict[str, int]] = []  # per decode: rows, prefilled, reused tokens, restarted
        self.decoder: Any = None  # the last decode's hf_decode._Decoder (its buffers, its step's graph)
        self.tokens = 0  # the longest conversation a rollout expects (``reserve``)
        self._held: Optional[contextlib.ExitStack] = None  # the engine's decoding state, entered by ``hold``
        self._figures: Dict[str, float] = {}  # the calls' phases since ``call_metrics`` last read them

    def reserve(self, tokens: int) -> None:
        """The most tokens a conversation of this rollout reaches (its prompt and its whole budget): a new
        decoder's cache holds that many and a turn's new tokens, so that later turns restart in it."""
        self.tokens = max(int(tokens), 0)

    def drop(self, key: Hashable) -> None:
        """Frees a finished conversation's cache (its decode's memory goes when no row holds it)."""
        self.rows.pop(key, None)

    def hold(self) -> None:
        """The engine's decoding state (``HFGenerateEngine.holding``: eval mode, whole parameters, autocast, the
        compiled loop's weight copies) entered now and kept until ``release`` / ``close``, so that each call of a
        rollout's turns (on this thread) finds it entered rather than entering it again. A call that goes to the
        engine's ``generate`` releases it first."""
        if self._held is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.engine.holding(self.engine._module()))
            self._held = stack

    def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()

    def close(self) -> None:
        self.release()
        self.rows.clear()
        self.decoder = None

    def call_metrics(self) -> Dict[str, float]:
        """The phases of the calls since ``call_metrics`` last read them, summed, in seconds: ``launch_s`` from a
        call's entry to its prefill's launch (the rows' caches taken and packed, the decode set up) and
        ``return_s`` from its tokens on the host to its return (the rows' caches kept, the output built)."""
        figures, self._figures = self._figures, {}
        return figures

    def _add(self, key: str, seconds: float) -> None:
        self._figures[key] = self._figures.get(key, 0.0) + seconds

    def metrics(self) -> Dict[str, float]:
        """``prefill_tokens`` (fed through the model), ``prefill_tokens_saved`` (served from the cache) and
        ``prefill_tokens_per_call``, over the calls so far."""
        fed = sum(c["prefilled"] for c in self.calls)
        return {"prefill_tokens": float(fed), "prefill_tokens_saved": float(sum(c["reused"] for c in self.calls)),
                "prefill_tokens_per_call": fed / max(len(self.calls), 1)}

    def generate(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]],
                 sampling: Union[SamplingSpec, Sequence[SamplingSpec]]) -> GenerationOutput:
        """One response per conversation (``n`` 1), as ``RolloutEngine.generate`` returns it but for its texts
        (none: the callers keep tokens, and a rollout's turns would decode every row for nothing); the prompts
        whose specs share a sampling decode together (a seed, as the engine's, seeds the call once)."""
        entered = time.perf_counter()
        specs = [sampling] * len(prompts) if isinstance(sampling, SamplingSpec) else list(sampling)
        if not (len(keys) == len(prompts) == len(specs)):
            raise ValueError(f"TurnCache.generate: one key and one spec per prompt expected: {len(keys)} keys, "
                             f"{len(prompts)} prompts, {len(specs)} specs")
        for spec in specs:
            spec.validate()
            if spec.n != 1:
                raise ValueError(f"TurnCache.generate decodes one response per conversation (n=1), got n={spec.n}")
        seeds = [s.seed for s in specs if s.seed is not None]
        if seeds:
            torch.manual_seed(seeds[0])
        groups: Dict[SamplingSpec, List[int]] = {}
        for i, spec in enumerate(specs):
            groups.setdefault(replace(spec, seed=None, max_tokens=1), []).append(i)
        parts: List[Part] = []
        stamps: Dict[str, float] = {"since": entered}  # the decodes' launches and ends (``_decode``)
        for spec, members in groups.items():
            spec = replace(spec, max_tokens=max(specs[i].max_tokens for i in members))
            if self.engine._fast_reason(spec) is not None:
                self._plain(members, keys, prompts, specs, parts)
                continue
            cached = [self._take(keys[i], prompts[i]) for i in members]
            chunks, columns = self._chunks(cached, [prompts[i] for i in members], spec)
            for start, end in chunks:
                self._decode(members[start:end], cached[start:end], keys, prompts, specs, spec, columns, parts,
                             later=cached[end:], stamps=stamps)
        out = padded(parts, len(prompts), self.engine.pad_token_id)
        if "ended" in stamps:
            self._add("return_s", time.perf_counter() - stamps["ended"])
        return out

    def _take(self, key: Hashable, prompt: Sequence[int]) -> Optional[_Cached]:
        """The conversation's cache, taken out (its rows are rewritten after the call), where its tokens
        begin ``prompt`` and leave at least one token to feed; else None (and the cache dropped)."""
        c = self.rows.pop(key, None)
        if c is None or len(c.tokens) >= len(prompt) or list(prompt[: len(c.tokens)]) != c.tokens:
            return None
        return c

    def _chunks(self, cached: List[Optional[_Cached]], prompts: List[Sequence[int]],
                spec: SamplingSpec) -> Tuple[List[Tuple[int, int]], int]:
        """The group's rows in calls the device's room holds (``decode_memory.prompts_per_call`` at the packed
        width: cached columns, new tokens, the turn's tokens, and the packed copy beside), and a new
        decoder's least cache width: the reserved one (``_columns``) where the whole group fits it in one
        call, else none (the call's own width)."""
        engine = self.engine
        room = engine._room_bytes()
        rows = len(prompts)
        if room is None:
            return [(0, rows)], self._columns(spec)
        C = max((len(c.tokens) for c in cached if c is not None), default=0)
        width = C + max(len(p) - (0 if c is None else len(c.tokens)) for p, c in zip(prompts, cached))
        config = engine._module().config
        element = engine.kv_element_bytes()
        packed = decode_memory.kv_bytes_per_token(getattr(config, "text_config", None) or config, element) * C
        reserved = self._columns(spec)
        if reserved and decode_memory.prompts_per_call(config, max(width, reserved - spec.max_tokens), spec.max_tokens,
                                                   1, rows, room - packed * rows, element) >= rows:
            return [(0, rows)], reserved
        per_call = decode_memory.prompts_per_call(config, width, spec.max_tokens, 1, rows, room - packed * rows, element)
        return [(s, min(s + per_call, rows)) for s in range(0, rows, per_call)], 0

    def _plain(self, members: List[int], keys, prompts, specs, parts: List[Part]) -> None:
        """Rows the static-cache loop cannot serve: the engine's own ``generate``, nothing cached (and the
        decoding state ``hold`` kept let go: generate enters its own)."""
        self.release()
        for i in members:
            self.rows.pop(keys[i], None)
        out = self.engine.generate([prompts[i] for i in members], [specs[i] for i in members])
        parts.append((members, out.response_ids, out.response_mask.sum(1), out.logprobs, list(out.finish_reasons)))

    def _decode(self, members: List[int], cached: List[Optional[_Cached]], keys, prompts, specs,
                spec: SamplingSpec, columns: int, parts: List[Part], later: List[Optional[_Cached]],
                stamps: Dict[str, float]) -> None:
        """One decode of ``members`` (their caches ``cached``; a new decoder's cache at least ``columns``
        wide), its rows appended to ``parts``, each row's cache rewritten after it; ``later``: the caches of the
        call's chunks still to decode.
        ``stamps``: ``since`` (when the call or its previous chunk's decode ended), the prefill's launch and the
        decode's end written into it (``hf_decode.decode``'s ``stamps``), their phases added to the figures."""
        engine = self.engine
        module = engine._module()
        device = engine.device
        new = [prompts[i][0 if c is None else len(c.tokens):] for i, c in zip(members, cached)]
        ids, mask = left_pad(new, engine.pad_token_id)
        continued = any(c is not None for c in cached)
        if continued:  # the new tokens copied over before the gathers are queued (a copy from the host waits for them)
            ids, mask = ids.to(device), mask.to(device)
        past = pack(cached, device) if continued else None
        reused = sum(len(c.tokens) for c in cached if c is not None)
        # a first turn prefills each distinct prompt once (the engine's dedup of a prompt's samples)
        fed = sum(len(n) for n in (new if continued else set(map(tuple, new))))
        del cached  # the old decodes' memory goes once no other row holds it
        eos = self.eos
        kept: List[Any] = []
        reuse = self._restartable(later)
        self.decoder = None  # (a failed call leaves none behind)
        with engine.decoding(module):
            tokens, logprobs, mode = engine.decode_fast(module, ids, mask, spec, eos, 1, past=past, keep=kept,
                                                        reuse=reuse, columns=columns, stamps=stamps)
        launched = stamps.pop("launched", None)
        if launched is not None and "ended" in stamps:
            self._add("launch_s", launched - stamps["since"])
            stamps["since"] = stamps["ended"]
        if tokens is None:  # the loop failed (the engine logged why and uses generate from now on)
            self._plain(members, keys, prompts, specs, parts)
            return
        engine.last_mode = mode
        dec = self.decoder = kept[0]
        n, reasons = cut(tokens, [specs[i].max_tokens for i in members], set(eos) | set(spec.stop_token_ids))
        parts.append((members, tokens, n, logprobs if spec.logprobs else None, reasons))
        # the columns each row keeps: its prefill's valid ones (the past's and the new tokens'), then those of its
        # sampled tokens but the last (never fed), marked on the device
        valid = dec.valid
        sampled = torch.arange(tokens.shape[1], device=valid.device)[None, :] < (n - 1).to(valid.device)[:, None]
        store = _Store(dec.cache.keys, dec.cache.values, torch.cat([valid[:, : dec.prefilled], sampled], 1))
        rows, lengths = tokens.tolist(), n.tolist()  # one conversion each
        for b, i in enumerate(members):
            self.rows[keys[i]] = _Cached(list(prompts[i]) + rows[b][: lengths[b] - 1], store, b)
        self.calls.append({"rows": len(members), "prefilled": fed, "reused": reused,
                           "restarted": int(dec is reuse)})

    def _restartable(self, later: List[Optional[_Cached]]) -> Any:
        """The previous decoder, where no conversation outside this call, nor one of its chunks still to decode
        (``later``), still holds its cache (else None): a restart overwrites it."""
        dec = self.decoder
        holders = [*self.rows.values(), *(c for c in later if c is not None)]
        if not RESTART or dec is None or any(c.store.keys is dec.cache.keys for c in holders):
            return None
        return dec

    def _columns(self, spec: SamplingSpec) -> int:
        """A new decoder's least cache width: ``reserve``'s tokens, the turn's, and the columns the compiled
        loop may pad a first turn's prompts with (0: as wide as the call needs)."""
        return self.tokens + spec.max_tokens + hf_decode.CompiledForward.WIDTH if self.tokens else 0
