"""The speculative-decoding acceptance arithmetic (verl_fast/bench/spec_accept.py) against a brute-force float64
Monte Carlo of exact speculative sampling on toy distributions: draft-model drafts (keep min(1, p/q), residual
draw at the first rejection) and deterministic drafts on a Markov chain whose next-token law depends on the
context the drafts build; the simulator itself samples p exactly; and the prompt-lookup draft's cases."""

import pytest
import torch

from verl_fast.bench import spec_accept

SAMPLES = 400_000


def simulate_draft_model(p, q, gen):
    """Exact speculative sampling with per-position laws p[j], q[j] ([K, V], context-free), ``SAMPLES`` runs:
    the kept drafts of each run and the token it emits at position 1 (the kept draft, or the residual draw)."""
    K, V = p.shape
    n = SAMPLES
    alive = torch.ones(n, dtype=torch.bool)
    kept = torch.zeros(n, dtype=torch.float64)
    first = torch.empty(n, dtype=torch.long)
    for j in range(K):
        d = torch.multinomial(q[j], n, replacement=True, generator=gen)
        keep = torch.rand(n, generator=gen, dtype=torch.float64) < torch.clamp(p[j, d] / q[j, d], max=1.0)
        if j == 0:
            residual = torch.clamp(p[0] - q[0], min=0.0)
            redraw = torch.multinomial(residual / residual.sum(), n, replacement=True, generator=gen)
            first = torch.where(keep, d, redraw)
        alive &= keep
        kept += alive.double()
    return kept, first


def simulate_markov(P, start, drafts, gen):
    """Exact speculative sampling of point-mass drafts ``drafts`` after the token ``start`` on the Markov chain
    with transition matrix P (the next token's law is the row of the last token): kept drafts of each run."""
    n = SAMPLES
    alive = torch.ones(n, dtype=torch.bool)
    kept = torch.zeros(n, dtype=torch.float64)
    last = start
    for d in drafts:
        # q is a point mass on d: keep with min(1, p(d) / 1); the residual (p without d) is never needed here
        alive &= torch.rand(n, generator=gen, dtype=torch.float64) < P[last, d]
        kept += alive.double()
        last = d  # a kept draft is the context of the next one
    return kept


def close(mc, exact):
    tol = 5 * mc.std().item() / SAMPLES ** 0.5 + 1e-12
    return abs(mc.mean().item() - exact) <= tol, tol


@pytest.mark.parametrize("V,K,concentration", [(6, 4, 1.0), (17, 3, 0.3), (2, 4, 5.0)])
def test_draft_model_expectation_matches_monte_carlo(V, K, concentration):
    gen = torch.Generator().manual_seed(V * 100 + K)
    dirichlet = torch.distributions.Dirichlet(torch.full((V,), concentration, dtype=torch.float64))
    torch.manual_seed(V + K)
    p, q = dirichlet.sample((K,)), dirichlet.sample((K,))
    kept, first = simulate_draft_model(p, q, gen)
    expected = spec_accept.chained(spec_accept.overlap(p, q))
    for k in range(1, K + 1):
        ok, tol = close(torch.clamp(kept, max=k), expected[k - 1].item())
        mc = torch.clamp(kept, max=k).mean()
        assert ok, f"k={k}: Monte Carlo {mc:.5f} vs formula {expected[k - 1]:.5f} (tol {tol:.1e})"
    # the simulator is exact speculative sampling: position 1's emitted token follows p[0]
    freq = torch.bincount(first, minlength=V).double() / SAMPLES
    assert torch.allclose(freq, p[0], atol=5 * (p[0] * (1 - p[0]) / SAMPLES).sqrt().max().item() + 1e-12)
    # the formula the test pins down: neither the unchained sum nor the per-position expectation sum p*q passes
    wrong = [spec_accept.overlap(p, q).cumsum(-1), torch.cumprod((p * q).sum(-1), -1).cumsum(-1)]
    for alt in wrong:
        assert not all(close(torch.clamp(kept, max=k), alt[k - 1].item())[0] for k in range(1, K + 1))


@pytest.mark.parametrize("V,seed", [(5, 0), (9, 1), (3, 2)])
def test_deterministic_drafts_chain_along_the_draft_context(V, seed):
    torch.manual_seed(seed)
    P = torch.distributions.Dirichlet(torch.full((V,), 0.5, dtype=torch.float64)).sample((V,))
    gen = torch.Generator().manual_seed(seed)
    start = 0
    drafts = torch.randint(0, V, (4,)).tolist()
    drafts[0] = int(P[start].argmax())  # a likely first draft, so later terms weigh
    kept = simulate_markov(P, start, drafts, gen)
    contexts = [start] + drafts[:-1]
    accept = torch.stack([P[c, d] for c, d in zip(contexts, drafts)])
    expected = spec_accept.chained(accept)
    for k in range(1, 5):
        ok, tol = close(torch.clamp(kept, max=k), expected[k - 1].item())
        assert ok, f"k={k}: Monte Carlo {torch.clamp(kept, max=k).mean():.5f} vs formula {expected[k - 1]:.5f}"


def test_chained_is_the_running_sum_of_running_products():
    a = torch.rand(7, 4, dtype=torch.float64)
    ref = torch.zeros_like(a)
    for r in range(7):
        total, prod = 0.0, 1.0
        for j in range(4):
            prod *= a[r, j].item()
            total += prod
            ref[r, j] = total
    assert torch.allclose(spec_accept.chained(a), ref, rtol=0, atol=1e-15)


@pytest.mark.parametrize("T,k", [(1, 1), (5, 3), (9, 4)])
def test_along_trajectory_reads_each_steps_window(T, k):
    a = torch.rand(T, dtype=torch.float64)
    got = spec_accept.along_trajectory(a, k)
    assert got.shape == (T, k)
    for t in range(T):
        for j in range(k):
            assert got[t, j].item() == (a[t + j].item() if t + j < T else 0.0)


@pytest.mark.parametrize("tokens,k,max_n,want", [
    ([1, 2, 3, 9, 1, 2, 3], 3, 3, [9, 1, 2]),          # the suffix [1, 2, 3] occurred at the start
    ([5, 1, 7, 1, 8, 1], 2, 3, [8, 1]),               # only [1] matches: its latest earlier occurrence (before 8)
    ([4, 2, 6, 2, 3, 4, 2], 2, 3, [6, 2]),             # [4, 2] beats the later single-token match of [2] (before 3)
    ([1, 2, 3, 4], 2, 3, []),                          # nothing repeats
    ([7, 8, 7], 4, 3, [8, 7]),                         # the history runs out before k
    ([3, 3], 2, 1, [3]),
    ([6], 2, 3, []),
    ([1, 2, 3, 1, 2, 3, 1, 2, 3], 2, 2, [1, 2]),       # max_n caps the suffix (latest [2, 3] proposes 1, 2)
])
def test_ngram_draft(tokens, k, max_n, want):
    assert spec_accept.ngram_draft(tokens, k, max_n) == want
