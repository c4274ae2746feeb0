"""One decode step's sampling tail in one Triton kernel: for each row of the float32 logits, the
next token drawn from softmax(logits / temperature) (temperature 0: the argmax), the log-prob of
that token under the same scores, pad and log-prob 0 for a row already finished, both written at the
step's output column, the row marked done when it drew a stop token, and its next input token and
position advanced.

The torch form (``hf_decode.sample`` + ``record``) makes several passes over the [rows, vocab]
float32 logits (the scores, the log-softmax's max and sum, the Exp(1) noise, the race's argmax) and a
handful of launches for the bookkeeping after it. Here one program reads its row once: a running
max and sum of exp for the log-softmax (online, per lane), and the draw as the race
argmax_i (s_i + G_i), G_i = -log(-log U_i) a Gumbel variate (the same exponential race as
``hf_decode.sample``: argmax of s - log E with E = -log U ~ Exp(1)), which picks token i with
probability softmax(s)_i exactly. The uniforms come from Triton's Philox keyed by ``seed`` + the
step's output column (a fresh key per step), the counter the row and the element's position (one
Philox call gives the uniforms of four elements a quarter block apart), so no generator state is read
on the host and a captured graph's replays draw fresh numbers every step.

Temperature / greedy only: top-k and top-p need an order over the row, which the torch form keeps
(``supports`` says which settings this kernel takes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # logits a loop step of one row reads (fewer for a narrower row)
NUM_WARPS = 8
# Running maxima start finite, so the first rescale is exp(-1e30 - m) = 0, never exp(-inf + inf) = NaN.
NEG_BIG = tl.constexpr(-1.0e30)
TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: a uniform of 0 kept above it


@triton.jit
def _take(row, i, V, temp, u, m, total, best, best_i, GREEDY: tl.constexpr):
    """One block of a row folded into the lanes' running log-softmax statistics and race."""
    ok = i < V
    x = tl.load(row + i, mask=ok, other=float("-inf"))
    if not GREEDY:
        x = x / temp  # a division, as ``logits / temperature`` rounds
    m_new = tl.maximum(m, x)
    total = total * tl.exp(m - m_new) + tl.exp(x - m_new)
    if GREEDY:
        race = x
    else:
        race = x - tl.log(-tl.log(tl.maximum(u, TINY)))  # s + Gumbel: s - log E, E = -log U
    better = ok & (race > best)  # strict: a lane keeps its first index of a tie
    return m_new, total, tl.where(better, race, best), tl.where(better, i, best_i)


@triton.jit
def _sample_kernel(logits_ptr, seed_ptr, t_ptr, done_ptr, pad_ptr, stop_ptr, tokens_ptr, logprobs_ptr, current_ptr,
                   position_ptr, V, S, temperature, s_logits, s_tokens, s_logprobs, s_current, s_position,
                   GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    temp = tl.full((), temperature, tl.float32)  # Inductor passes a Python float as an fp64 scalar
    t = tl.load(t_ptr)
    key = tl.load(seed_ptr) + t  # one Philox key per step
    row = logits_ptr + b * s_logits
    Q: tl.constexpr = BLOCK // 4  # one Philox call gives four uniforms: a block is four quarters
    lane = tl.arange(0, Q)
    m = tl.full((Q,), NEG_BIG, tl.float32)  # per lane: running max and sum of exp(s - max)
    total = tl.zeros((Q,), tl.float32)
    best = tl.full((Q,), float("-inf"), tl.float32)  # per lane: the race's best value and its index
    best_i = tl.full((Q,), V, tl.int64)
    for start in range(0, V, BLOCK):
        if GREEDY:
            u0 = tl.zeros((Q,), tl.float32)  # unused
            u1 = u0
            u2 = u0
            u3 = u0
        else:  # counters: the row in the high word, the block's quarter position in the low one
            u0, u1, u2, u3 = tl.rand4x(key, (b << 32) + start // 4 + lane)
        i = start + lane
        m, total, best, best_i = _take(row, i, V, temp, u0, m, total, best, best_i, GREEDY)
        m, total, best, best_i = _take(row, i + Q, V, temp, u1, m, total, best, best_i, GREEDY)
        m, total, best, best_i = _take(row, i + 2 * Q, V, temp, u2, m, total, best, best_i, GREEDY)
        m, total, best, best_i = _take(row, i + 3 * Q, V, temp, u3, m, total, best, best_i, GREEDY)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, best_i, V), 0)  # the first index of the maximum, as argmax gives
    token = tl.where(token < V, token, 0)  # every score NaN / -inf: token 0, as argmax of such a row
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(total * tl.exp(m - row_max), 0))
    chosen = tl.load(row + token)
    if not GREEDY:
        chosen = chosen / temp
    logp = chosen - lse
    done = tl.load(done_ptr + b) != 0
    token = tl.where(done, tl.load(pad_ptr), token)
    logp = tl.where(done, 0.0, logp)
    hit = done
    for j in range(0, S):
        hit = hit | (token == tl.load(stop_ptr + j))
    tl.store(tokens_ptr + b * s_tokens + t, token)
    tl.store(logprobs_ptr + b * s_logprobs + t, logp)
    tl.store(done_ptr + b, hit)
    tl.store(current_ptr + b * s_current, token)
    tl.store(position_ptr + b * s_position, tl.load(position_ptr + b * s_position) + 1)


def supports(top_k: int, top_p: float) -> bool:
    """Whether ``sample_step`` computes this sampling (no top-k / top-p filter asked for)."""
    return top_k <= 0 and top_p >= 1.0


def sample_step(logits: torch.Tensor, temperature: float, seed: torch.Tensor, t: torch.Tensor, done: torch.Tensor,
                pad: torch.Tensor, stop: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
                current: torch.Tensor, position: torch.Tensor) -> None:
    """One decode step's draw and bookkeeping, in place, for ``B`` rows.

    ``logits``: [B, V] float32; ``temperature``: >= 0 (0: greedy); ``seed``: [1] int64, the call's
    random key (each step adds ``t``); ``t``: [1] int64, the output column written; ``done``: [B] bool
    (read, then or-ed with a stop hit); ``pad``: 0-d int64; ``stop``: [S] int64; ``tokens`` /
    ``logprobs``: [B, T] int64 / float32 outputs; ``current``: [B, 1] int64, set to the token;
    ``position``: [B, 1] int64, advanced by one. Raises ValueError naming the argument that does not fit."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"sample_step: logits must be a [B, V] float32 tensor contiguous in V, got "
                         f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    B, V = logits.shape
    if temperature < 0:
        raise ValueError(f"sample_step: temperature must be >= 0, got {temperature}")
    checks = {"seed": (seed, (1,), torch.int64), "t": (t, (1,), torch.int64), "done": (done, (B,), torch.bool),
              "pad": (pad, (), torch.int64), "stop": (stop, tuple(stop.shape[:1]), torch.int64),
              "tokens": (tokens, (B, tokens.shape[-1]), torch.int64),
              "logprobs": (logprobs, (B, tokens.shape[-1]), torch.float32),
              "current": (current, (B, 1), torch.int64), "position": (position, (B, 1), torch.int64)}
    for name, (tensor, shape, dtype) in checks.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != logits.device:
            raise ValueError(f"sample_step: {name} must be a {list(shape)} {dtype} "
                             f"tensor on {logits.device}, got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")
    for name in ("done", "tokens", "logprobs"):
        if checks[name][0].stride(-1) != 1:
            raise ValueError(f"sample_step: {name} must be contiguous in its last dimension")
    if B == 0:
        return
    _sample_kernel[(B,)](logits, seed, t, done, pad, stop, tokens, logprobs, current, position, V, stop.shape[0],
                         float(temperature) or 1.0, logits.stride(0), tokens.stride(0), logprobs.stride(0),
                         current.stride(0), position.stride(0), GREEDY=temperature == 0, BLOCK=max(4, min(BLOCK, triton.next_power_of_2(V))),
                         num_warps=NUM_WARPS)
