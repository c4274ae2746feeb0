"""compute_gae and the GRPO advantage against the ways peers write them:
the suite's module (verl_fast/bench/ops_advantage.py), run from the checkout, plus
pytest-benchmark entry points at a small size (``pytest benchmarks/bench_advantage.py``).

    python benchmarks/bench_advantage.py [the module's arguments]
"""

import sys

import verl_fast as vf
from verl_fast.bench.ops_advantage import gae_inputs, main

def test_gae_cpu(benchmark):
    r, v, m = gae_inputs(256, 1024, "cpu")
    benchmark(lambda: vf.compute_gae(r, v, m, 0.99, 0.95))


def test_grpo_cpu(benchmark):
    r, _, m = gae_inputs(4096, 128, "cpu")
    uids = [i // 16 for i in range(4096)]
    benchmark(lambda: vf.compute_grpo_advantage(r, m, uids))


if __name__ == "__main__":
    sys.exit(main())
