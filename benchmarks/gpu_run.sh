#!/usr/bin/env bash
# The one script for the GPU machine (device tool): build the package, run the GPU tests, run the
# GPU benchmarks, leave logs and results under $OUT, print a short table last.
#
#   bash benchmarks/gpu_run.sh                          # every section
#   SECTIONS="tests advantage" bash benchmarks/gpu_run.sh   # some (to fit a 10-minute call)
#   GPU_TESTS="python_tests/test_logprobs.py" SECTIONS=tests ...  # some test files only
#   LOGPROB_CASES=logits SECTIONS=logprobs ...                     # one of the log-prob cases
#
# Sections: tests (every gpu-marked test), advantage, logprobs, reshard, megatron (2 GPUs).
# That machine: H200(s), torch 2.11 + CUDA 13, Triton 3.6, Python 3.12, no vLLM / megatron-core, no
# network: build with --no-build-isolation --no-deps; pure-Python wheels (liger-kernel for the
# logprobs baseline) travel in .whl/ (carry it).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VF_BENCH_SUMMARY="$OUT/summary.txt" VF_BENCH_RESULTS="$OUT/results"
: > "$VF_BENCH_SUMMARY"
SECTIONS=${SECTIONS:-"tests advantage logprobs reshard megatron"}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
failed=()

if ls .whl/*.whl > /dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
if ! "$py" -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
"$py" -m verl_fast info | tee -a "$OUT/gpu.txt"

# ---- tests: every area's gpu-marked tests ----
if want tests; then
  "$py" -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-python_tests} > "$OUT/pytest_gpu.log" 2>&1 || failed+=("pytest -m gpu")
  tail -n 15 "$OUT/pytest_gpu.log"
fi

: >> "$OUT/bench.log"
# ---- advantage (issue 2): GAE / GRPO vs the Python loops, memory floor ----
if want advantage; then
  "$py" benchmarks/bench_advantage.py --device cuda >> "$OUT/bench.log" 2>&1 || failed+=("bench_advantage")
fi

# ---- logprobs (issue 4): fused log-prob / entropy kernels; sweeps block sizes first ----
if want logprobs; then
  timeout 540 "$py" benchmarks/bench_logprob.py --device cuda --cases "${LOGPROB_CASES:-logits,linear}" \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_logprob")
fi

# ---- reshard (issue 7): (a) 1 GPU HF -> vLLM TP=1 into preallocated tensors; (b) with 2 GPUs,
# FSDP2 (2 ranks) -> vLLM TP=2 over NCCL. Qwen2.5-7B shapes, bf16; ~30 GB per GPU. ----
if want reshard; then
  timeout 540 "$py" benchmarks/bench_reshard.py --device cuda --tiles-kb 64,256,1024 --buckets-mb 64,256,1024 \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_reshard")
fi

# ---- megatron (issue 14): GRPO update phase, Qwen2 1.5B shape, 2 GPUs: megatron-core TP=2 vs FSDP2;
# time, MFU, peak memory per GPU (needs megatron-core's wheel in .whl/; ~3 minutes) ----
if want megatron; then
  timeout 300 "$py" -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_megatron.py \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_megatron")
fi

(cd "$OUT" && [ -d results ] && tar czf results.tgz results && rm -rf results)
echo "==================== summary ===================="
grep -E "passed|failed|error" "$OUT/pytest_gpu.log" 2>/dev/null | tail -n 3
cat "$VF_BENCH_SUMMARY"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"; tail -n 40 "$OUT/bench.log"; exit 1
fi
