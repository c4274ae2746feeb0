"""The decode's prefill in width buckets (rollout/hf_decode.py ``width_buckets``, ``_Decoder._prefill_buckets``;
rollout/static_kv.py ``StaticKV.writes``): prompts of very different widths (a partial rollout's carried
samples beside fresh prompts) run over their own columns, bucket by bucket, and decode what the one padded
forward gives them.

- The plan: every prompt in one bucket that holds its columns, and the least cost over every split of the
  widths into contiguous runs (brute force), for random widths, steps and bucket costs.
- The decode: in float64, the cache's attended columns, the first token's logits, greedy and sampled tokens
  and their log-probs equal the unbucketed call's, with and without ``rows`` (a prompt's samples sharing
  its prefill), with compaction; each bucket's forward sees only its prompts and columns."""

import itertools
import random

import pytest
import torch

from tiny_models import build_model
from verl_fast.rollout import hf_decode

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")


def brute_force(needs, step, overhead):
    """The least cost over every split of the distinct rounded widths (widest first) into contiguous runs."""
    top = max(needs)
    rounded = [min(-(-max(n, 1) // step) * step, top) for n in needs]
    widths = sorted(set(rounded), reverse=True)
    best = float("inf")
    for k in range(len(widths)):
        for cuts in itertools.combinations(range(1, len(widths)), k):
            bounds = (0,) + cuts + (len(widths),)
            cost = sum(sum(rounded.count(w) for w in widths[i:j]) * widths[i] + (overhead if i else 0)
                       for i, j in zip(bounds, bounds[1:]))
            best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_buckets_hold_every_prompt_at_the_least_cost(seed):
    rng = random.Random(seed)
    needs = [rng.choice([rng.randint(1, 40), rng.randint(1, 700)]) for _ in range(rng.randint(1, 12))]
    step, overhead = rng.choice([1, 16, 64]), rng.choice([0, 50, 500, 5000])
    buckets = hf_decode.width_buckets(needs, step, overhead)
    placed = sorted(p for _, members in buckets for p in members)
    assert placed == list(range(len(needs)))
    assert [w for w, _ in buckets] == sorted({w for w, _ in buckets}, reverse=True)
    for width, members in buckets:
        assert all(needs[p] <= width for p in members) and width <= max(needs)
    cost = sum(len(m) * w for w, m in buckets) + overhead * (len(buckets) - 1)
    assert cost == brute_force(needs, step, overhead)


def test_bucket_edges():
    assert hf_decode.width_buckets([], 64, 0) == []
    assert hf_decode.width_buckets([5, 300, 7], 64, 10 ** 9) == [(300, [0, 1, 2])]  # a bucket costs too much
    assert hf_decode.width_buckets([5, 300, 7, 0], 64, 0) == [(300, [1]), (64, [0, 2, 3])]
    assert hf_decode.width_buckets([130, 129], 64, 0) == [(130, [0, 1])]  # rounded up, capped at the widest


@pytest.fixture(scope="module")
def model():
    m = build_model("qwen2", vocab_size=96, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2)
    return m.double()


def batch(widths, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = max(widths)
    ids = torch.zeros(len(widths), W, dtype=torch.long)
    mask = torch.zeros(len(widths), W, dtype=torch.long)
    for i, w in enumerate(widths):
        ids[i, W - w:] = torch.randint(2, vocab, (w,), generator=g)
        mask[i, W - w:] = 1
    return ids, mask


def run(model, ids, mask, rows, temperature, min_rows, monkeypatch, bucket_tokens):
    monkeypatch.setattr(hf_decode, "PREFILL_BUCKET_STEP", 4)
    monkeypatch.setattr(hf_decode, "PREFILL_BUCKET_TOKENS", bucket_tokens)
    kept, shapes = [], []
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, args, out: shapes.append(tuple(args[0].shape)))
    torch.manual_seed(3)
    try:
        out = hf_decode.decode(model, ids, mask, 10, temperature, 0, 1.0, [-1], 0, use_graph=False, rows=rows,
                               min_rows=min_rows, keep=kept if min_rows is None else None)
    finally:
        hook.remove()
    return out, kept, shapes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows", [None, [0, 0, 3, 1, 4, 4, 2, 3]])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bucketed_prefill_decodes_as_the_padded_one(model, rows, temperature, device, monkeypatch):
    widths = [3, 37, 5, 21, 36]
    ids, mask = (t.to(device) for t in batch(widths))
    rows = None if rows is None else torch.tensor(rows, device=device)
    model.to(device)
    plain, plain_kept, plain_shapes = run(model, ids, mask, rows, temperature, None, monkeypatch, 10 ** 9)
    split, split_kept, split_shapes = run(model, ids, mask, rows, temperature, None, monkeypatch, 10)
    assert plain_shapes[0] == (5, 37) and len(split_shapes) == len(plain_shapes) + 2
    # widths rounded up to 4 (the widest capped at 37); a bucket costs 10 columns: the two widest prompts run
    # 37 columns, the 21-token one 24, the 3- and 5-token ones 8; then the decode steps
    assert split_shapes[:3] == [(2, 37), (1, 24), (2, 8)] and split_shapes[3:] == plain_shapes[1:]
    assert torch.equal(plain[0], split[0])
    torch.testing.assert_close(split[1], plain[1], atol=1e-10, rtol=0)
    a, b = plain_kept[0].cache, split_kept[0].cache
    valid = plain_kept[0].valid  # the columns each row attends to: the same keys and values there
    for layer in range(len(a.keys)):
        for x, y in ((a.keys[layer], b.keys[layer]), (a.values[layer], b.values[layer])):
            assert x.shape == y.shape
            sel = valid[:, None, :, None].expand_as(x)
            torch.testing.assert_close(y[sel], x[sel], atol=1e-10, rtol=0)


def test_a_bucketed_prefill_with_compaction(model, monkeypatch):
    model.to("cpu")
    ids, mask = batch([2, 30, 4, 29, 3, 5, 31, 2, 6], seed=1)
    stop = [int(ids[0, -1])]  # a common token: rows stop early, the batch compacts
    outs = []
    for bucket_tokens in (10 ** 9, 10):
        monkeypatch.setattr(hf_decode, "PREFILL_BUCKET_STEP", 4)
        monkeypatch.setattr(hf_decode, "PREFILL_BUCKET_TOKENS", bucket_tokens)
        torch.manual_seed(4)
        log = []
        outs.append(hf_decode.decode(model, ids, mask, 24, 1.0, 0, 1.0, stop, 0, use_graph=False, min_rows=2,
                                     check_every=2, log=log))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-10, rtol=0)
