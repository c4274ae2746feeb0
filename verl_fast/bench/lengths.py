"""Response lengths written into a random-weight model's weights: every engine that loads the saved model
(our compiled decode, HF ``generate``, vLLM, TRL on either) samples the same length distribution, with no
hook and without any side knowing the lengths.

A random-weight model almost never emits EOS, so every response runs to the cap. ``install`` rewrites a
few weights of a pre-norm decoder (Qwen2 / Llama layout, tied or untied embeddings) so that at
temperature 1 the EOS probability of every step is ``e^B / (e^B + V - 1)``, ``B = bias + z``, where ``z``
is the mean value of the digit characters in the row's prompt (each of '0'..'9' gets a value drawn once,
``spread`` times a standard normal): a row's length is geometric with a rate its prompt sets, and the
rows of a batch are a mixture of geometrics with log-normally spread rates, heavy-tailed as users'
responses are. Four dimensions of the residual stream are reserved (the last four, H = hidden size):

- CONST: every token's embedding holds ``K`` there and no block writes it, so every RMSNorm divides by
  about ``K / sqrt(H)``: the other dimensions reach the blocks and the head squashed (near-uniform logits
  over the vocabulary, every non-EOS logit near 0), and the reserved entries of a normed hidden are known
  linear functions of the stream's.
- MARK: 1 on the digit tokens; VALUE: their value.
- RATE: written by one attention head of layer 0 alone. Its query reads CONST and its key MARK, both in
  the head's lowest-frequency rotary slot (nearly constant over 16k positions at rope theta 1e6), so it
  attends to the digit positions, all alike; its value reads VALUE plus a bias: RATE = ``bias`` + the mean
  value of the digits so far (the prompt's; a generated digit, 10 tokens in ~49k, joins the mean).
- The EOS row of the LM head reads RATE with weight ``K / sqrt(H)``: the EOS logit is ``B``.

No block writes a reserved dimension (their rows of every ``o_proj`` / ``down_proj`` are zero but the one
entry of the RATE head), and the final norm's weight is 0 on CONST, MARK and VALUE (with tied embeddings
the LM head's rows are the embeddings). ``predicted`` gives the distribution a set of prompts will see;
``calibrate`` chooses ``bias`` and ``spread`` for a target median and 99th percentile; ``figures`` reports
measured lengths.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

DIGITS = "0123456789"
CONST_VALUE = 2048.0  # K: a power of two, exact in bf16, ~1000x the squashed dimensions' norm
MIN_ROPE_THETA = 1e5  # the marked positions' scores must stay alike over the cap
ATTENTION_SCORE = 40.0  # the RATE head's score of a digit position (others score 0)


@dataclass(frozen=True)
class LengthSpec:
    """The mechanism's two parameters: the EOS logit ``bias`` and the digit values' ``spread``."""

    bias: float
    spread: float
    seed: int = 0

    def digit_values(self) -> Dict[str, float]:
        rng = random.Random(self.seed)
        return {d: self.spread * rng.gauss(0.0, 1.0) for d in DIGITS}


def digit_tokens(tokenizer) -> Dict[int, str]:
    """The token ids of the single characters '0'..'9' (each must be one token of ``tokenizer``)."""
    out = {}
    for d in DIGITS:
        ids = tokenizer.encode(d, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer splits the digit {d!r} into {ids}; the length mechanism needs each "
                             "digit to be one token")
        out[ids[0]] = d
    return out


def _reserved(hidden: int) -> Tuple[int, int, int, int]:
    """(CONST, MARK, VALUE, RATE) dimensions: the last four."""
    return hidden - 1, hidden - 2, hidden - 3, hidden - 4


@torch.no_grad()
def install(model: torch.nn.Module, tokenizer, spec: LengthSpec) -> None:
    """Rewrites ``model``'s weights in place (module docstring). ``model``: a Hugging Face causal LM with
    ``model.model.embed_tokens``, ``layers[i].self_attn.{q,k,v,o}_proj``, ``layers[i].mlp.down_proj``,
    ``model.model.norm`` and ``lm_head``, built with rope theta >= 1e5."""
    cfg = model.config
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None or theta < MIN_ROPE_THETA:
        raise ValueError(f"the length mechanism needs rope theta >= {MIN_ROPE_THETA:g} (build the config with "
                         f"rope_theta=1e6, as Qwen2.5 has), got {theta}")
    eos = tokenizer.eos_token_id
    H, K = cfg.hidden_size, CONST_VALUE
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    const, mark, value, rate = _reserved(H)
    reserved = list(_reserved(H))
    emb = model.model.embed_tokens.weight
    values = spec.digit_values()
    emb[:, reserved] = 0.0
    emb[:, const] = K
    for tok, d in digit_tokens(tokenizer).items():
        emb[tok, mark] = 1.0
        emb[tok, value] = values[d]
    scale = K / math.sqrt(H)  # a normed hidden's reserved entry is the stream's over this
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.weight[reserved, :] = 0.0
        layer.mlp.down_proj.weight[reserved, :] = 0.0
        if i == 0:
            _rate_head(layer.self_attn, H, hd, scale, spec.bias)
    model.model.norm.weight[[const, mark, value]] = 0.0
    model.model.norm.weight[rate] = 1.0
    head = model.lm_head.weight  # the embeddings themselves when tied
    if head.data_ptr() != emb.data_ptr():
        head[:, reserved] = 0.0
    head[eos, rate] = scale


def _rate_head(attn: torch.nn.Module, H: int, hd: int, scale: float, bias: float) -> None:
    """Query head 0 of layer 0 writes RATE = ``bias`` + the mean VALUE of the digit positions (its key-value
    group's slots it uses are rewritten; the other heads of the group read them as any other slot)."""
    const, mark, value, rate = _reserved(H)
    slot = hd // 2 - 1  # the lowest rotary frequency's first component
    weight = math.sqrt(ATTENTION_SCORE * math.sqrt(hd)) / math.sqrt(H) * math.sqrt(CONST_VALUE)
    # score = (w sqrt(H)) (w sqrt(H) / K) / sqrt(hd) = ATTENTION_SCORE for a digit position, 0 elsewhere
    for proj, rows in ((attn.q_proj, range(0, hd)), (attn.k_proj, (slot, slot + hd // 2)), (attn.v_proj, (0,))):
        proj.weight[list(rows), :] = 0.0
        if proj.bias is not None:
            proj.bias[list(rows)] = 0.0
    attn.q_proj.weight[slot, const] = weight
    attn.k_proj.weight[slot, mark] = weight
    attn.v_proj.weight[0, value] = scale  # VALUE as it was in the stream
    if attn.v_proj.bias is not None:
        attn.v_proj.bias[0] = bias
    else:  # no bias (Llama): CONST carries it, sqrt(H) in the normed hidden
        attn.v_proj.weight[0, const] = bias / math.sqrt(H)
    attn.o_proj.weight[rate, 0] = 1.0


# ---------------------------------------------------------------- the distribution it gives


def prompt_rate(prompt_ids: Sequence[int], digits: Dict[int, str], spec: LengthSpec, vocab: int) -> float:
    """The per-step EOS probability of the rows answering ``prompt_ids``."""
    values = spec.digit_values()
    seen = [values[digits[t]] for t in prompt_ids if t in digits]
    logit = spec.bias + (statistics.fmean(seen) if seen else 0.0)
    return 1.0 / (1.0 + (vocab - 1) * math.exp(-logit))


def predicted(rates: Sequence[float], cap: int) -> Dict[str, float]:
    """The figures of ``figures`` for rows whose per-step EOS rates are ``rates`` (geometric lengths, EOS
    counted, at most ``cap``), from the mixture's exact distribution."""
    h = torch.tensor(list(rates), dtype=torch.float64)[:, None]
    k = torch.arange(1, cap + 1, dtype=torch.float64)[None, :]
    mass = h * (1 - h) ** (k - 1)  # P(length = k): k - 1 steps without EOS, then EOS
    mass[:, -1] = (1 - h[:, 0]) ** (cap - 1)  # the cap: no EOS before it
    mass = mass.mean(0)
    cdf = mass.cumsum(0)

    def quantile(q: float) -> int:
        return int(torch.searchsorted(cdf, torch.tensor([q - 1e-12], dtype=torch.float64)).item()) + 1

    return {"median": quantile(0.5), "p90": quantile(0.9), "p99": quantile(0.99),
            "mean": float((mass * k[0]).sum()), "at_cap": float(mass[-1])}


def calibrate(prompts: Sequence[Sequence[int]], tokenizer, vocab: int, cap: int, median: int,
              spread: float) -> LengthSpec:
    """The ``bias`` whose predicted median over ``prompts`` is ``median`` (the smallest such bias, found by
    bisection on the EOS logit; a median below ``cap``) at this ``spread``."""
    digits = digit_tokens(tokenizer)
    lo, hi = -10.0, math.log(vocab) + 10.0
    for _ in range(40):
        mid = (lo + hi) / 2
        spec = LengthSpec(mid, spread)
        got = predicted([prompt_rate(p, digits, spec, vocab) for p in prompts], cap)["median"]
        lo, hi = (mid, hi) if got > median else (lo, mid)
    return LengthSpec(hi, spread)  # the side whose median is at most ``median``


def figures(lengths: Sequence[int], cap: int) -> Dict[str, float]:
    """Median, 90th / 99th percentile, mean, max and the fraction at the cap of measured ``lengths``."""
    if not lengths:
        return {}
    ordered = sorted(lengths)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"rows": len(ordered), "median": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": ordered[-1],
            "mean": statistics.fmean(ordered), "at_cap": sum(n >= cap for n in ordered) / len(ordered)}


def targets(cap: int) -> Tuple[int, float]:
    """(median, spread) of the benchmarks at ``cap``: a median of a few hundred tokens (600 from a 4k cap
    up, 1/5 of a smaller cap) and a spread whose 99th percentile reaches about the cap."""
    if cap >= 8192:
        return 600, 1.4
    return (600, 1.0) if cap >= 4096 else (max(8, cap // 5), 0.5)


def spec_for(prompts: Sequence[Sequence[int]], tokenizer, vocab: int, cap: int,
             median: Optional[int] = None) -> LengthSpec:
    """The benchmarks' ``LengthSpec`` at ``cap`` for ``prompts`` (``targets``, ``median`` overriding)."""
    want, spread = targets(cap)
    return calibrate(prompts, tokenizer, vocab, cap, median or want, spread)


def measured_lengths(mask: torch.Tensor) -> List[int]:
    """Response lengths (EOS counted) of a ``[N, L]`` response mask."""
    return [int(n) for n in mask.sum(-1).tolist()]
