#!/usr/bin/env bash
# benchmarks/gpu_run.sh: the GPU pass, on a machine with one or two H200s (torch 2.11, Triton 3.6,
# Python 3.12, no vLLM / megatron, no network). It builds the package in place, runs the
# gpu-marked tests, then each area's benchmarks, and prints a short table last. Logs, JSON and
# tables go under $OUT when it is set (else benchmarks/results). One section per area.
#
#   bash benchmarks/gpu_run.sh                      # every section
#   SECTIONS="logprobs" bash benchmarks/gpu_run.sh   # some sections (to fit a 10-minute call)
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export VF_BENCH_RESULTS="$OUT"
failed=()
SECTIONS=${SECTIONS:-"tests logprobs"}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }

"$py" -m pip install -q --no-build-isolation --no-deps -e . || { echo "build failed"; exit 1; }
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

# ---- tests (every area's gpu-marked tests) ----
if want tests; then
  "$py" -m pytest -q -m gpu python_tests -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1 || failed+=("pytest -m gpu")
  tail -n 15 "$OUT/pytest_gpu.log"
fi

# ---- logprobs (issue 4): fused log-prob / entropy kernels ----
if want logprobs; then
  # Liger-Kernel (pure Python) is the fused-linear-cross-entropy baseline; its wheel is carried in .whl/.
  if ls .whl/liger_kernel-*.whl > /dev/null 2>&1; then
    "$py" -m pip install -q --no-deps .whl/liger_kernel-*.whl || echo "liger-kernel not installed: its row is skipped"
  fi
  # Sweeps block sizes per kernel, then times baselines and ours at N=8192, H=3584, V=151936, bf16.
  timeout 540 "$py" benchmarks/bench_logprob.py --device cuda > "$OUT/bench_logprob.log" 2>&1 || failed+=("bench_logprob")
  tail -n 70 "$OUT/bench_logprob.log"
fi

# ---- summary ----
echo
echo "==== summary ===="
for table in "$OUT"/*_cuda.txt; do
  [ -f "$table" ] && grep -v "^tune: " "$table"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all passed"
