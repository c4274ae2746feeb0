"""Chunked torch implementation of the log-prob ops (the CPU path, and the fallback without Triton).

Same memory behaviour as the Triton kernels: fp32 work happens one chunk of at most
``CHUNK_ELEMENTS`` logits at a time, the forward keeps only per-token statistics, and the backward
recomputes each chunk. ``linear_*`` walks the vocabulary in chunks (like the Triton path), so each
chunk's weight gradient is written once and only the [N, H] hidden gradient accumulates (in fp32).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_fast.kernels.autograd import Impl
from verl_fast.kernels.softmax_stats import Stats

CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per temporary


def _row_chunks(logits: torch.Tensor):
    """Yields ``(first flat row, [r, V] view)`` over a [B, T, V] tensor, at most CHUNK_ELEMENTS each."""
    B, T, V = logits.shape
    rows = max(1, CHUNK_ELEMENTS // max(V, 1))
    for b in range(B):
        for t0 in range(0, T, rows):
            yield b * T + t0, logits[b, t0 : t0 + rows]


def _dz(z, lse, entropy, labels, g_logp, g_entropy) -> torch.Tensor:
    """d(loss)/dz for one chunk of scaled logits ``z`` [r, C], computed in z's storage (z is consumed).
    ``labels`` are chunk-local and may fall outside the chunk."""
    log_p = z.sub_(lse[:, None])
    p = log_p.exp()
    if g_entropy is None:
        dz = p.mul_(-g_logp[:, None])
    else:  # d H / dz = -p (log p + H)
        # a logit of -inf has p = 0 and log p = -inf: clamped, so its term is 0 * finite = 0, not NaN
        coef = log_p.clamp_(min=-1e30).add_(entropy[:, None]).mul_(g_entropy[:, None])
        dz = p.mul_(coef if g_logp is None else coef.add_(g_logp[:, None])).neg_()
    if g_logp is not None:  # d logp / dz = onehot(label) - p
        rows = torch.nonzero((labels >= 0) & (labels < z.shape[1])).squeeze(1)
        dz[rows, labels[rows]] += g_logp[rows]
    return dz


def _row_stats(z: torch.Tensor, with_entropy: bool):
    """(m, s, t or None, y) of scaled logits z [r, C] (softmax_stats.py's summary); y = z - m is z's
    storage (z is consumed). torch.logsumexp is several times slower than this on CPU."""
    m = z.amax(dim=-1, keepdim=True)
    y = z.sub_(m)
    e = y.exp()
    s = e.sum(dim=-1)
    t = torch.nansum(e.mul_(y), dim=-1) if with_entropy else None  # 0 * -inf (masked logits) -> 0
    return m.squeeze(-1), s, t, y


def logprobs_forward(logits, labels, inv_t: float, with_entropy: bool):
    n = labels.numel()
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    for n0, chunk in _row_chunks(logits):
        z = chunk.float() * inv_t  # a new tensor (for fp32 input .float() is the input itself)
        sl = slice(n0, n0 + z.shape[0])
        m, s, t, y = _row_stats(z, with_entropy)
        log_s = s.log()
        lse[sl] = m + log_s
        logp[sl] = y.gather(-1, labels[sl, None]).squeeze(-1) - log_s
        if with_entropy:
            entropy[sl] = log_s - t / s
    return logp, entropy, lse


def logprobs_backward(logits, labels, lse, entropy, g_logp, g_entropy, inv_t: float):
    d_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat = d_logits.view(-1, logits.shape[-1])
    for n0, chunk in _row_chunks(logits):
        z = chunk.float() * inv_t
        sl = slice(n0, n0 + z.shape[0])
        dz = _dz(z, lse[sl], None if entropy is None else entropy[sl], labels[sl],
                 None if g_logp is None else g_logp[sl], None if g_entropy is None else g_entropy[sl])
        flat[sl] = dz.mul_(inv_t)
    return d_logits


def _vocab_chunks(n_tokens: int, vocab: int):
    width = max(1, CHUNK_ELEMENTS // max(n_tokens, 1))
    for v0 in range(0, vocab, width):
        yield v0, min(v0 + width, vocab)


def _scaled_logits(h32, weight, bias, v0, v1, inv_t) -> torch.Tensor:
    z = h32 @ weight[v0:v1].float().t()
    if bias is not None:
        z += bias[v0:v1].float()
    return z.mul_(inv_t)


def linear_forward(hidden, weight, bias, labels, inv_t: float, vocab_start: int, with_entropy: bool) -> Stats:
    h32 = hidden.float()
    parts = []
    for v0, v1 in _vocab_chunks(hidden.shape[0], weight.shape[0]):
        m, s, t, y = _row_stats(_scaled_logits(h32, weight, bias, v0, v1, inv_t), with_entropy)
        local = labels - (vocab_start + v0)
        inside = (local >= 0) & (local < v1 - v0)
        zl = y.gather(-1, local.clamp(0, v1 - v0 - 1)[:, None]).squeeze(-1) + m
        parts.append((m, s, t, torch.where(inside, zl, torch.zeros_like(zl))))
    m, s, t, zl = zip(*parts)
    return Stats(torch.stack(m), torch.stack(s), torch.stack(t) if with_entropy else None, torch.stack(zl))


def linear_backward(hidden, weight, bias, labels, lse, entropy, g_logp, g_entropy, inv_t: float,
                    vocab_start: int, needs) -> Tuple[Optional[torch.Tensor], ...]:
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    h32 = hidden.float()
    d_hidden = torch.zeros_like(h32) if need_h else None
    d_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
    d_bias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if need_b else None
    for v0, v1 in _vocab_chunks(hidden.shape[0], weight.shape[0]):
        z = _scaled_logits(h32, weight, bias, v0, v1, inv_t)
        d = _dz(z, lse, entropy, labels - (vocab_start + v0), g_logp, g_entropy).mul_(inv_t)
        if need_w:
            d_weight[v0:v1] = (d.t() @ h32).to(weight.dtype)
        if need_h:
            d_hidden += d @ weight[v0:v1].float()
        if need_b:
            d_bias[v0:v1] = d.sum(0).to(bias.dtype)
    return d_hidden, d_weight, d_bias


LOGPROBS = Impl(logprobs_forward, logprobs_backward)
LINEAR = Impl(linear_forward, linear_backward)
