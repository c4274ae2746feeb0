"""The batch scheduler against the ways peers plan batches:
the suite's module (verl_fast/bench/ops_schedule.py), run from the checkout, plus
pytest-benchmark entry points at a small size (``pytest benchmarks/bench_schedule.py``).

    python benchmarks/bench_schedule.py [the module's arguments]
"""

import sys

from verl_fast import schedule
from verl_fast.bench.ops_schedule import main, mixed_lengths


def test_balance_16k_k8(benchmark):
    lengths = mixed_lengths(16384)
    benchmark(lambda: schedule.balance_partitions(lengths, 8))


def test_pack_16k(benchmark):
    lengths = mixed_lengths(16384)
    benchmark(lambda: schedule.pack_micro_batches(lengths, 16384))


if __name__ == "__main__":
    sys.exit(main())
