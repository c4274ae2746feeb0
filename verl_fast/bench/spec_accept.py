"""What speculative decoding would accept from a policy, computed from the policy's own probabilities.

Exact speculative sampling verifies draft tokens one at a time against the policy p: a draft token d drawn
from a draft distribution q is kept with probability min(1, p(d) / q(d)), and at the first rejection a token
is drawn from the residual, normalised max(p - q, 0); the tokens kept plus that one are distributed exactly
as p. Averaged over the draft, the probability that a position's draft is kept is

- ``sum_x min(p(x), q(x))`` for a draft model q (``overlap``);
- ``p(d)`` for a deterministic draft d (q a point mass: prompt lookup / n-gram drafts).

A verify step with k drafts keeps draft j only if drafts 1..j-1 were kept, each judged in the context that
ends with the drafts before it, so with ``a_j`` the probability of keeping draft j in that context the
expected kept drafts are ``sum_{j<=k} prod_{i<=j} a_i`` (``chained``), and the step yields one token more
(the residual's draw, or the policy's next token when all k were kept).

``ngram_draft`` is the prompt-lookup draft: the longest suffix of the tokens so far (``max_n`` down to 1
tokens) that occurred earlier in them, and the tokens that followed its latest earlier occurrence.
"""

from __future__ import annotations

from typing import List, Sequence

import torch


def ngram_draft(tokens: Sequence[int], k: int, max_n: int = 3) -> List[int]:
    """Up to ``k`` tokens proposed after ``tokens`` (prompt + response so far); [] when no suffix of 1..max_n
    tokens occurs earlier. The latest earlier occurrence of the longest matching suffix proposes what
    followed it (fewer than k tokens where the history runs out)."""
    seq = list(tokens)
    end = len(seq)
    for n in range(min(max_n, end - 1), 0, -1):
        suffix = seq[end - n:]
        for start in range(end - n - 1, -1, -1):  # latest earlier occurrence first
            if seq[start:start + n] == suffix:
                return seq[start + n:start + n + k]
    return []


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) over the last dimension: the chance a draft drawn from q is kept under p."""
    return torch.minimum(p, q).sum(-1)


def chained(accept: torch.Tensor) -> torch.Tensor:
    """Expected kept drafts of a verify step with 1..K drafts: ``accept`` [..., K] holds a_1..a_K (a_j: the
    chance draft j is kept given that drafts 1..j-1 were); returns [..., K], entry k-1 the expectation
    with k drafts, sum_{j<=k} prod_{i<=j} a_i."""
    return torch.cumprod(accept, dim=-1).cumsum(dim=-1)


def along_trajectory(accept: torch.Tensor, k: int) -> torch.Tensor:
    """``accept`` [T]: one sampled response's per-position keep probabilities (the draft at each position
    judged in the response's own context). Returns [T, k]: for a verify step starting at each position,
    a_1..a_k read from that position on (0 past the response's end, where nothing is left to accept)."""
    padded = torch.cat([accept, accept.new_zeros(k)])
    return padded.unfold(0, k, 1)[: accept.numel()]
