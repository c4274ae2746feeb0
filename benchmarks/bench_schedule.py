"""The batch scheduler against the way peers plan batches (CPU only: plans are host computations).

    python benchmarks/bench_schedule.py [--quick] [--python-limit-s 30]
    pytest benchmarks/bench_schedule.py          (pytest-benchmark timings at a small size)

Baselines, written here the way verl writes them:
- Python Karmarkar–Karp: a heap of partition states, each k sets of (index, length) pairs, merged
  by popping the two states of largest spread, appending members one by one and re-sorting the
  sets through __lt__; partitions checked and sorted at the end (verl's seqlen_balancing).
- Greedy assignment: each sequence, in batch order, to the partition with the smallest sum
  (among those not yet full with equal_size), as verl's greedy_partition.
- Micro-batches: fixed-count (a fixed number of sequences per micro-batch, sized so the longest
  possible sequence fits the token budget), and verl's dynamic batch size (Karmarkar–Karp on the
  FLOP proxy into ceil(total / budget) micro-batches, which may exceed the budget).
- Rollout: fixed chunks of max_num_seqs requests in arrival order, every request at the global
  max_new_tokens.

Lengths follow a mixed workload like GSM8K + Alpaca responses: a 50/50 mix of log-normals
(medians 180 and 420 tokens), clipped to 10..2048.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, time_ms  # noqa: E402

from verl_fast import schedule  # noqa: E402

SIZES = [1024, 16384, 131072]
KS = [8, 64]
MAX_LEN = 2048


def mixed_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Response lengths like GSM8K (short, tight) mixed 50/50 with Alpaca (longer, wide)."""
    rng = np.random.default_rng(seed)
    short = rng.lognormal(np.log(180), 0.45, n)
    long = rng.lognormal(np.log(420), 0.9, n)
    x = np.where(rng.random(n) < 0.5, short, long)
    return np.clip(np.round(x), 10, MAX_LEN).astype(np.int64)


# ---------------------------------------------------------------- baselines


def python_kk(lengths: List[int], k: int, equal_size: bool) -> List[List[int]]:
    """Karmarkar–Karp as verl writes it: a heap of states of k sets of (index, length) pairs; sets
    compare by (sum, size, members) through __lt__, merging appends member by member, and the
    result is checked and sorted per partition as get_seqlen_balanced_partitions does."""

    class Bucket:
        def __init__(self):
            self.sum = 0
            self.items = []

        def add(self, idx, val):
            self.items.append((idx, val))
            self.sum += val

        def absorb(self, other):
            for idx, val in other.items:
                self.add(idx, val)

        def __lt__(self, other):
            if self.sum != other.sum:
                return self.sum < other.sum
            if len(self.items) != len(other.items):
                return len(self.items) < len(other.items)
            return self.items < other.items

    class State:
        def __init__(self, items):
            self.buckets = [Bucket() for _ in range(k)]
            for bucket, (idx, val) in zip(self.buckets, items):
                bucket.add(idx, val)
            self.buckets = sorted(self.buckets, reverse=True)

        @property
        def spread(self):
            return self.buckets[0].sum - self.buckets[-1].sum

        def absorb(self, other):
            for i in range(k):
                self.buckets[i].absorb(other.buckets[k - 1 - i])
            self.buckets = sorted(self.buckets, reverse=True)

        def __lt__(self, other):  # heapq pops the largest spread first, then the largest bucket
            if self.spread != other.spread:
                return self.spread > other.spread
            return self.buckets[0] > other.buckets[0]

    ordered = sorted((v, i) for i, v in enumerate(lengths))
    step = k if equal_size else 1
    heap = []
    for s in range(0, len(ordered), step):
        heapq.heappush(heap, State([(i, v) for v, i in ordered[s:s + step]]))
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        a.absorb(b)
        heapq.heappush(heap, a)
    parts = [[idx for idx, _ in bucket.items] for bucket in heap[0].buckets]
    seen = set()
    for part in parts:
        seen.update(part)
    assert seen == set(range(len(lengths)))
    return [sorted(part) for part in parts]


def greedy(lengths: List[int], k: int, equal_size: bool) -> List[List[int]]:
    """Each sequence in batch order to the lightest partition (that still has room with equal_size)."""
    cap = len(lengths) // k if equal_size else len(lengths)
    parts: List[List[int]] = [[] for _ in range(k)]
    heap = [(0, p) for p in range(k)]
    for i, v in enumerate(lengths):
        total, p = heapq.heappop(heap)
        parts[p].append(i)
        if len(parts[p]) < cap:
            heapq.heappush(heap, (total + v, p))
    return parts


def imbalance(costs: np.ndarray, parts) -> float:
    sums = np.array([costs[np.asarray(p, dtype=np.int64)].sum() for p in parts], dtype=np.float64)
    return float(sums.max() / sums.mean())


def utilisation(lengths: np.ndarray, groups, budget: int) -> Dict[str, float]:
    real = float(lengths.sum())
    padded = sum(len(g) * int(lengths[g].max()) for g in groups)
    use = [max(budget, int(lengths[g].sum())) for g in groups]
    return {"count": len(groups), "padded_utilisation": real / padded, "budget_utilisation": real / sum(use),
            "over_budget": int(sum(int(lengths[g].sum()) > budget for g in groups))}


# ---------------------------------------------------------------- sections


def bench_balance(report: Report, sizes, python_limit_s: float) -> None:
    figures = report.meta.setdefault("balance", {})
    last_kk = {}  # (k, equal_size) -> (n, ms) of the last Python KK run
    for n in sizes:
        lengths = mixed_lengths(n, seed=n)
        as_list = lengths.tolist()
        for k in KS:
            for equal_size in (True, False):
                case = f"balance n={n} k={k}{' eq' if equal_size else ''}"
                plan = schedule.balance_partitions(lengths, k, equal_size)
                ms = time_ms(lambda: schedule.balance_partitions(lengths, k, equal_size), "cpu", warmup=2, rep=10)
                fig = {"verl_fast_ms": ms, "verl_fast_imbalance": plan.report.imbalance}
                report.add(case, "verl_fast", ms, note=f"imbalance {plan.report.imbalance:.7f}")
                # Python KK is skipped where one run would pass the limit, estimated from the
                # previous size of the same k and mode as time * (n / n_prev) * log n / log n_prev.
                prev = last_kk.get((k, equal_size))
                if prev is not None and prev[1] * n / prev[0] * np.log(n) / np.log(prev[0]) / 1e3 > python_limit_s:
                    fig["python_kk_ms"] = None
                    report.add(case, "python KK (verl)", float("nan"), note="skipped: too slow")
                else:
                    t0 = time.perf_counter()
                    parts = python_kk(as_list, k, equal_size)
                    first = (time.perf_counter() - t0) * 1e3
                    kk_ms = first if first > 2000 else time_ms(lambda: python_kk(as_list, k, equal_size), "cpu",
                                                               warmup=0, rep=3)
                    fig["python_kk_ms"] = kk_ms
                    last_kk[(k, equal_size)] = (n, kk_ms)
                    fig["python_kk_imbalance"] = imbalance(lengths, parts)
                    fig["speedup_vs_python_kk"] = kk_ms / ms
                    report.add(case, "python KK (verl)", kk_ms, note=f"imbalance {fig['python_kk_imbalance']:.7f}")
                parts = greedy(as_list, k, equal_size)
                fig["greedy_imbalance"] = imbalance(lengths, parts)
                g_ms = time_ms(lambda: greedy(as_list, k, equal_size), "cpu", warmup=0, rep=3)
                report.add(case, "greedy (verl)", g_ms, note=f"imbalance {fig['greedy_imbalance']:.7f}")
                figures[case] = fig
    # verl's DP balancing uses the FLOP proxy: one case with it.
    n, k = 16384, 8
    lengths = mixed_lengths(n, seed=n)
    case = f"balance n={n} k={k} eq flops"
    plan = schedule.balance_partitions(lengths, k, True, cost="flops")
    ms = time_ms(lambda: schedule.balance_partitions(lengths, k, True, cost="flops"), "cpu", warmup=2, rep=10)
    report.add(case, "verl_fast", ms, note=f"imbalance {plan.report.imbalance:.9f}")
    flops = (schedule.FLOPS_A * lengths + lengths ** 2).tolist()
    t_kk = time_ms(lambda: python_kk(flops, k, True), "cpu", warmup=0, rep=3)
    kk_imb = imbalance(np.asarray(flops), python_kk(flops, k, True))
    report.add(case, "python KK (verl)", t_kk, note=f"imbalance {kk_imb:.9f}")
    figures[case] = {"verl_fast_ms": ms, "verl_fast_imbalance": plan.report.imbalance, "python_kk_ms": t_kk,
                     "python_kk_imbalance": kk_imb, "speedup_vs_python_kk": t_kk / ms}


def bench_pack(report: Report, sizes) -> None:
    figures = report.meta.setdefault("pack", {})
    for n in sizes:
        lengths = mixed_lengths(n, seed=7 * n)
        for budget in (8192, 16384):
            case = f"pack n={n} budget={budget}"
            plan = schedule.pack_micro_batches(lengths, budget)
            ms = time_ms(lambda: schedule.pack_micro_batches(lengths, budget), "cpu", warmup=1, rep=5)
            ours = utilisation(lengths, list(plan), budget)
            padded_plan = schedule.pack_micro_batches(lengths, budget, layout="padded")
            padded_ms = time_ms(lambda: schedule.pack_micro_batches(lengths, budget, layout="padded"), "cpu",
                                warmup=1, rep=5)
            ours_padded = utilisation(lengths, list(padded_plan), budget)
            ours_padded["padded_budget_utilisation"] = padded_plan.report.budget_utilisation
            per_mb = budget // MAX_LEN  # fixed count: the longest possible sequence must fit the budget
            fixed = [np.arange(s, min(n, s + per_mb)) for s in range(0, n, per_mb)]
            fixed_u = utilisation(lengths, fixed, budget)
            count = -(-int(lengths.sum()) // budget)
            verl = schedule.balance_partitions(lengths, count, False, cost="flops")
            verl_u = utilisation(lengths, [g for g in verl if len(g)], budget)
            report.add(case, "verl_fast packed", ms,
                       note=f"{ours['count']} mbs, budget util {ours['budget_utilisation']:.4f}")
            report.add(case, "padded layout (ours)", padded_ms,
                       note=f"{ours_padded['count']} mbs, padded util {ours_padded['padded_utilisation']:.4f}")
            report.add(case, f"fixed {per_mb}/micro-batch", float("nan"),
                       note=f"{fixed_u['count']} mbs, budget util {fixed_u['budget_utilisation']:.4f}, "
                            f"padded util {fixed_u['padded_utilisation']:.4f}")
            report.add(case, "verl dynamic bsz (KK flops)", float("nan"),
                       note=f"{verl_u['count']} mbs, {verl_u['over_budget']} over budget")
            figures[case] = {"verl_fast_ms": ms, "verl_fast": ours, "verl_fast_padded_layout": ours_padded,
                             "fixed_count": fixed_u, "fixed_count_per_mb": per_mb, "verl_dynamic_bsz": verl_u}


def bench_rollout(report: Report, n: int) -> None:
    rng = np.random.default_rng(3)
    prompts = mixed_lengths(n, seed=11) // 2 + 8  # prompt lengths, 13..1032
    max_new = np.where(rng.random(n) < 0.5, 256, 1024)  # per-request budgets, two task kinds
    max_num_seqs, budget = 64, 64 * 2048
    case = f"rollout n={n} seqs<={max_num_seqs}"
    plan = schedule.rollout_buckets(prompts, max_new, max_num_seqs, budget)
    ms = time_ms(lambda: schedule.rollout_buckets(prompts, max_new, max_num_seqs, budget), "cpu", warmup=1, rep=5)
    worst = prompts + max_new
    fixed_padded = sum(len(c) * (int(prompts[c].max()) + int(max_new.max()))
                       for c in np.array_split(np.arange(n), -(-n // max_num_seqs)))
    fixed_util = float(worst.sum()) / fixed_padded
    report.add(case, "verl_fast", ms, note=f"{len(plan)} waves, padded util {plan.report.padded_utilisation:.4f}")
    report.add(case, "fixed chunks, global max_tokens", float("nan"), note=f"padded util {fixed_util:.4f}")
    report.meta["rollout"] = {"verl_fast_ms": ms, "waves": len(plan),
                              "verl_fast_padded_utilisation": plan.report.padded_utilisation,
                              "verl_fast_budget_utilisation": plan.report.budget_utilisation,
                              "fixed_chunks_padded_utilisation": fixed_util}


def run(quick: bool = False, python_limit_s: float = 30.0) -> Report:
    report = Report("schedule", "cpu")
    report.meta["workload"] = "GSM8K+Alpaca-like log-normal mix, 10..2048 tokens"
    sizes = SIZES[:2] if quick else SIZES
    bench_balance(report, sizes, python_limit_s)
    bench_pack(report, sizes)
    bench_rollout(report, 4096 if quick else 65536)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu"], help="plans are host computations")
    p.add_argument("--quick", action="store_true", help="n up to 16k only")
    p.add_argument("--python-limit-s", type=float, default=30.0,
                   help="skip a Python KK run estimated to take longer than this")
    args = p.parse_args(argv)
    report = run(args.quick, args.python_limit_s)
    path = report.save()
    print(report.table())
    print(f"saved {path}")
    return 0


# ---- pytest-benchmark entry points (small sizes) ----


def test_balance_16k_k8(benchmark):
    lengths = mixed_lengths(16384)
    benchmark(lambda: schedule.balance_partitions(lengths, 8))


def test_pack_16k(benchmark):
    lengths = mixed_lengths(16384)
    benchmark(lambda: schedule.pack_micro_batches(lengths, 16384))


if __name__ == "__main__":
    sys.exit(main())
