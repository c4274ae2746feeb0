"""Log-prob kernels against their baselines: the suite's module (verl_fast/bench/ops_logprob.py), run
from the checkout (gpu_run.sh runs it this way).

    python benchmarks/bench_logprob.py [the module's arguments]
"""

from verl_fast.bench.ops_logprob import main

if __name__ == "__main__":
    raise SystemExit(main())
