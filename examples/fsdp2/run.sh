#!/usr/bin/env bash
# GRPO with an FSDP2-sharded actor on NPROC GPUs of this machine (NNODES > 1: also set
# --node_rank and --rdzv_endpoint as torchrun documents).
set -euo pipefail
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" -m verl_fast train \
  --config "$(dirname "$0")/config.yaml" "$@"
