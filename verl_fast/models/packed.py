"""Response log-probs over packed sequences: a micro-batch's rows with their padding removed and
concatenated into one sequence of T tokens (``actor.use_remove_padding``), each group's prompt
once when its rows share it.

The padded forward runs [N, P + L] tokens, left padding and right padding included, under a 4-D
mask. Packed, only the T real tokens run (or fewer: a group's prompt runs once, and its responses
attend to it), and the vocabulary projection only where a response token is predicted. Which
tokens see which is one rule, two ways to apply it:

- ``varlen``: torch's variable-length flash attention (``torch.nn.attention.varlen``; CUDA, bf16 /
  fp16), with cumulative sequence offsets instead of a mask. A query sequence is a group's prompt
  or one response; a response's keys are its group's prompt then itself (``k_index`` gathers the
  prompt's keys and values again for each response), aligned bottom-right under the causal mask,
  so response token j sees the prompt and response tokens 0..j. Nothing is built per shape: cuDNN's
  SDPA, which the padded forward gets on Hopper, builds (and, for a new kernel variant, compiles)
  a plan for every new shape, about a second for a step whose micro-batches changed shape
  (``benchmarks/NOTES.md``). A micro-batch that is one long sequence (``LONG_SEQUENCE`` tokens or more:
  the update at long caps, where the attention is most of the work) is the exception: it attends as one
  dense causal call through cuDNN's fused attention, torch's flash kernel where cuDNN does not take it
  (``one_long_sequence``), its bucketed length keeping the plans few. Elsewhere (CPU, fp32) the same
  sequences run one at a time through ``scaled_dot_product_attention`` (the reference the GPU test
  checks against).
- ``dense``: the model's own sdpa / eager attention with a [T, T] boolean mask, for small CPU
  batches (up to ``DENSE_MAX_TOKENS``), where one masked call beats a loop over sequences.

The layout is built on the host from the attention mask (one small copy), vectorised. It needs
each row's real tokens to be contiguous (a left-padded prompt, then the response) and a prompt
token before every response; otherwise ``layout`` returns None and the caller runs the padded
forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from verl_fast.ops.logprobs import logprobs_from_logits

ATTENTION = "verl_fast_varlen"  # the name the packed forward's attention is registered under
DENSE_MAX_TOKENS = 4096  # the dense path's [T, T] mask and scores stay small (4096^2 booleans = 16 MiB)
LONG_SEQUENCE = 8192  # one sequence of at least this many tokens attends through cuDNN's fused attention


@dataclass(frozen=True)
class PackedLayout:
    """Where each packed token comes from and which tokens it attends (module docstring)."""

    source: torch.Tensor  # [T] flat index into input_ids [N * (P + L)]
    position: torch.Tensor  # [T] its position id
    cu_q: torch.Tensor  # [S + 1] int32 offsets of the query sequences in the packed tokens
    cu_k: torch.Tensor  # [S + 1] int32 offsets of their key sequences in the gathered keys
    k_index: Optional[torch.Tensor]  # [Tk] packed token of each key; None: the keys are the queries
    bounds: Tuple[Tuple[int, ...], Tuple[int, ...]]  # cu_q, cu_k on the host
    group: torch.Tensor  # [T] the token's group (its row without sharing)
    owner: torch.Tensor  # [T] the token's row; -1 for a shared prompt's tokens, seen by the whole group
    predictor: torch.Tensor  # [M] packed token whose output predicts response token m
    target: torch.Tensor  # [M] flat index into input_ids of response token m
    slot: torch.Tensor  # [M] flat index into [N, L]
    pairs: int  # query-key pairs attended (causal) by the real tokens, for FLOP counts
    filler: int = 0  # tokens of the filler sequence at the end (``bucketed``)

    @property
    def tokens(self) -> int:
        """The real tokens (the filler left out)."""
        return int(self.source.numel()) - self.filler

    @property
    def max_q(self) -> int:
        cu = self.bounds[0]
        return max(b - a for a, b in zip(cu, cu[1:]))

    @property
    def max_k(self) -> int:
        cu = self.bounds[1]
        return max(b - a for a, b in zip(cu, cu[1:]))


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def bucket(tokens: int) -> int:
    """``tokens`` rounded up to a multiple of 1/16 of its power of two (at least 128): at most ~6%
    more tokens, and 16 sizes per doubling, so that micro-batches of nearby sizes run the same
    shapes (a matmul of a shape it has not seen costs the GPU libraries a plan search)."""
    step = max(128, 1 << max(int(tokens).bit_length() - 5, 0))
    return -(-int(tokens) // step) * step


def layout(attention_mask: torch.Tensor, response_length: int,
           groups: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
           max_tokens: Optional[int] = None, bucketed: bool = False) -> Optional[PackedLayout]:
    """The packed layout of a [N, P + L] batch (left-padded prompts, right-padded responses), on
    ``attention_mask``'s device; ``groups`` (``shared_prefix.prompt_groups``): rows whose prompts are
    identical share one copy; ``bucketed``: a filler sequence (attending only itself, predicting
    nothing) brings the packed tokens up to ``bucket``'s size. None when a row's tokens are not
    contiguous, a response has no prompt token before it, or the packed tokens exceed ``max_tokens``."""
    device = attention_mask.device
    keep = attention_mask.detach().to("cpu", torch.bool)
    N, W = keep.shape
    L = int(response_length)
    P = W - L
    p_len, r_len = keep[:, :P].sum(1), keep[:, P:].sum(1)
    cols = torch.arange(W)
    if not torch.equal(keep, (cols >= P - p_len[:, None]) & (cols < P + r_len[:, None])):
        return None
    live = (r_len > 0).nonzero()[:, 0]
    if live.numel() == 0 or bool((p_len[live] == 0).any()):
        return None
    if groups is None:
        # one sequence per live row: prompt then response, attending itself
        seg_row, seg_col0, seg_len = live, P - p_len[live], p_len[live] + r_len[live]
        seg_pos0, seg_prefix = torch.zeros_like(live), torch.zeros_like(live)
        seg_group, seg_owner = live, live
        resp_seg = torch.arange(live.numel())
    else:
        first, row_group = (t.detach().cpu() for t in groups)
        g_live = torch.unique(row_group[live])  # groups with something to predict
        prompt_row = first[g_live]
        # the prompts first (one sequence each), then each live row's response
        seg_row = torch.cat([prompt_row, live])
        seg_col0 = torch.cat([P - p_len[prompt_row], torch.full_like(live, P)])
        seg_len = torch.cat([p_len[prompt_row], r_len[live]])
        seg_pos0 = torch.cat([torch.zeros_like(prompt_row), p_len[live]])
        seg_prefix = torch.cat([torch.zeros_like(prompt_row), p_len[live]])  # keys gathered from the prompt
        g_slot = torch.full((int(row_group.max()) + 1,), -1, dtype=torch.long)
        g_slot[g_live] = torch.arange(g_live.numel())  # group -> its prompt's sequence
        seg_group = torch.cat([g_live, row_group[live]])
        seg_owner = torch.cat([torch.full_like(prompt_row, -1), live])
        resp_seg = g_live.numel() + torch.arange(live.numel())
        resp_prompt_seg = g_slot[row_group[live]]
    S = seg_row.numel()
    cu_q = _offsets(seg_len)
    T = int(cu_q[-1])
    if max_tokens is not None and T > max_tokens:
        return None
    tok_seg = torch.repeat_interleave(torch.arange(S), seg_len)
    off = torch.arange(T) - cu_q[tok_seg]
    source = seg_row[tok_seg] * W + seg_col0[tok_seg] + off
    position = seg_pos0[tok_seg] + off
    k_len = seg_len + seg_prefix
    cu_k = _offsets(k_len)
    if groups is None:
        k_index = None
    else:  # a response's keys: its group's prompt (from that prompt's sequence), then its own tokens
        prompt_of_seg = torch.cat([torch.arange(g_live.numel()), resp_prompt_seg])
        k_seg = torch.repeat_interleave(torch.arange(S), k_len)
        k_off = torch.arange(int(cu_k[-1])) - cu_k[k_seg]
        prefix = seg_prefix[k_seg]
        k_index = torch.where(k_off < prefix, cu_q[prompt_of_seg[k_seg]] + k_off, cu_q[k_seg] + k_off - prefix)
    # response token j of row r: column P + j, predicted by the packed token before it
    m_row = torch.repeat_interleave(live, r_len[live])
    m_seg = torch.repeat_interleave(resp_seg, r_len[live])
    j = torch.arange(m_row.numel()) - _offsets(r_len[live])[:-1].repeat_interleave(r_len[live])
    if groups is None:
        predictor = cu_q[m_seg] + p_len[m_row] + j - 1
    else:
        last_prompt = cu_q[resp_prompt_seg + 1] - 1  # the prompt's last token, per live row
        predictor = torch.where(j == 0, last_prompt.repeat_interleave(r_len[live]), cu_q[m_seg] + j - 1)
    q_n, k_n = seg_len, k_len
    pairs = int((q_n * (k_n - q_n) + q_n * (q_n + 1) // 2).sum())
    group, owner = seg_group[tok_seg], seg_owner[tok_seg]
    filler = bucket(T) - T if bucketed else 0
    if filler:  # one more sequence: copies of the first token, its own keys, in a group of its own
        source = torch.cat([source, source[:1].expand(filler)])
        position = torch.cat([position, torch.arange(filler) % 128])  # within any model's positions
        cu_q = torch.cat([cu_q, cu_q[-1:] + filler])
        if k_index is not None:
            k_index = torch.cat([k_index, T + torch.arange(filler)])
        cu_k = torch.cat([cu_k, cu_k[-1:] + filler])
        group = torch.cat([group, torch.full((filler,), -2, dtype=group.dtype)])
        owner = torch.cat([owner, torch.full((filler,), -3, dtype=owner.dtype)])
    to = functools.partial(torch.Tensor.to, device=device, non_blocking=True)
    return PackedLayout(
        source=to(source), position=to(position), cu_q=to(cu_q.int()), cu_k=to(cu_k.int()),
        k_index=None if k_index is None else to(k_index), bounds=(tuple(cu_q.tolist()), tuple(cu_k.tolist())),
        group=to(group), owner=to(owner), predictor=to(predictor),
        target=to(m_row * W + P + j), slot=to(m_row * L + j), pairs=pairs, filler=filler)


def causal_pairs(seq_lens: torch.Tensor) -> float:
    """Query-key pairs of causal attention over sequences of ``seq_lens`` tokens each (a padded
    batch's rows; ``PackedLayout.pairs`` counts a packed one's)."""
    lens = seq_lens.double()
    return float((lens * (lens + 1) / 2).sum())


def dense_mask(lay: PackedLayout) -> torch.Tensor:
    """[T, T] boolean: token i attends token j (same group, not later, and j a shared prompt token
    or of i's own row): the rule the varlen sequences apply, as one mask."""
    same = lay.group[:, None] == lay.group[None, :]
    causal = lay.position[None, :] <= lay.position[:, None]
    seen = (lay.owner[None, :] == -1) | (lay.owner[None, :] == lay.owner[:, None])
    return same & causal & seen


# ---------------------------------------------------------------- attention


@functools.lru_cache(maxsize=1)
def _varlen_kernel():
    """torch's ``varlen_attn`` and the keywords this torch's version takes (it went from ``is_causal``
    in 2.9 to ``window_size`` in 2.10, and gained ``enable_gqa`` later), or None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def flash_available(device: torch.device, dtype: Optional[torch.dtype]) -> bool:
    """Whether the varlen path runs torch's flash kernel here (else the per-sequence reference)."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _varlen_kernel() is not None


def _flash(q, k, v, lay: PackedLayout, scale: Optional[float]) -> torch.Tensor:
    varlen_attn, params = _varlen_kernel()
    kw = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal, aligned bottom-right when a response's keys start with the prompt
    else:
        kw["is_causal"] = True
    if k.shape[1] != q.shape[1] and "enable_gqa" in params:
        kw["enable_gqa"] = True  # (before enable_gqa existed the wrapper checked no head counts: flash groups natively)
    return varlen_attn(q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, **kw)


def one_long_sequence(lay: PackedLayout) -> bool:
    """Whether the layout is one query sequence of at least ``LONG_SEQUENCE`` tokens attending itself (a
    bucket's filler after it allowed): it attends as one dense causal call (``_dense_causal``)."""
    cu_q = lay.bounds[0]
    return lay.k_index is None and len(cu_q) - 1 == 1 + bool(lay.filler) and cu_q[1] >= LONG_SEQUENCE


@functools.lru_cache(maxsize=1)
def _long_backends():
    """``sdpa_kernel``'s arguments for a long sequence: cuDNN's fused attention first, torch's flash kernel where
    cuDNN does not take the call (in that order where this torch's ``sdpa_kernel`` takes a priority)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], {"set_priority": True}
    return [SDPBackend.CUDNN_ATTENTION], {}


def _dense_causal(q, k, v, lay: PackedLayout, scale: Optional[float], backends=None) -> torch.Tensor:
    """A ``one_long_sequence`` layout's attention as one causal ``scaled_dot_product_attention`` over all its
    tokens ([T, H, D] queries, [T, Hkv, D] keys). The real tokens come first, so causality keeps them from the
    filler, whose outputs (its tokens then attend the real ones too) feed only its own positions, which predict
    nothing. ``backends``: ``sdpa_kernel``'s (default ``_long_backends``)."""
    from torch.nn.attention import sdpa_kernel

    chosen, kw = _long_backends() if backends is None else (backends, {})
    qd, kd, vd = (t.transpose(0, 1)[None] for t in (q, k, v))
    with sdpa_kernel(chosen, **kw):
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                             enable_gqa=kd.shape[1] != qd.shape[1])
    return out[0].transpose(0, 1)


def _reference(q, k, v, lay: PackedLayout, scale: Optional[float]) -> torch.Tensor:
    """The same attention one query sequence at a time ([T, H, D] queries, [Tk, Hkv, D] keys)."""
    group = q.shape[1] // k.shape[1]
    cu_q, cu_k = lay.bounds
    out = []
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s] : cu_q[s + 1]].transpose(0, 1)
        ks = k[cu_k[s] : cu_k[s + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[cu_k[s] : cu_k[s + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        n, m = qs.shape[1], ks.shape[1]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)  # bottom-right causal
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(out)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (registered as ``ATTENTION``): a packed forward's layers
    (``packed=<PackedLayout>``) attend through the varlen sequences; any other call of the model
    while the name is set goes to its own implementation (``attention_switched``). query [1, H, T, D],
    key / value [1, Hkv, T, D]; returns [1, T, H, D]."""
    lay = kwargs.pop("packed", None)
    if lay is None:
        return _original_attention(module)(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, **kwargs)
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"packed sequences do not implement attention {name}")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("packed sequences do not implement sliding-window attention")
    device = query.device.type
    # under autocast, queries and keys leave the float32 rotary product: attend in the autocast dtype,
    # as sdpa (on autocast's lower-precision list) would
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype
    # [T, heads, D], cast and laid out in one copy where one is needed (the rotary product is [heads, T, D])
    q, k, v = (t[0].transpose(0, 1).to(dtype, memory_format=torch.contiguous_format) for t in (query, key, value))
    if lay.k_index is not None:
        k, v = k[lay.k_index], v[lay.k_index]
    fast = flash_available(query.device, dtype)
    attend = (_dense_causal if one_long_sequence(lay) else _flash) if fast else _reference
    return attend(q, k, v, lay, scaling)[None], None


def _original_attention(module):
    """The attention function of the model's own implementation (``eager`` is each modeling file's own)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.config._verl_fast_attention
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(module).__module__].eager_attention_forward


def _mask_of_original(config, **kwargs):
    """Masks for the model's unpacked calls while ``ATTENTION`` is set: its own implementation's."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[config._verl_fast_attention](config=config, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, _mask_of_original)


_register()


@contextlib.contextmanager
def attention_switched(model: torch.nn.Module) -> Iterator[None]:
    """While active, ``model`` (an HF model, unwrapped) attends through ``varlen_attention``:
    packed forwards by the varlen sequences, others by its own implementation. Hold it over the
    backward too: a recomputed (gradient-checkpointed) layer looks the attention up again."""
    cfg = model.config
    if cfg._attn_implementation == ATTENTION:  # already switched by an outer caller
        yield
        return
    # a composite config (a vision-language model's) hands the name on to its sub-configs: the language
    # model's keeps it (its packed forwards), the others (the vision tower's) get their own back, since
    # transformers passes a tower's segment boundaries only to an implementation named for them
    # (``vision_attention``); a call that reaches varlen_attention unpacked goes to its own implementation
    configs = [cfg, *(getattr(cfg, key) for key in getattr(cfg, "sub_configs", {}) if getattr(cfg, key, None) is not None)]
    before = [c._attn_implementation for c in configs]
    for c, name in zip(configs, before):
        c._verl_fast_attention = name
    cfg._attn_implementation = ATTENTION
    text = cfg.get_text_config()
    for c, name in zip(configs[1:], before[1:]):
        if c is not text:
            c._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = before[0]
        for c, name in zip(configs, before):
            c._attn_implementation = name
            del c._verl_fast_attention


# ---------------------------------------------------------------- log-probs


def packed_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, lay: PackedLayout, response_length: int,
                    temperature: float = 1.0, with_entropy: bool = False, fused: bool = False,
                    attention: str = "varlen") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logprobs [N, L] float32, entropy [N, L] or None)`` of the response tokens from one packed
    forward (zeros past each response's end), differentiable. ``attention``: ``varlen`` (inside
    ``attention_switched``) or ``dense`` (the model's own sdpa / eager with the [T, T] mask);
    ``fused``: the lm_head + log-prob kernels on the predicting positions (``linear_logprobs``)."""
    from verl_fast.models.response_logprobs import head_returns_logprobs, output_head
    from verl_fast.models.wrapping import hf_module

    N, L = input_ids.shape[0], int(response_length)
    flat = input_ids.reshape(-1)
    labels = flat[lay.target]
    kwargs = dict(input_ids=flat[lay.source][None], position_ids=lay.position[None], logits_to_keep=lay.predictor,
                  use_cache=False)
    if attention == "varlen":
        # a ready 4-D mask makes transformers skip building one; the varlen attention ignores it
        kwargs.update(attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=flat.device), packed=lay)
    elif attention == "dense":
        mask = dense_mask(lay)
        if hf_module(model).config._attn_implementation == "eager":
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        kwargs["attention_mask"] = mask[None, None]
    else:
        raise ValueError(f"attention must be 'varlen' or 'dense', got {attention!r}")
    if fused:
        head = output_head(model)
        if head is None:
            raise ValueError("fused log-probs need an nn.Linear output head of the families "
                             "response_logprobs.FUSED_FAMILIES; use fused=False")
        with head_returns_logprobs(head, labels[None], temperature, with_entropy, shifted=False):
            out = model(**kwargs).logits[0]  # [M, 1 or 2]
        logp, entropy = out[:, 0], (out[:, 1] if with_entropy else None)
    else:
        result = logprobs_from_logits(model(**kwargs).logits[0], labels, temperature, with_entropy,
                                      check=False)  # input tokens, already looked up (response_logprobs)
        logp, entropy = result if with_entropy else (result, None)

    def spread(values: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(N * L, dtype=torch.float32, device=values.device)
        return full.index_put((lay.slot,), values.float()).view(N, L)

    return spread(logp), (spread(entropy) if entropy is not None else None)

