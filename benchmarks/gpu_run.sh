#!/usr/bin/env bash
# benchmarks/gpu_run.sh: the GPU pass, on a machine with one or two H200s (torch 2.11, Triton 3.6,
# Python 3.12, no vLLM / megatron, no network). It builds the package in place, runs the
# gpu-marked tests, then each area's benchmarks, and prints a short table last. Logs, JSON and
# tables go under $OUT when it is set (else benchmarks/results). One section per area.
#
#   bash benchmarks/gpu_run.sh                     # every section
#   SECTIONS="reshard" bash benchmarks/gpu_run.sh   # some sections (to fit a 10-minute call)
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export VF_BENCH_RESULTS="$OUT"
failed=()
SECTIONS=${SECTIONS:-"tests reshard"}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }

"$py" -m pip install -q --no-build-isolation --no-deps -e . || { echo "build failed"; exit 1; }
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'x', torch.cuda.device_count())"

# ---- tests (every area's gpu-marked tests) ----
if want tests; then
  "$py" -m pytest -q -m gpu python_tests -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1 || failed+=("pytest -m gpu")
  tail -n 15 "$OUT/pytest_gpu.log"
fi

# ---- reshard (issue 7): resharding engine ----
if want reshard; then
  # The CUDA executor against the CPU one; the 2-GPU NCCL test runs when two GPUs are visible.
  "$py" -m pytest -q -m gpu python_tests/test_reshard_cuda.py -p no:cacheprovider > "$OUT/pytest_reshard_gpu.log" 2>&1 \
    || failed+=("pytest reshard gpu")
  tail -n 15 "$OUT/pytest_reshard_gpu.log"
  # (a) 1 GPU HF -> vLLM TP=1 into preallocated tensors; (b) when 2 GPUs are visible, FSDP2 (2 ranks)
  # -> vLLM TP=2 over NCCL. Qwen2.5-7B shapes, bf16; ~30 GB per GPU.
  timeout 540 "$py" benchmarks/bench_reshard.py --device cuda --tiles-kb 64,256,1024 --buckets-mb 64,256,1024 \
    > "$OUT/bench_reshard.log" 2>&1 \
    || failed+=("bench_reshard")
  tail -n 40 "$OUT/bench_reshard.log"
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
