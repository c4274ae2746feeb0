"""The batch scheduler against references written here: brute-force optima on small inputs, a plain
best-fit decreasing, greedy assignment, and recomputed budgets and reports."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl_fast
from verl_fast import _C
from verl_fast import schedule as S

# ---------------------------------------------------------------- references and checks


def members(plan):
    return [np.asarray(g, dtype=np.int64) for g in plan]


def assert_each_index_once(plan, n):
    groups = members(plan)
    flat = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    assert np.array_equal(np.sort(flat), np.arange(n)), "every index must appear exactly once"
    for g in groups:
        assert np.all(np.diff(g) > 0), "indices inside a group are ascending"


def brute_force_max(costs, k, equal_size):
    """The smallest possible largest-partition cost, over every assignment of items to partitions."""
    costs = np.asarray(costs, dtype=np.int64)
    n = len(costs)
    assign = np.array(list(itertools.product(range(k), repeat=n - 1)), dtype=np.int64).reshape(-1, n - 1)
    assign = np.concatenate([np.zeros((len(assign), 1), dtype=np.int64), assign], axis=1)  # item 0 in part 0
    sums = np.stack([(costs * (assign == p)).sum(1) for p in range(k)], axis=1)
    if equal_size:
        counts = np.stack([(assign == p).sum(1) for p in range(k)], axis=1)
        sums = sums[(counts == n // k).all(1)]
    return int(sums.max(1).min())


def greedy_max(costs, k, equal_size):
    """verl's greedy: each item, in order, to the lightest partition that still has room."""
    cap = len(costs) // k if equal_size else len(costs)
    sums, counts = [0] * k, [0] * k
    for c in costs:
        p = min((p for p in range(k) if counts[p] < cap), key=lambda p: (sums[p], p))
        sums[p] += c
        counts[p] += 1
    return max(sums)


def kk_bound(n, k, equal_size):
    """Worst-case ratio of the differencing method to the optimum (Michiels, Korst, Aarts, van
    Leeuwen 2003): 4/3 - 1/(3k) without size constraints; with n/k items per partition, 1 for 2,
    then 4/3, 19/12, 103/60, 643/360 for 3..6, and 2 - 1/k in general."""
    if not equal_size:
        return 4 / 3 - 1 / (3 * k)
    per = n // k
    return {1: 1.0, 2: 1.0, 3: 4 / 3, 4: 19 / 12, 5: 103 / 60, 6: 643 / 360}.get(per, 2 - 1 / k)


def reference_bfd(lengths, budget):
    """Best-fit decreasing, plainly: longest first, into the fullest bin it fits."""
    rooms = []
    for L in sorted(lengths, reverse=True):
        fits = [r for r in rooms if r >= L]
        if L > budget or not fits:
            rooms.append(budget - L)
        else:
            rooms[rooms.index(min(fits))] -= L
    return len(rooms)


# ---------------------------------------------------------------- balance_partitions


@pytest.mark.parametrize("equal_size", [True, False])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_balance_within_bound_of_brute_force_optimum(k, equal_size):
    rng = np.random.default_rng(k * 10 + equal_size)
    ratios, greedy_ratios = [], []
    for trial in range(40):
        n = k * int(rng.integers(1, 4)) if equal_size else int(rng.integers(k, 9))
        if n > 9 or (k == 4 and n > 8):
            n = k * 2 if equal_size else 8
        lengths = rng.integers(1, 1000, n) if trial % 2 else rng.lognormal(5, 1, n).astype(np.int64) + 1
        plan = S.balance_partitions(lengths, k, equal_size)
        assert_each_index_once(plan, n)
        opt = brute_force_max(lengths, k, equal_size)
        ours = int(plan.costs.max())
        assert ours <= kk_bound(n, k, equal_size) * opt + 1e-9, (lengths, k, ours, opt)
        ratios.append(ours / opt)
        greedy_ratios.append(greedy_max(lengths.tolist(), k, equal_size) / opt)
    # Typical quality: within a few percent of the optimum on average, and no worse than greedy.
    assert np.mean(ratios) <= 1.05, np.mean(ratios)
    assert np.mean(ratios) <= np.mean(greedy_ratios)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300), st.integers(1, 40), st.booleans(),
       st.sampled_from(["tokens", "flops", (3, 2)]))
def test_balance_invariants(lengths, k, equal_size, cost):
    n = len(lengths)
    k = min(k, n)  # k > n is an error (test_balance_more_partitions_than_sequences_is_an_error)
    if equal_size:
        lengths = lengths[: n - n % k]
        n = len(lengths)
    plan = S.balance_partitions(lengths, k, equal_size, cost)
    assert len(plan) == k
    assert_each_index_once(plan, n)
    L = np.asarray(lengths, dtype=np.int64)
    a, b = {"tokens": (1, 0), "flops": (S.FLOPS_A, 1)}.get(cost, cost)
    c = a * L + b * L * L
    sums = np.array([c[g].sum() for g in members(plan)])
    assert np.array_equal(sums, plan.costs)
    assert np.all(np.diff(plan.costs) <= 0), "partitions come largest cost first"
    if equal_size:
        assert all(len(g) == n // k for g in plan)
    else:
        assert all(len(g) >= 1 for g in plan)
    assert plan.report.imbalance == pytest.approx(sums.max() / (sums.sum() / k))
    assert plan.tokens.sum() == L.sum()


def test_balance_large_inputs_balance_well():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 2049, 16384)
    for equal_size in (True, False):
        plan = S.balance_partitions(lengths, 8, equal_size)
        assert plan.costs.max() - plan.costs.min() <= 2048  # within one sequence
        assert plan.report.imbalance < 1.0001
        assert plan.report.imbalance <= greedy_max(lengths.tolist(), 8, equal_size) / (lengths.sum() / 8)


def test_balance_deterministic_and_input_types_agree():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, 999)
    a = S.balance_partitions(lengths, 9, True, "flops")
    b = S.balance_partitions(lengths.tolist(), 9, True, "flops")
    c = S.balance_partitions(torch.from_numpy(lengths).to(torch.int32), 9, True, "flops")
    for x, y, z in zip(a, b, c):
        assert np.array_equal(x, y) and np.array_equal(x, z.numpy())
    assert isinstance(c[0], torch.Tensor) and c[0].dtype == torch.int64
    assert isinstance(a[0], np.ndarray) and a[0].dtype == np.int64


def test_balance_more_partitions_than_sequences_is_an_error():
    with pytest.raises(ValueError, match=r"k must be <= the number of sequences \(2\), got 4"):
        S.balance_partitions([5, 3], 4, equal_size=False)
    plan = S.balance_partitions([5, 3], 2, equal_size=False)
    assert_each_index_once(plan, 2)
    assert [len(g) for g in plan] == [1, 1]


@pytest.mark.slow
def test_one_million_sequences():
    lengths = np.random.default_rng(2).integers(1, 4097, 1_000_000)
    for equal_size in (True, False):
        plan = S.balance_partitions(lengths, 64, equal_size)
        assert_each_index_once(plan, len(lengths))
        assert plan.report.imbalance < 1.000001
    plan = S.pack_micro_batches(lengths, 32768)
    assert_each_index_once(plan, len(lengths))
    assert plan.costs.max() <= 32768
    assert plan.report.budget_utilisation > 0.99
    waves = S.rollout_buckets(lengths, 512, 256, 1 << 20)
    assert_each_index_once(waves, len(lengths))


# ---------------------------------------------------------------- pack_micro_batches


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=200), st.integers(1, 4096), st.integers(1, 5),
       st.sampled_from(["packed", "padded"]))
def test_pack_invariants(lengths, budget, min_num, layout):
    n = len(lengths)
    min_num = min(min_num, n)
    plan = S.pack_micro_batches(lengths, budget, min_num, layout=layout)
    assert_each_index_once(plan, n)
    L = np.asarray(lengths)
    over = set(np.flatnonzero(L > budget).tolist())
    assert set(plan.oversize.tolist()) == over
    for g, cost in zip(members(plan), plan.costs):
        use = len(g) * L[g].max() if layout == "padded" else L[g].sum()
        assert use == cost
        if set(g.tolist()) & over:
            assert len(g) == 1, "an oversize sequence is alone"
        else:
            assert use <= budget
    assert len(plan) >= min_num
    assert np.all(np.diff(plan.costs) <= 0), "largest micro-batch first"
    if layout == "packed" and min_num == 1:
        fitting = L[L <= budget]
        lower = len(over) + -(-int(fitting.sum()) // budget)
        assert lower <= len(plan) <= len(over) + reference_bfd(fitting.tolist(), budget)


def fewest_bins(lengths, budget):
    """The optimum bin count, by trying every assignment (item 0 fixed in bin 0)."""
    n = len(lengths)
    rows = list(itertools.product(range(n), repeat=n - 1))
    assign = np.array(rows, dtype=np.int64).reshape(len(rows), n - 1)
    assign = np.concatenate([np.zeros((len(assign), 1), dtype=np.int64), assign], axis=1)
    loads = np.stack([(lengths * (assign == b)).sum(1) for b in range(n)], axis=1)
    ok = (loads <= budget).all(1)
    return int((loads[ok] > 0).sum(1).min())


def test_pack_count_is_optimal_on_small_inputs():
    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(1, 8))
        lengths = rng.integers(1, 100, n)
        budget = int(rng.integers(100, 200))
        plan = S.pack_micro_batches(lengths, budget)
        best = fewest_bins(lengths, budget)
        # best-fit decreasing guarantees <= 11/9 OPT + 6/9; on inputs this small it finds the optimum
        # or one more, which the Karmarkar-Karp attempt at the lower bound often removes
        assert best <= len(plan) <= best + 1
        assert len(plan) <= 11 / 9 * best + 6 / 9 + 1e-9


def test_pack_mixed_workload_utilisation():
    rng = np.random.default_rng(4)
    lengths = np.clip(np.where(rng.random(2048) < 0.5, rng.lognormal(np.log(180), 0.45, 2048),
                               rng.lognormal(np.log(420), 0.9, 2048)), 10, 2048).astype(np.int64)
    plan = S.pack_micro_batches(lengths, 16384)
    assert plan.report.budget_utilisation >= 0.95
    assert plan.report.budget_utilisation == pytest.approx(lengths.sum() / (len(plan) * 16384))
    # the balanced plan: every micro-batch close to the mean
    assert plan.report.imbalance < 1.05


def test_pack_beats_best_fit_decreasing_and_falls_back_when_balancing_does_not_fit():
    lengths = [20, 12, 3, 2, 9, 2, 4]  # best-fit decreasing needs 3; 2 = ceil(52 / 26) suffice
    assert reference_bfd(lengths, 26) == 3
    plan = S.pack_micro_batches(lengths, 26)
    assert len(plan) == 2 and plan.costs.tolist() == [26, 26]
    # Karmarkar-Karp's balanced 6 micro-batches exceed the budget: best-fit decreasing's 6 stay.
    lengths = [10, 9, 3, 7, 7, 4, 15, 4, 16, 6, 10, 5]
    plan = S.pack_micro_batches(lengths, 17)
    assert len(plan) == 6 and plan.costs.max() <= 17
    # At min_num=9 the balanced split exceeds the budget again: the packed bins are split instead.
    lengths = [4, 4, 4, 7, 4, 5, 7, 4, 6, 4, 5, 5, 6, 4, 7, 4, 7, 4, 5]
    plan = S.pack_micro_batches(lengths, 12, min_num=9)
    assert_each_index_once(plan, len(lengths))
    assert len(plan) == 9 and plan.costs.max() <= 12


def test_pack_oversize_is_reported_not_dropped():
    plan = S.pack_micro_batches([10, 500, 20, 30, 700], 100)
    assert sorted(plan.oversize.tolist()) == [1, 4]
    assert [list(g) for g in plan][:2] == [[4], [1]]
    assert_each_index_once(plan, 5)
    assert plan.report.num_oversize == 2


def test_pack_min_num_and_agreed_count():
    lengths = [100] * 10
    assert len(S.pack_micro_batches(lengths, 1000)) == 1
    plan = S.pack_micro_batches(lengths, 1000, min_num=4)
    assert len(plan) == 4 and sorted(len(g) for g in plan) == [2, 2, 3, 3]
    assert len(S.pack_micro_batches(lengths, 1000, same_count_across=6)) == 6
    assert len(S.pack_micro_batches(lengths, 1000, layout="padded", same_count_across=10)) == 10
    with pytest.raises(ValueError, match="same_count_across=1 is fewer than the 2"):
        S.pack_micro_batches(lengths, 500, same_count_across=1)
    with pytest.raises(ValueError, match="cannot make 11 micro-batches from 10 sequences"):
        S.pack_micro_batches(lengths, 1000, min_num=11)


def test_pack_padded_layout_budget():
    lengths = [1000, 990, 10, 10, 10, 10, 10, 10]
    plan = S.pack_micro_batches(lengths, 2000, layout="padded")
    assert [sorted(g.tolist()) for g in plan] == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert plan.report.padded_utilisation == pytest.approx(2050 / (2000 + 60))


# ---------------------------------------------------------------- rollout_buckets


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 800), st.integers(1, 600)), min_size=1, max_size=200),
       st.integers(1, 32), st.integers(1, 20000), st.sampled_from([None, 1024]))
def test_rollout_invariants(requests, max_num_seqs, budget, max_model_len):
    p = np.array([r[0] for r in requests])
    m = np.array([r[1] for r in requests])
    plan = S.rollout_buckets(p, m, max_num_seqs, budget, max_model_len=max_model_len)
    assert_each_index_once(plan, len(p))
    m_eff = np.minimum(m, max_model_len - p) if max_model_len else m
    prev_longest = 0
    for w, g in enumerate(members(plan)):
        assert len(g) <= max_num_seqs
        assert plan.max_tokens[w] == m_eff[g].max()
        worst = p[g].sum() + len(g) * plan.max_tokens[w]
        assert worst == plan.costs[w]
        assert worst <= budget or len(g) == 1
        assert p[g].min() >= prev_longest, "waves go shortest prompts first"
        assert p[g].max() <= 2 * p[g].min(), "a wave holds prompts of similar length"
        prev_longest = p[g].max()
    assert set(plan.oversize.tolist()) == set(np.flatnonzero(p + m_eff > budget).tolist())


def test_rollout_short_requests_not_behind_long_ones():
    prompts = [20] * 6 + [900] * 2
    plan = S.rollout_buckets(prompts, 200, max_num_seqs=4, max_batch_tokens=4096, max_model_len=1024)
    assert [list(g) for g in plan] == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert plan.max_tokens.tolist() == [200, 200, 124]
    mixed = S.rollout_buckets(prompts, 200, 4, 4096, max_model_len=1024, max_length_ratio=float("inf"))
    assert [list(g) for g in mixed] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mixed.report.padded_utilisation < plan.report.padded_utilisation
    assert S.rollout_buckets([5], [7], 1, 1).oversize.tolist() == [0]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("fn", [
    lambda x: S.balance_partitions(x, 2),
    lambda x: S.pack_micro_batches(x, 100),
    lambda x: S.rollout_buckets(x, 10, 4, 1000),
])
def test_non_integer_lengths_are_type_errors(fn):
    for bad in ([1, 2.5], [1, None], np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([True, False]),
                [True, False], np.array([True]), "12", 12):
        with pytest.raises(TypeError, match="must hold integers|must be a 1-D sequence"):
            fn(bad)


@pytest.mark.parametrize("lengths, match", [
    ([3, 0, 2], r"lengths must be >= 1 everywhere, got 0 at index 1"),
    ([3, -4], r"lengths must be >= 1 everywhere, got -4 at index 1"),
    ([], "lengths must hold at least one sequence"),
    (np.ones((2, 2), dtype=np.int64), "lengths must be 1-D"),
])
def test_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        S.balance_partitions(lengths, 1)
    with pytest.raises(ValueError, match=match):
        S.pack_micro_batches(lengths, 10)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        S.balance_partitions([1, 2], 0)
    with pytest.raises(TypeError, match="k must be an int"):
        S.balance_partitions([1, 2], 2.0)
    with pytest.raises(ValueError, match=r"k must be <= the number of sequences \(2\), got 3"):
        S.balance_partitions([1, 2], 3)
    with pytest.raises(ValueError, match="equal_size=True needs k to divide the number of sequences: 5 % 2 = 1"):
        S.balance_partitions([1] * 5, 2)
    with pytest.raises(ValueError, match="cost must be 'tokens', 'flops'"):
        S.balance_partitions([1, 2], 1, cost="time")
    with pytest.raises(ValueError, match="must not both be 0"):
        S.balance_partitions([1, 2], 1, cost=(0, 0))
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        S.pack_micro_batches([1, 2], 0)
    with pytest.raises(ValueError, match="min_num must be >= 1"):
        S.pack_micro_batches([1, 2], 4, min_num=0)
    with pytest.raises(ValueError, match="layout must be 'packed' or 'padded'"):
        S.pack_micro_batches([1, 2], 4, layout="ragged")
    with pytest.raises(TypeError, match="same_count_across must be None, an int"):
        S.pack_micro_batches([1, 2], 4, same_count_across="world")
    with pytest.raises(ValueError, match="max_new_tokens must be an int or one per prompt"):
        S.rollout_buckets([1, 2], [3], 4, 100)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        S.rollout_buckets([1, 2], 3, 0, 100)
    with pytest.raises(ValueError, match="max_batch_tokens must be >= 1"):
        S.rollout_buckets([1, 2], 3, 1, 0)
    with pytest.raises(ValueError, match="max_length_ratio must be a number >= 1"):
        S.rollout_buckets([1, 2], 3, 1, 100, max_length_ratio=0.5)
    with pytest.raises(ValueError, match=r"prompt_lens\[1\] = 9 leaves no room"):
        S.rollout_buckets([1, 9], 3, 1, 100, max_model_len=9)


def test_costs_beyond_int64_are_refused():
    with pytest.raises(ValueError, match="beyond int64"):
        S.balance_partitions([3_000_000_000] * 2, 2, cost="flops")
    with pytest.raises(ValueError, match="lengths holds values beyond int64"):
        S.balance_partitions([2**70, 1], 2)


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_direct_C_calls_with_bad_sizes_raise():
    L = i64(5, 3, 8, 1)
    order, offsets, costs = torch.empty(4, dtype=torch.int64), torch.empty(3, dtype=torch.int64), \
        torch.empty(2, dtype=torch.int64)
    _C.balance_partitions(L, 2, True, 1, 0, order, offsets, costs)  # well-formed
    with pytest.raises(ValueError, match="order must be a 1-D tensor of at least 4 elements"):
        _C.balance_partitions(L, 2, True, 1, 0, torch.empty(3, dtype=torch.int64), offsets, costs)
    with pytest.raises(ValueError, match="offsets must be a 1-D tensor of at least 3"):
        _C.balance_partitions(L, 2, True, 1, 0, order, torch.empty(2, dtype=torch.int64), costs)
    with pytest.raises(ValueError, match="costs must be a 1-D tensor of at least 2"):
        _C.balance_partitions(L, 2, True, 1, 0, order, offsets, torch.empty(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="lengths must be int64, got int32"):
        _C.balance_partitions(L.int(), 2, True, 1, 0, order, offsets, costs)
    with pytest.raises(ValueError, match="lengths must be contiguous"):
        _C.balance_partitions(i64(5, 0, 3, 0, 8, 0, 1, 0)[::2], 2, True, 1, 0, order, offsets, costs)
    with pytest.raises(ValueError, match="lengths must be >= 1 everywhere, got 0 at index 2"):
        _C.balance_partitions(i64(5, 3, 0, 1), 2, True, 1, 0, order, offsets, costs)
    with pytest.raises(ValueError, match="k must be >= 1"):
        _C.balance_partitions(L, -1, False, 1, 0, order, offsets, costs)
    with pytest.raises(ValueError, match="k must be <= the number of sequences"):
        _C.balance_partitions(L, 5, True, 1, 0, order, torch.empty(6, dtype=torch.int64),
                              torch.empty(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="cost coefficients must be >= 0"):
        _C.balance_partitions(L, 2, True, -1, 0, order, offsets, costs)
    with pytest.raises(ValueError, match="lengths must be a 1-D tensor"):
        _C.balance_partitions(L.view(2, 2), 2, True, 1, 0, order, offsets, costs)
    offsets5 = torch.empty(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="offsets must be a 1-D tensor of at least 5"):
        _C.pack_micro_batches(L, 10, 1, False, order, offsets)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        _C.pack_micro_batches(L, 0, 1, False, order, offsets5)
    with pytest.raises(ValueError, match="cannot make 5 micro-batches from 4"):
        _C.pack_micro_batches(L, 10, 5, False, order, offsets5)
    with pytest.raises(ValueError, match="max_new_tokens must have one entry per prompt"):
        _C.rollout_buckets(L, i64(1, 2), 2, 100, 0, 2.0, order, offsets5, torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="wave_max_tokens must be a 1-D tensor of at least 4"):
        _C.rollout_buckets(L, L, 2, 100, 0, 2.0, order, offsets5, torch.empty(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        _C.pack_micro_batches([5, 3], 10, 1, False, order, offsets5)


def test_public_names():
    from verl_fast.ops import schedule

    assert verl_fast.schedule is schedule
    assert callable(verl_fast.schedule.balance_partitions)
    assert set(["balance_partitions", "pack_micro_batches", "rollout_buckets"]) <= set(schedule.__all__)
    metrics = S.pack_micro_batches([3, 4], 10).report.as_dict("mb/")
    assert metrics["mb/budget_utilisation"] == pytest.approx(0.7)
