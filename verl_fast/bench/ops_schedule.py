"""The batch scheduler against the way peers plan batches (CPU only: plans are host computations).

    python -m verl_fast.bench.ops_schedule [--quick] [--python-limit-s 30]

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
from typing import Dict, List

import numpy as np

from verl_fast.bench.record import Report, time_ms

from verl_fast import schedule

SIZES = [1024, 16384, 131072]
QUICK_SIZES = [1024, 4096]
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


def packing_quality(lengths: np.ndarray, groups, budget: int, packed: bool = False) -> Dict[str, float]:
    """Micro-batch count, real / padded tokens (padded layouts only), real / budget (a group over
    the budget counts as its own size)."""
    groups = [np.asarray(g, dtype=np.int64) for g in groups if len(g)]
    real = float(lengths.sum())
    sums = np.array([lengths[g].sum() for g in groups])
    padded = sum(len(g) * int(lengths[g].max()) for g in groups)
    return {"groups": len(groups), "padded_util": None if packed else real / padded,
            "budget_util": real / float(np.maximum(sums, budget).sum()), "over_budget": int((sums > budget).sum())}


def quality(report: Report, case: str, plan: str, **figures) -> None:
    report.meta.setdefault("quality", []).append({"case": case, "plan": plan, **figures})


def quality_table(report: Report) -> str:
    lines = ["plan quality (same inputs)",
             f"{'case':<28} {'plan':<30} {'groups':>7} {'imbalance':>11} {'padded util':>11} {'budget util':>11} "
             f"{'over budget':>11}"]
    for q in report.meta.get("quality", []):
        def fmt(key, spec):
            return format(q[key], spec) if q.get(key) is not None else ""
        line = (f"{q['case']:<28} {q['plan']:<30} {fmt('groups', 'd'):>7} {fmt('imbalance', '.7f'):>11} "
                f"{fmt('padded_util', '.4f'):>11} {fmt('budget_util', '.4f'):>11} {fmt('over_budget', 'd'):>11}")
        lines.append(line + (f"  {q['note']}" if q.get("note") else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------- sections


def bench_balance_case(report: Report, case: str, lengths: np.ndarray, k: int, equal_size: bool, cost: str,
                       python_estimate_s: float, python_limit_s: float):
    """Times ours, the Python KK (unless estimated over the limit) and greedy on the same costs;
    returns the Python KK's ms, or None when skipped."""
    costs = lengths if cost == "tokens" else schedule.FLOPS_A * lengths + lengths ** 2
    as_list = costs.tolist()
    plan = schedule.balance_partitions(lengths, k, equal_size, cost)
    ms = time_ms(lambda: schedule.balance_partitions(lengths, k, equal_size, cost), "cpu", warmup=2, rep=10)
    report.add(case, "verl_fast", ms)
    quality(report, case, "verl_fast KK", groups=k, imbalance=plan.report.imbalance)
    kk_ms = None
    if python_estimate_s > python_limit_s:
        quality(report, case, "python KK (verl)", note=f"skipped: estimated {python_estimate_s:.0f} s")
    else:
        t0 = time.perf_counter()
        parts = python_kk(as_list, k, equal_size)
        first = (time.perf_counter() - t0) * 1e3
        kk_ms = first if first > 2000 else time_ms(lambda: python_kk(as_list, k, equal_size), "cpu", warmup=0, rep=3)
        report.add(case, "python KK (verl)", kk_ms)
        quality(report, case, "python KK (verl)", groups=k, imbalance=imbalance(costs, parts))
    parts = greedy(as_list, k, equal_size)
    report.add(case, "greedy (verl)", time_ms(lambda: greedy(as_list, k, equal_size), "cpu", warmup=0, rep=3))
    quality(report, case, "greedy (verl)", groups=k, imbalance=imbalance(costs, parts))
    return kk_ms


def bench_balance(report: Report, sizes, python_limit_s: float) -> None:
    last_kk = {}  # (k, equal_size) -> (n, ms) of the last Python KK run
    for n in sizes:
        lengths = mixed_lengths(n, seed=n)
        for k in KS:
            for equal_size in (True, False):
                # Python KK is skipped where one run would pass the limit, estimated from the
                # previous size of the same k and mode as time * (n / n_prev) * log n / log n_prev.
                prev = last_kk.get((k, equal_size))
                estimate = 0.0 if prev is None else prev[1] * n / prev[0] * np.log(n) / np.log(prev[0]) / 1e3
                case = f"balance n={n} k={k}{' eq' if equal_size else ''}"
                kk_ms = bench_balance_case(report, case, lengths, k, equal_size, "tokens", estimate, python_limit_s)
                if kk_ms is not None:
                    last_kk[(k, equal_size)] = (n, kk_ms)
    # verl's DP balancing uses the FLOP proxy 24576 * L + L^2: one case with it.
    n = 16384
    bench_balance_case(report, f"balance n={n} k=8 eq flops", mixed_lengths(n, seed=n), 8, True, "flops", 0.0,
                       python_limit_s)


def bench_pack(report: Report, sizes) -> None:
    for n in sizes:
        lengths = mixed_lengths(n, seed=7 * n)
        for budget in (8192, 16384):
            case = f"pack n={n} budget={budget}"
            plan = schedule.pack_micro_batches(lengths, budget)
            report.add(case, "verl_fast", time_ms(lambda: schedule.pack_micro_batches(lengths, budget), "cpu",
                                                  warmup=1, rep=5))
            quality(report, case, "verl_fast packed", imbalance=plan.report.imbalance,
                    **packing_quality(lengths, plan, budget, packed=True))
            padded = schedule.pack_micro_batches(lengths, budget, layout="padded")
            report.add(case, "verl_fast layout=padded",
                       time_ms(lambda: schedule.pack_micro_batches(lengths, budget, layout="padded"), "cpu",
                               warmup=1, rep=5))
            figures = packing_quality(lengths, padded, budget)
            figures["budget_util"] = padded.report.budget_utilisation  # the budget counts padding here
            quality(report, case, "verl_fast padded layout", **figures)
            per_mb = budget // MAX_LEN  # fixed count: the longest possible sequence must fit the budget
            fixed = [np.arange(s, min(n, s + per_mb)) for s in range(0, n, per_mb)]
            quality(report, case, f"fixed {per_mb} seqs/micro-batch", **packing_quality(lengths, fixed, budget))
            count = -(-int(lengths.sum()) // budget)
            verl = schedule.balance_partitions(lengths, count, False, cost="flops")
            quality(report, case, "verl dynamic bsz (KK on flops)",
                    **packing_quality(lengths, verl, budget, packed=True))


def bench_rollout(report: Report, n: int) -> None:
    rng = np.random.default_rng(3)
    prompts = mixed_lengths(n, seed=11) // 2 + 8  # prompt lengths, 13..1032
    max_new = np.where(rng.random(n) < 0.5, 256, 1024)  # per-request budgets, two task kinds
    max_num_seqs, budget = 64, 64 * 2048
    case = f"rollout n={n} seqs<={max_num_seqs}"
    plan = schedule.rollout_buckets(prompts, max_new, max_num_seqs, budget)
    report.add(case, "verl_fast", time_ms(lambda: schedule.rollout_buckets(prompts, max_new, max_num_seqs, budget),
                                          "cpu", warmup=1, rep=5))
    quality(report, case, "verl_fast waves", groups=len(plan), padded_util=plan.report.padded_utilisation,
            budget_util=plan.report.budget_utilisation)
    # Arrival-order chunks of max_num_seqs, every request padded to the chunk's longest prompt and
    # decoding up to the global max_new_tokens.
    chunks = np.array_split(np.arange(n), -(-n // max_num_seqs))
    worst = float((prompts + max_new).sum())
    padded = sum(len(c) * (int(prompts[c].max()) + int(max_new.max())) for c in chunks)
    kv = [min(budget, int(prompts[c].sum()) + len(c) * int(max_new.max())) for c in chunks]
    quality(report, case, "fixed chunks, global max_tokens", groups=len(chunks), padded_util=worst / padded,
            budget_util=worst / (len(chunks) * budget), note=f"{sum(k >= budget for k in kv)} chunks at the KV budget")


def run(quick: bool = False, python_limit_s: float = 30.0) -> Report:
    report = Report("schedule", "cpu")
    report.meta["workload"] = "GSM8K+Alpaca-like log-normal mix, 10..2048 tokens"
    sizes = QUICK_SIZES if quick else SIZES
    bench_balance(report, sizes, python_limit_s)
    bench_pack(report, sizes)
    bench_rollout(report, 4096 if quick else 65536)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="n up to 4096 only")
    p.add_argument("--python-limit-s", type=float, default=30.0,
                   help="skip a Python KK run estimated to take longer than this")
    args = p.parse_args(argv)
    report = run(args.quick, args.python_limit_s)
    path = report.save()
    print(report.table())
    print(quality_table(report))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
