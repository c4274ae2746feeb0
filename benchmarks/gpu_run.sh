#!/usr/bin/env bash
# The one script for the GPU machine (device tool): build the package, run the GPU tests, run the
# GPU benchmarks, leave logs and results under $OUT, print a short table last.
#
#   bash benchmarks/gpu_run.sh [section ...]      sections: advantage (default: all)
#
# That machine: H200(s), torch 2.11 + CUDA 13, Triton 3.6, Python 3.12, no network: build with
# --no-build-isolation --no-deps; extra pure-Python wheels travel in .whl/ (carry it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VF_BENCH_SUMMARY="$OUT/summary.txt" VF_BENCH_RESULTS="$OUT/results"
: > "$VF_BENCH_SUMMARY"
sections=${*:-advantage}
has() { [[ " $sections " == *" $1 "* ]]; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -m verl_fast info | tee -a "$OUT/gpu.txt"

tests=()
has advantage && tests+=(python_tests/test_advantage.py)
python3 -m pytest -m gpu -q -x -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 15

: > "$OUT/bench.log"
if has advantage; then
  python3 benchmarks/bench_advantage.py --device cuda >> "$OUT/bench.log" 2>&1 || tail -n 30 "$OUT/bench.log"
fi

(cd "$OUT" && tar czf results.tgz results 2>/dev/null && rm -rf results)
echo "==================== summary ===================="
grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -n 3
cat "$VF_BENCH_SUMMARY"
