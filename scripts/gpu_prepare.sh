#!/usr/bin/env bash
# scripts/gpu_prepare.sh: lays out, on the CPU machine, everything benchmarks/gpu_run.sh's sections carry to the
# GPU machine (which has no network), all of it git-ignored:
#   .dvp0 .. .dvpN, .dvdeps1, .dvdeps2  vLLM 0.26 (the GPU image's torch 2.11 build) slimmed and in pieces, and
#                                      the wheels it needs (../shared/tools/device_vllm/prepare.sh, then
#                                      scripts/vllm_pieces.py)
#   .whl/                              the pure-Python wheels of the baselines and sections: trl, datasets, dill,
#                                      multiprocess (TRL's runs), megatron-core (the megatron section)
#   .bench_assets/                     the demo model's tokenizer (bench_e2e, bench_multi_turn, bench_agent_endpoint)
# Then, one GPU machine, calls back to back (each carries its folder; the machine keeps /tmp while warm):
#   .dvp0 ... .dvpN and .dvdeps1, each `mkdir -p /tmp/dv && cp FOLDER/* /tmp/dv/` (the first may also build:
#   `python3 -m pip install --no-build-isolation --no-deps -e .`), then the working calls carrying .dvdeps2 (the
#   first; gpu_run.sh installs vLLM from /tmp/dv) and .whl / .bench_assets as their sections need.
#   PYTHON=<the test install's python> bash scripts/gpu_prepare.sh [--no-vllm]   # (bench_e2e imports torch)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
for d in .whl .bench_assets .dvp0 .dvp1 .dvp2 .dvp3 .dvp4; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
if [ "${1:-}" != --no-vllm ]; then
  bash ../shared/tools/device_vllm/prepare.sh > /dev/null
  "$py" scripts/vllm_pieces.py
  rm -rf .dv0 .dv1 .dv2 .dv3 .dv4  # prepare.sh's unslimmed pieces: the .dvp* folders replace them
fi
mkdir -p .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 megatron-core==0.16.1
"$py" benchmarks/bench_e2e.py --prepare-assets
du -sh .dvp* .dvdeps1 .dvdeps2 .whl .bench_assets 2>/dev/null
