#!/usr/bin/env bash
# benchmarks/gpu_run.sh: the GPU tests and benchmarks, one section per area, run on the device machine
# after `pip install --no-build-isolation --no-deps -e .`. Results land in benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}

# ---- rollout (vLLM engine, issue 6) ----
# Needs vLLM: without it (the device machine has none) the tests skip and the benchmark prints
# "skipped" with the install hint. With `pip install vllm` they run on the GPU (sleep mode on).
"$py" -m pytest python_tests/test_vllm_engine.py -q -rs
"$py" benchmarks/bench_rollout.py --device cuda --dtype bfloat16 --models tiny --threads 1
