#!/usr/bin/env bash
# The one script for the GPU machine (device tool): build the package, run the GPU tests, run the
# GPU benchmarks, leave logs and results under $OUT, print a short table last.
#
#   bash benchmarks/gpu_run.sh                          # every section
#   SECTIONS="tests advantage" bash benchmarks/gpu_run.sh   # some (to fit a 10-minute call)
#   GPU_TESTS="python_tests/ops/test_logprobs.py" SECTIONS=tests ...  # some test files only
#   LOGPROB_CASES=logits SECTIONS=logprobs ...                     # one of the log-prob cases
#   E2E_SET="actor.max_token_len_per_gpu=32768" SECTIONS=e2e ...     # config overrides for our e2e runs
#   E2E_SWEEP="default,actor.max_token_len_per_gpu=65536" SECTIONS=e2e ... # each of our e2e runs once per item
#   E2E_PROFILE=0 E2E_TOKENS=1024 SECTIONS=e2e ...                    # without the profiled rollout + update
#   E2E_PROFILE_STEPS=1 SECTIONS=e2e ...                               # kernel-busy time, clocks, CPU of every phase (diagnostic)
#   HOTPATHS_CASES=gae,logprobs VLLM_ALONE_VARIANTS=default,async SECTIONS=hotpaths ...  # some hot paths / vLLM variants
#   VLLM_IMPORT_PROFILE=1 SECTIONS=hotpaths ...                     # and where `import vllm` goes, module by module
#   HOTPATHS_DEVICE=cpu CMAKE_ARGS=-DVERL_FAST_CUDA=OFF SECTIONS=hotpaths ...  # the section checked on a CPU at small sizes
#
# Sections: tests (every gpu-marked test), long_caps (the update's peak memory at 8k-16k caps and prime-rl's 16k / 64k rows, issue 66), defaults (the trainer's defaults at 0.5B / 1.5B, issue 42), 7b (the 7B
# class: LoRA and full fine-tune, ours or TRL's by SEVEN_B), shapes (a new token count's first-call cost), decode (the rollout's decode alone), merge (the LoRA merge before a rollout),
# overlap (the reward beside the old-log-prob pass), agent_endpoint (an agent through the rollout endpoint, issue 68), hotpaths (the ops as users call them, before / after issue 48), vllm (every vLLM test, on the GPU's vLLM), trainer (the CLI
# with vLLM rollout: GRPO + resume, PPO, the default config), advantage, logprobs, reshard, hybrid, e2e,
# sft (our SFT step beside TRL's SFTTrainer), vlm (vision-language GRPO and SFT at the Qwen2.5-VL-3B shape beside TRL's, issue 70), ragged (GRPO at users' response lengths, issue 66), async (off / one_step / full), dist (needs 2 GPUs), megatron (2 GPUs; megatron-core's wheel in .whl/),
# fp8 (FP8 rollout vs bf16 at 7B: sync, HF decode, vLLM), decode_fused (the decode's fused kernels on / off, issue 66), bench (`verl-fast bench` itself, quick sizes), ncu (Nsight Compute on the GAE scan kernel, where the image has it).
# That machine: H200(s), torch 2.11 + CUDA 13, Triton 3.6, Python 3.12, no vLLM / megatron-core, no
# network: build with --no-build-isolation --no-deps; `bash scripts/gpu_prepare.sh` lays out here what the sections
# carry: pure-Python wheels (trl, datasets, dill, multiprocess for TRL's runs; megatron-core; liger-kernel for the
# logprobs baseline by hand) in .whl/, the demo tokenizer in .bench_assets/, and vLLM 0.26 in pieces (../shared/tools/device_vllm/README.md: `prepare.sh` downloads it and
# lays out .dvdeps1, .dvdeps2; `python scripts/vllm_pieces.py` rewrites the wheel without what an SM90 GPU never
# loads and splits it into .dvp0 .. .dvp2, each holding vllm.part.N): short calls back to back copy each piece folder and
# .dvdeps1 into /tmp/dv/ (`mkdir -p /tmp/dv && cp .dvpN/* /tmp/dv/`, each carrying its folder); the call that carries
# .dvdeps2 installs it all into /tmp/site (later calls on the same machine find it there).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VF_BENCH_SUMMARY="$OUT/summary.txt" VF_BENCH_RESULTS="$OUT/results"
: > "$VF_BENCH_SUMMARY"
SECTIONS=${SECTIONS:-"tests advantage logprobs reshard hybrid e2e bench megatron"}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
failed=()

if [ -d .dvdeps2 ] && [ ! -d /tmp/site/vllm ]; then  # the pieces' last folder: assemble the wheel, install all
  cp -n .dvdeps2/*.whl /tmp/dv/ && cat /tmp/dv/vllm.part.? > "/tmp/$(cat /tmp/dv/WHEEL_NAME)" &&
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "/tmp/$(cat /tmp/dv/WHEEL_NAME)" /tmp/dv/*.whl > "$OUT/install.log" 2>&1 ||
    { tail -n 20 "$OUT/install.log"; exit 1; }
fi
wheels=$(ls .whl/*.whl 2>/dev/null || ls /tmp/whl/*.whl 2>/dev/null)  # carried now, or by an earlier call
if [ -n "$wheels" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $wheels \
    >> "$OUT/install.log" 2>&1 || { echo "the carried wheels did not install:"; tail -n 5 "$OUT/install.log"; }
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=90}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
if ! "$py" -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
"$py" -m verl_fast info | tee -a "$OUT/gpu.txt"

# ---- tests: every area's gpu-marked tests ----
if want tests; then
  timeout ${TESTS_TIMEOUT:-1200} "$py" -m pytest -m gpu -q -p no:cacheprovider --durations=10 ${GPU_TESTS:-python_tests} \
    > "$OUT/pytest_gpu.log" 2>&1 || failed+=("pytest -m gpu")
  tail -n 15 "$OUT/pytest_gpu.log"
fi

# ---- vllm (issue 23): every test of the vLLM engine, the weight sync and the trainer with vLLM rollout, on the
# GPU's vLLM (bf16 engine; sleep levels; the direct write from HF / FSDP2 / FSDP1 / Megatron on one GPU) ----
VLLM_TESTS="python_tests/rollout/test_vllm_engine.py python_tests/rollout/test_vllm_models.py
  python_tests/rollout/test_weight_sync.py python_tests/rollout/test_trainer_vllm.py python_tests/rollout/test_hybrid_engine.py
  python_tests/rollout/test_megatron_rollout.py python_tests/package/test_seed_snippets.py"
if want vllm; then
  # -v: one line per test as it ends, so a run cut by the timeout still shows which tests passed (~480 s in all)
  timeout ${VLLM_TIMEOUT:-540} "$py" -m pytest -v -p no:cacheprovider -rs --durations=15 ${VLLM_TESTS_ONLY:-$VLLM_TESTS} \
    > "$OUT/pytest_vllm.log" 2>&1 || failed+=("pytest vllm")
  grep -E "^(FAILED|ERROR)| (FAILED|ERROR) |[0-9]+ passed|failed" "$OUT/pytest_vllm.log" | tail -n 20
  echo "vllm tests passed so far: $(grep -c ' PASSED' "$OUT/pytest_vllm.log")"
fi

# ---- trainer (issue 23): `verl-fast train` with rollout.type vllm: GRPO + checkpoint + resume, PPO, the
# embedded default config with trainer.device=cuda (a small random-weight model; eager engine) ----
if want trainer; then
  timeout ${TRAINER_TIMEOUT:-400} "$py" benchmarks/bench_trainer_vllm.py --device cuda --eager \
    > "$OUT/trainer_vllm.log" 2>&1 || failed+=("bench_trainer_vllm")
  tail -n 8 "$OUT/trainer_vllm.log"
fi

# ---- dist (issue 12): the trainer under torchrun on 2 GPUs (NCCL): FSDP2 actor + reference from
# the config, PPO with bf16 mixed precision + CPU offload + checkpointing; a few steps each ----
if want dist; then
  "$py" -m pytest -m gpu -q -p no:cacheprovider python_tests/strategies/test_trainer_scale.py > "$OUT/pytest_dist.log" 2>&1 \
    || failed+=("pytest dist")
  tail -n 15 "$OUT/pytest_dist.log"
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

# ---- reshard (issue 7): (a) 1 GPU HF -> vLLM TP=1 into preallocated tensors, and the one-shot
# vllm_weights call against torch.cat allocating (target <= 8 ms); the one-shot call's host work
# (7B's 339 names, tiny tensors: what the GPU waits for before the launch) and its GPU tests;
# (b) with 2 GPUs, FSDP2 (2 ranks) -> vLLM TP=2 over NCCL. Qwen2.5-7B shapes, bf16; ~30 GB per GPU. ----
if want reshard; then
  timeout 300 "$py" benchmarks/bench_reshard.py --device cuda --only 1 --tiles-kb 64,256,1024 \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_reshard 1")
  timeout 120 "$py" benchmarks/bench_reshard.py --device cuda --only host \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_reshard host")
  "$py" -m pytest -m gpu -q -p no:cacheprovider python_tests/ops/test_reshard_oneshot.py >> "$OUT/bench.log" 2>&1 \
    || failed+=("pytest reshard one-shot")
  timeout 300 "$py" benchmarks/bench_reshard.py --device cuda --only 2 --buckets-mb 64,256,1024 \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_reshard 2")
fi

# ---- hybrid (issue 13): the trainer's weight sync, an FSDP2-sharded Qwen2.5-7B-shaped module on
# 2 GPUs -> vLLM TP=2 parameter tensors, timed around WeightSync.run (the vLLM engine's sync_from
# on GPU; target <= 10 ms), per-parameter all-gather baseline (the direct-write tests run in the tests section). ----
if want hybrid; then
  timeout 400 "$py" benchmarks/bench_reshard.py --device cuda --only sync --buckets-mb 256,1024 \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_reshard sync")
fi

# ---- hotpaths (issue 48): the ops as users call them, before and after the issue's host paths side by side:
# compute_gae 1024x4096 (and its scan alone over row counts and lengths), logprobs_from_logits 8192x151936, the one-shot reshard at Qwen2.5-7B shapes, and
# linear_logprobs' fwd+bwd per chunk size / d_hidden GEMM / store_logits, each beside its baseline and floor,
# and the wrappers' host time per call on 2x8 tensors (CPU and CUDA, compute_gae piece by piece, issue 49);
# then the gpu tests of the changed paths (HOTPATHS_TESTS=0 skips them); then, where vLLM imports,
# LLM.generate alone against our engine (0.5B, a second engine start over kept compile caches).
# ~3-4 minutes on one H200 with the build (vLLM: +3-5). ----
if want hotpaths; then
  timeout ${HOTPATHS_TIMEOUT:-240} "$py" benchmarks/bench_hotpaths.py --device "${HOTPATHS_DEVICE:-cuda}" \
    --cases "${HOTPATHS_CASES:-gae,gae_rows,logprobs,reshard,linear,linear05,host}" >> "$OUT/bench.log" 2>&1 || failed+=("bench_hotpaths")
  sed -n '/^hotpaths on/,/^saved/p' "$OUT/bench.log" | tail -n 110
  if [ "${HOTPATHS_TESTS:-1}" = 1 ]; then  # after the figures, so a call cut short still has them
    "$py" -m pytest -m gpu -q -p no:cacheprovider python_tests/ops/test_reshard_new_outputs.py \
      python_tests/ops/test_logprobs_host_path.py python_tests/ops/test_advantage.py \
      > "$OUT/pytest_hotpaths.log" 2>&1 || failed+=("pytest hotpaths")
    "$py" -m pytest -m gpu -q -p no:cacheprovider python_tests/ops/test_linear_logprobs.py -k store \
      >> "$OUT/pytest_hotpaths.log" 2>&1 || failed+=("pytest linear store_logits")
    grep -E "passed|failed" "$OUT/pytest_hotpaths.log" | tail -n 2
  fi
  if "$py" -c "import vllm" > /dev/null 2>&1; then
    timeout ${VLLM_ALONE_TIMEOUT:-420} "$py" benchmarks/bench_vllm_alone.py --device "${HOTPATHS_DEVICE:-cuda}" \
      --variants "${VLLM_ALONE_VARIANTS:-default}" --cache-dir "${VLLM_CACHE_DIR:-/tmp/vf_vllm_cache}" \
      $([ "${VLLM_IMPORT_PROFILE:-0}" = 1 ] && echo --import-profile) \
      >> "$OUT/bench.log" 2>&1 || failed+=("bench_vllm_alone")
    sed -n '/^vllm_alone on/,/^saved/p' "$OUT/bench.log" | tail -n 20
    grep '^import (' "$OUT/bench.log" | tail -n 24
  else
    echo "hotpaths: vLLM does not import here, bench_vllm_alone skipped"
  fi
fi

# ---- shapes (issue 24): what a linear layer and the varlen attention pay at a token count they have not
# seen, exact and bucketed (packed micro-batches meet a new count almost every step) ----
if want shapes; then
  timeout 120 "$py" benchmarks/bench_new_shapes.py --device cuda >> "$OUT/bench.log" 2>&1 || failed+=("bench_new_shapes")
  grep -E "first call" "$OUT/bench.log" | tail -n 24
fi

# ---- async (issue 47): trainer.async_mode off / one_step / full (a rollout worker process sharing the GPU,
# weights through one CUDA IPC buffer) at the Qwen2 0.5B and 1.5B shapes, in one call; needs .bench_assets/
# (as e2e). About 2.5 min per shape (0.5b and 1.5b together took 289 s); ASYNC_SHAPES=7b-lora runs the modes
# with LoRA r 64 at the 7B shape (full's workers get the adapters merged into the base); ASYNC_NAME names the
# report (default async), ASYNC_RUN_TIMEOUT each (shape, mode) run's seconds (240). ASYNC_MPS=1 runs the section under an MPS daemon started here and stopped after it
# (processes sharing the GPU then run kernels side by side; without it their contexts take turns). Each run's
# step before the last is profiled, one_step's apart (ASYNC_TRACE=0 leaves it out; the last has no next rollout
# beside it): kernels and busy seconds per stream, the seconds the two busiest streams ran together, the CPU of
# the main thread, the process and its busiest threads; both steps left out of the medians ----
if want async; then
  if [ "${ASYNC_MPS:-0}" = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/vf_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/vf_mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { failed+=("mps daemon"); unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
  fi
  timeout ${ASYNC_TIMEOUT:-560} "$py" benchmarks/bench_async.py --device cuda --shapes "${ASYNC_SHAPES:-0.5b,1.5b}" \
    --modes "${ASYNC_MODES:-off,one_step,full}" --steps "${ASYNC_STEPS:-8}" --name "${ASYNC_NAME:-async}" \
    --timeout "${ASYNC_RUN_TIMEOUT:-240}" \
    $([ "${ASYNC_TRACE:-1}" = 1 ] && echo --trace) \
    > "$OUT/bench_async.log" 2>&1 || failed+=("bench_async")
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo quit | nvidia-cuda-mps-control
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
  sed -n '/^case  *mode/,$p' "$OUT/bench_async.log" | tail -n 10
  grep ' phases: ' "$OUT/bench_async.log"
fi

# ---- e2e (issue 12): our GRPO step vs TRL's GRPOTrainer (HF rollout), Qwen2 0.5B and 1.5B shapes with
# random weights built here; 1 GPU (ours and TRL side by side on GPUs 0 and 1), 2 GPUs (ours, FSDP2,
# torchrun, the same per-GPU batch). About 6 minutes on 2 H200. ----
if want e2e; then
  timeout ${E2E_TIMEOUT:-560} "$py" benchmarks/bench_e2e.py --device cuda --shapes "${E2E_SHAPES:-0.5b,1.5b}" \
    --impls "${E2E_IMPLS:-ours_hf,ours_hfc,ours_vllm,trl_hf,trl_vllm}" --tokens "${E2E_TOKENS:-256}" \
    --steps "${E2E_STEPS:-10}" --trl-steps "${E2E_TRL_STEPS:-hf:3,vllm:5}" --timeout "${E2E_RUN_TIMEOUT:-240}" \
    $(for item in ${E2E_SET:-}; do printf -- '--set=%s ' "$item"; done) $([ "${E2E_PROFILE:-1}" = 0 ] && echo --no-profile) \
    ${E2E_SWEEP:+--sweep "$E2E_SWEEP"} $([ "${E2E_PROFILE_STEPS:-0}" = 1 ] && echo --profile-steps) \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_e2e")
  sed -n '/^e2e GRPO step/,$p' "$OUT/bench.log" | tail -n 12
fi

# ---- ragged (issue 66): GRPO steps at users' lengths, ours (defaults) beside TRL 1.16 + vLLM colocate in the same
# call: responses end at a heavy-tailed distribution written into the random model's weights (verl_fast/bench/
# lengths.py: the same files for both sides, calibrated per cap to a median of a few hundred tokens and a p99
# near the cap), each run's per-row lengths, decode steps against tokens, generation against its floor, peak
# memory (results/e2e_ragged_<row>_cuda.json; `python scripts/bench_docs.py --e2e` writes README's and
# docs/benchmarks.md's tables from them). RAGGED_ROWS picks rows, one or two a 10-minute call (models kept in
# /tmp/vf_models, 7B in /dev/shm): cap1k (0.5B and 1.5B at a 1,024 cap, the default), cap4k (4,096), cap8k
# (0.5B, 8,192), uniform (0.5B and 1.5B, every response 256 tokens: the controlled case, ours + TRL),
# 7b4k / 7b4k_trl (7B LoRA r64 at 4,096, ours / TRL + PEFT), demo (SmolLM2-135M-Instruct on sums, natural
# lengths, cap 2,048, lr 2e-5, ours + TRL; its GGUF joined on the machine as ../shared/PLATFORM.md says, its
# path in DEMO_GGUF, the gguf wheel in .whl/). Needs .bench_assets/, trl + datasets + dill + multiprocess + peft
# in .whl/ and vLLM (the .dv* calls first, as the e2e section's TRL-vLLM runs). ----
# RAGGED_SWEEP="default,rollout.partial_step_tokens=256+algorithm.rollout_correction=true": ours once per item;
# RAGGED_SHAPES=1.5b: cap1k / cap4k at some shapes; RAGGED_STEPS: cap1k's steps; RAGGED_NAME=_trl: results/e2e_ragged_<row>_trl_cuda.json
if want ragged; then
  common=(--device cuda --gpus 1 --no-profile --impls "${RAGGED_IMPLS:-ours,trl_vllm}" --trl-steps vllm:4 --skip 1)
  for row in ${RAGGED_ROWS:-cap1k}; do
    case $row in
      cap1k) args=(--lengths ragged --shapes "${RAGGED_SHAPES:-0.5b,1.5b}" --tokens 1024 --steps "${RAGGED_STEPS:-7}" --models /tmp/vf_models) ;;
      cap4k) args=(--lengths ragged --shapes "${RAGGED_SHAPES:-0.5b,1.5b}" --tokens 4096 --steps 5 --models /tmp/vf_models) ;;
      cap8k) args=(--lengths ragged --shapes 0.5b --tokens 8192 --steps 4 --models /tmp/vf_models) ;;
      uniform) args=(--shapes 0.5b,1.5b --tokens 256 --steps 7 --models /tmp/vf_models) ;;
      7b4k) args=(--lengths ragged --shapes 7b --lora 64 --tokens 4096 --steps 4 --impls ours --models /dev/shm/vf_models) ;;
      7b4k_trl) args=(--lengths ragged --shapes 7b --lora 64 --tokens 4096 --impls trl_vllm --trl-steps vllm:3
                      --models /dev/shm/vf_models) ;;
      demo) args=(--shapes demo --tokens 2048 --steps 10 --trl-steps vllm:10 --skip 2 --lr 2e-5 --demo-gguf "${DEMO_GGUF:-}"
                  --models /tmp/vf_models) ;;
      *) echo "RAGGED_ROWS: unknown row $row (cap1k, cap4k, cap8k, uniform, 7b4k, 7b4k_trl, demo)"; failed+=("ragged $row"); continue ;;
    esac
    timeout ${RAGGED_TIMEOUT:-570} "$py" benchmarks/bench_e2e.py "${common[@]}" "${args[@]}" --timeout "${RAGGED_RUN_TIMEOUT:-280}" \
      ${RAGGED_SWEEP:+--sweep "$RAGGED_SWEEP"} \
      --name "e2e_ragged_$row${RAGGED_NAME:-}" >> "$OUT/bench.log" 2>&1 || failed+=("ragged $row")
    sed -n '/^responses at ragged/,/^step s:/p' "$OUT/bench.log" | tail -n 6
  done
fi

# ---- defaults (issue 42): the trainer's defaults, no precision / engine / budget / compile key set, at the 0.5B
# and 1.5B shapes (DEFAULTS_IMPLS=ours,trl_vllm adds TRL beside them); the 8-bit optimizer states against fp32
# AdamW over 50 steps (0.5B). About 4 minutes. ----
if want defaults; then
  timeout ${DEFAULTS_TIMEOUT:-420} "$py" benchmarks/bench_e2e.py --device cuda --shapes "${DEFAULTS_SHAPES:-0.5b,1.5b}" \
    --impls "${DEFAULTS_IMPLS:-ours}" --gpus 1 --steps 8 --no-profile --timeout 200 --models /tmp/vf_models \
    --name e2e_defaults >> "$OUT/bench.log" 2>&1 || failed+=("defaults")
  sed -n '/^e2e GRPO step/,$p' "$OUT/bench.log" | tail -n 6
  if [ "${DEFAULTS_OPTSTATES:-1}" = 1 ]; then  # DEFAULTS_OPTSTATES=0 leaves the optimizer-states comparison out
    timeout 200 "$py" benchmarks/bench_optimizer_states.py --device cuda >> "$OUT/bench.log" 2>&1 || failed+=("optimizer_states")
    tail -n 5 "$OUT/bench.log"
  fi
fi

# ---- 7b (issue 42): the Qwen2.5-7B shape on one GPU (the model built once into /tmp/vf_models, kept for later
# calls): SEVEN_B=ours runs ours, the rows SEVEN_B_ROWS names (default "lora full"): lora (r64, defaults),
# lora_cb (the same with actor.compile_blocks=true, off by default for a LoRA actor: does compiling its norms
# and MLPs, adapters included, pay?), lora76 (the process kept to 76 GiB, an 80 GB card's memory:
# set_per_process_memory_fraction), lora_peft (LoRA layers through peft's own forward in the passes, against the
# default GEMMs-only layers of models/lora_linear.py),
# full (actor.optimizer=adamw_8bit, 10 steps: a checkpoint at step 5 and a resumed trainer for the rest); SEVEN_B=trl runs
# TRL 1.16 + PEFT + vLLM colocate on the same LoRA work, then TRL's full fine-tune (its out-of-memory stop
# recorded; SEVEN_B_TRL_ROWS=lora runs the first only); SEVEN_B_PROFILE=1 profiles one more rollout and update of each row (their top kernels); SEVEN_B_STEPS the LoRA rows' steps (7). lora
# ~4.5 min, full ~8 (two trainers, a ~40 GB checkpoint between them: saved in ~115 s, resumed in ~90 s, the
# resumed trainer compiling again): one row a 10-minute call. ----
if want 7b; then
  # the model folder in host memory: the disk (64 GB) holds the full fine-tune's checkpoint
  common=(--device cuda --shapes 7b --gpus 1 --timeout 330 --models /dev/shm/vf_models)
  [ "${SEVEN_B_PROFILE:-0}" = 1 ] || common+=(--no-profile)  # 1: one more rollout and update, profiled (top kernels)
  if [ "${SEVEN_B:-ours}" = ours ]; then
    for row in ${SEVEN_B_ROWS:-lora full}; do
      case $row in
        lora) timeout 280 "$py" benchmarks/bench_e2e.py "${common[@]}" --impls ours --lora 64 --steps "${SEVEN_B_STEPS:-7}" \
                --name e2e_7b_lora_ours >> "$OUT/bench.log" 2>&1 || failed+=("7b lora ours") ;;
        # its first steps compile the decode and the blocks: a 210 s call ended before the first steady step
        lora_cb) timeout 420 "$py" benchmarks/bench_e2e.py "${common[@]}" --impls ours --lora 64 --steps "${SEVEN_B_STEPS:-7}" \
                   --timeout 400 --set actor.compile_blocks=true --name e2e_7b_lora_ours_cb >> "$OUT/bench.log" 2>&1 ||
                   failed+=("7b lora ours compile_blocks") ;;
        lora76) timeout 280 "$py" benchmarks/bench_e2e.py "${common[@]}" --impls ours --lora 64 --steps "${SEVEN_B_STEPS:-7}" \
                  --memory-gib 76 --name e2e_7b_lora_ours_76gib >> "$OUT/bench.log" 2>&1 || failed+=("7b lora ours 76 GiB") ;;
        lora_peft) timeout 280 "$py" benchmarks/bench_e2e.py "${common[@]}" --impls ours --lora 64 --steps "${SEVEN_B_STEPS:-7}" \
                     --lora-peft --name e2e_7b_lora_ours_peft >> "$OUT/bench.log" 2>&1 || failed+=("7b lora ours peft") ;;
        full) timeout 550 "$py" benchmarks/bench_e2e.py "${common[@]}" --impls ours --set actor.optimizer=adamw_8bit \
                --steps 10 --resume-at 5 --timeout 530 --name e2e_7b_full_ours >> "$OUT/bench.log" 2>&1 || failed+=("7b full ours") ;;
        *) echo "SEVEN_B_ROWS: unknown row $row (lora, lora_cb, lora76, lora_peft, full)"; failed+=("7b row $row") ;;
      esac
    done
  else
    for row in ${SEVEN_B_TRL_ROWS:-lora full}; do
      case $row in
        lora) timeout 330 "$py" benchmarks/bench_e2e.py "${common[@]}" --impls trl_vllm --lora 64 --trl-steps vllm:4 \
                --skip 1 --name e2e_7b_lora_trl >> "$OUT/bench.log" 2>&1 || failed+=("7b lora trl") ;;
        full) timeout 200 "$py" benchmarks/bench_e2e.py "${common[@]}" --impls trl_vllm --trl-steps vllm:3 --skip 1 \
                --name e2e_7b_full_trl >> "$OUT/bench.log" 2>&1 || failed+=("7b full trl") ;;
        *) echo "SEVEN_B_TRL_ROWS: unknown row $row (lora, full)"; failed+=("7b trl row $row") ;;
      esac
    done
  fi
  grep -E "^7b|ours: checkpoint|out of memory" "$OUT/bench.log" | tail -n 8
fi

# ---- sft (issue 49): our SFT step vs TRL's SFTTrainer (packing, padding_free, bf16) on the same rows, 1 GPU,
# Qwen2 0.5B / 1.5B shapes and the 7B shape with LoRA r 64; random weights built in each run's process;
# needs trl, datasets, dill, multiprocess, peft (.whl/) and .bench_assets/ (about 5 minutes); SFT_NAME names the
# report (default sft: SFT_SHAPES=7b-lora SFT_NAME=sft_7b_lora leaves the 0.5B / 1.5B report in place) ----
if want sft; then
  timeout ${SFT_TIMEOUT:-330} "$py" benchmarks/bench_sft.py --device cuda --shapes "${SFT_SHAPES:-0.5b,1.5b,7b-lora}" \
    --impls "${SFT_IMPLS:-ours,trl}" --rows "${SFT_ROWS:-32}" --steps "${SFT_STEPS:-5}" --timeout "${SFT_RUN_TIMEOUT:-120}" --name "${SFT_NAME:-sft}" \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_sft")
  sed -n '/^sft on/,$p' "$OUT/bench.log" | tail -n 14
fi

# ---- long_caps (issue 66): the update at long sequences, measured peak memory beside the memory plan's estimate
# (strategies/memory_plan.estimate; docs/memory.md), trained tokens/s and MFU: prime-rl's single-H100 rows first
# (Qwen3-4B shape, LoRA r16, one 65,536-token sequence; Qwen3-0.6B shape full fine-tune, two 16,384-token
# sequences, with the defaults and memory-matched; their published figures beside ours), then the 1.5B shape full
# fine-tune at a 16k cap and the 7B shape with LoRA r 64 at an 8k cap (both must peak <= 75 GiB on an 80 GB H100).
# Each row its own process, two steps (~6 minutes in all, cut at 7; results/long_caps_cuda.json, saved after every row);
# each row's plan is taken at the micro-batch it ran, beside its measured peak.
# LONG_CAPS_ROWS=qwen3_4b_lora_64k,qwen3_0.6b_16k for some rows (two calls if one does not hold them all) ----
if want long_caps; then
  timeout ${LONG_CAPS_TIMEOUT:-420} "$py" benchmarks/bench_long_caps.py --device cuda \
    ${LONG_CAPS_ROWS:+--rows-set "$LONG_CAPS_ROWS"} >> "$OUT/bench.log" 2>&1 || failed+=("bench_long_caps")
  grep -E "^(qwen3_|1.5b_16k|7b_lora_8k)" "$OUT/bench.log" | tail -n 5
fi

# ---- vlm (issue 70): vision-language GRPO (16 prompts x 8 samples, one 448 x 448 picture each, up to 256 new tokens)
# and SFT (32 rows of a picture and a 128-word answer) on a Qwen2.5-VL-3B-shaped random-weight model, ours vs TRL's
# GRPOTrainer (vLLM colocate) / SFTTrainer; results/vlm_cuda.json. TRL needs trl, datasets, dill, multiprocess (.whl/),
# vLLM (the .dv* pieces) and torchvision (transformers' Qwen2.5-VL processor); ours needs none of them. Each run is
# its own process (VLM_RUN_TIMEOUT s); VLM_ALGOS=grpo / sft splits it over two calls if one does not fit.
# First the vLLM engine with images (issue 70b; vLLM + torchvision, ~1-2 min; VLM_VLLM_TEST= skips it):
# greedy / log-probs against HF with the same images, the weight sync. VLM_IMPLS=ours,ours_vllm,trl adds
# our GRPO step with rollout.type=vllm; VLM_PROFILE=1 adds one step to ours, its update profiled (top kernels and
# operators); VLM_NAME names the result file (two calls: two names). VLM_SET="rollout.hf_compile_decode=false ..."
# overrides our config (bench_vlm --set each); ours logs its setup, every phase as it ends and each step's phase times, HF
# prefill / decode seconds, CUDA-graph captures and torch.compile graphs (printed below from bench.log) ----
if want vlm; then
  if [ -n "${VLM_VLLM_TEST-python_tests/rollout/test_vllm_vlm_gpu.py}" ]; then
    timeout ${VLM_VLLM_TEST_TIMEOUT:-300} "$py" -m pytest -v -p no:cacheprovider -rs \
      ${VLM_VLLM_TEST-python_tests/rollout/test_vllm_vlm_gpu.py} > "$OUT/pytest_vlm_vllm.log" 2>&1 || failed+=("pytest vlm vllm")
    grep -E "(PASSED|FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped)" "$OUT/pytest_vlm_vllm.log" | tail -n 8
  fi
  timeout ${VLM_TIMEOUT:-580} "$py" benchmarks/bench_vlm.py --device cuda --algos "${VLM_ALGOS:-grpo,sft}" \
    --impls "${VLM_IMPLS:-ours,trl}" --steps "${VLM_STEPS:-3}" --timeout "${VLM_RUN_TIMEOUT:-200}" ${VLM_NAME:+--name "$VLM_NAME"} --profile "${VLM_PROFILE:-0}" \
    $(for pair in ${VLM_SET:-}; do printf -- '--set=%s ' "$pair"; done) >> "$OUT/bench.log" 2>&1 || failed+=("bench_vlm")
  grep -E "^(ours|  [a-z_]+: [0-9.]+ s|  (kernel|op) |grpo|sft)" "$OUT/bench.log" | cut -c1-600 | tail -n 80
  sed -n '/^vlm on/,$p' "$OUT/bench.log" | tail -n 8
fi

# ---- vlm_decode (issue 70): the HF engine's compiled, graph-captured decode serving tiny Qwen2-VL / Qwen2.5-VL
# with 0-2 images a row against generate with the same images (fp32 exactly, bf16 autocast within a bf16 margin),
# the sampled tokens' chi-square, the fused rotary + cache write on M-RoPE tables (~2 minutes; also in `tests`) ----
if want vlm_decode; then
  timeout ${VLM_DECODE_TIMEOUT:-400} "$py" -m pytest -m gpu -v -p no:cacheprovider --durations=5 \
    python_tests/rollout/test_vlm_decode.py > "$OUT/pytest_vlm_decode.log" 2>&1 || failed+=("pytest vlm_decode")
  grep -E "^(FAILED|ERROR)| (FAILED|ERROR) |[0-9]+ passed|failed" "$OUT/pytest_vlm_decode.log" | tail -n 12
fi

# ---- decode (issues 24, 42, 66): the rollout's compiled, graph-captured decode alone, 16 prompts x 8 samples:
# the trainer's default (kernel_attention) at 256 new tokens, then ragged lengths (geometric, mean 150, cap
# 1,024) with finished rows compacted out of the batch (ragged) and without (ragged_whole), each call's
# steps, tokens/s, time a step against the floor's and top kernels; 0.5B and 1.5B (~6 minutes).
# DECODE_SHAPES=7b for the 7B class's decode; DECODE_VARIANTS=merged,prefill_each,unmerged,... the older ones ----
if want decode; then
  timeout ${DECODE_TIMEOUT:-470} "$py" benchmarks/bench_decode.py --shapes "${DECODE_SHAPES:-0.5b,1.5b}" \
    --variants "${DECODE_VARIANTS:-kernel_attention,ragged,ragged_whole}" --reps "${DECODE_REPS:-3}" \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_decode")
  grep -E "^(0.5b|1.5b|7b) " "$OUT/bench.log" | grep -v "top kernels" | tail -n 12
fi

# ---- decode_fused (issue 66): the decode step's fused Triton kernels (rollout.hf_fused_kernels) A/B in one call:
# their GPU tests, then bench_decode's unfused (kernel_attention, ragged_whole) and fused (fused, ragged_fused)
# variants, 128 rows, uniform 256 and ragged cap 1,024, kernels per step counted by the profiler; JSON under
# $OUT/results. ~8-9 minutes for both shapes; DECODE_FUSED_SHAPES=0.5b (then =1.5b) splits it over two calls ----
if want decode_fused; then
  timeout 180 "$py" -m pytest python_tests/ops/test_decode_sampling.py python_tests/ops/test_rope_cache.py \
    python_tests/rollout/test_decode_fused.py -q -x -p no:cacheprovider > "$OUT/decode_fused_tests.log" 2>&1 ||
    failed+=("decode_fused tests")
  tail -n 3 "$OUT/decode_fused_tests.log"
  timeout ${DECODE_FUSED_TIMEOUT:-400} "$py" benchmarks/bench_decode.py --shapes "${DECODE_FUSED_SHAPES:-0.5b,1.5b}" \
    --variants kernel_attention,fused,ragged_whole,ragged_fused --reps "${DECODE_REPS:-3}" \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_decode fused")
  grep -E "^(0.5b|1.5b) " "$OUT/bench.log" | grep -v "top kernels\|batch rows" | tail -n 8
fi

# ---- ncu (diagnostic): Nsight Compute's full set on compute_gae's scan kernel at 1024 x 4096 (what bounds it:
# occupancy, stalls, memory throughput), where the image has ncu and lets it read the counters ----
if want ncu; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  if [ -n "$ncu" ]; then
    timeout 300 "$ncu" --kernel-name regex:scan_kernel --launch-skip 3 --launch-count 1 --set full "$py" -c "
import torch, verl_fast as vf
g = torch.Generator(device='cuda').manual_seed(0)
r, v = (torch.randn(1024, 4096, device='cuda', generator=g) for _ in range(2))
m = torch.ones(1024, 4096, dtype=torch.bool, device='cuda')
for _ in range(5): vf.compute_gae(r, v, m, 0.99, 0.95)
torch.cuda.synchronize()" > "$OUT/ncu_gae.txt" 2>&1 || failed+=("ncu gae")
    grep -iE "duration|throughput|occupancy|registers|stall|warp cycles|eligible|issued" "$OUT/ncu_gae.txt" | head -n 40
  else
    echo "ncu: not on this machine"
  fi
fi

# ---- merge (issue 42): the LoRA merge before each rollout of the compiled decode, 7B shape r 64: ours against
# the float32-temporaries merge it replaced and peft's merge + unmerge (~1 minute) ----
if want merge; then
  timeout 180 "$py" benchmarks/bench_lora_merge.py --device cuda >> "$OUT/bench.log" 2>&1 || failed+=("bench_lora_merge")
  grep -E "^LoRA merge" "$OUT/bench.log" | tail -n 4
fi

# ---- overlap (issue 24): the reward scored beside the old-log-prob pass against before it, a reward that waits
# and one that computes in Python, 0.5B (~4 minutes: five runs, each compiling its decode) ----
if want overlap; then
  timeout ${OVERLAP_TIMEOUT:-400} "$py" benchmarks/bench_reward_overlap.py --device cuda --shape 0.5b --prompts 16 \
    --samples 8 --tokens 64 --reward-ms 300 >> "$OUT/bench.log" 2>&1 || failed+=("bench_reward_overlap")
  grep -E "^0.5b reward" "$OUT/bench.log" | tail -n 4
fi

# ---- multi_turn (issues 46, 68): multi-turn rollout (4 turns, a scripted environment) against single-turn at the
# same model-token count, HF decode engine, 0.5B random weights, 16 x 8 x 256 tokens, each trajectory's KV cache
# continued across turns (the later turns replaying the first turn's decoder and graph), beside it a new decoder
# and graph per turn, and re-prefilled every turn (kv_continuation false); prefill tokens, tokens saved and each
# generate call's launch (entry to the prefill's launch) / prefill / decode / return seconds, graph captures and the
# host seconds between calls in the JSON's meta
# (and printed); first the gpu-marked continuation tests (graph decode, one capture a lockstep rollout, eager and
# compiled) (~3-4 minutes: compiles);
# then TRL 1.16's tool-calling GRPO rollout (GRPOTrainer tools=[calculator]) on the same model and lengths, in its
# own process: vLLM colocate where vLLM imports (carry .dvdeps2 after the .dv* calls, or an earlier call left
# /tmp/site), else HF generate; needs trl, datasets, dill, multiprocess (.whl/) and .bench_assets/ (~1.5-2.5
# minutes: TRL's engine start). MULTI_TURN_IMPLS=ours leaves TRL out ----
if want multi_turn; then
  timeout 240 "$py" -m pytest -m gpu -q -p no:cacheprovider python_tests/rollout/test_kv_turns.py \
    > "$OUT/pytest_kv_turns.log" 2>&1 || failed+=("pytest kv_turns")
  tail -n 3 "$OUT/pytest_kv_turns.log"
  timeout ${MULTI_TURN_TIMEOUT:-500} "$py" benchmarks/bench_multi_turn.py --device cuda --shape 0.5b \
    --turns "${MULTI_TURN_TURNS:-4}" --impls "${MULTI_TURN_IMPLS:-ours,trl}" --trl-rollout "${MULTI_TURN_TRL:-auto}" \
    --trl-timeout "${MULTI_TURN_TRL_TIMEOUT:-270}" >> "$OUT/bench.log" 2>&1 || failed+=("bench_multi_turn")
  grep -E "^0.5b multi-turn|^TRL " "$OUT/bench.log" | tail -n 3
  grep -E "^multi-turn|^  call |^single-turn:" "$OUT/bench.log" | tail -n 19
  sed -n '/^multi_turn on/,/^saved/p' "$OUT/bench.log" | tail -n 10
fi

# ---- fp8 (issue 69): FP8 rollout at the Qwen2.5-7B shape, one GPU (benchmarks/bench_fp8.py): the sync's work
# (bf16 reshard vs the FP8 kernel into fused rows, its parts and copies for scale), the FP8
# products at M = 128 per activation scaling vs the bf16 matmul, the HF decode bf16 vs FP8 (both activation
# scalings) tokens/s, vLLM bf16 vs block-FP8 tokens/s and sync (where vLLM is installed); then the FP8 gpu tests
# (the kernel vs CPU byte for byte, _scaled_mm vs float64, the vLLM block-FP8 engine); then the guardrails'
# cost at 0.5B (benchmarks/bench_guardrails.py: training steps with the guardrails on vs off, two pairs;
# FP8_GUARDRAILS=0 skips it, ~4 min). FP8_PARTS picks parts (default sync,linear,hf,vllm); the candidates side by
# side in one call: FP8_GUARDRAILS=0 FP8_PARTS=sync,linear,hf SECTIONS=fp8 (~7 min with the build); FP8_PARTS= runs no
# bench_fp8, FP8_TESTS=0 no tests; GUARDRAILS_STEPS / GUARDRAILS_PAIRS / GUARDRAILS_TIMEOUT size the cost runs ----
if want fp8; then
  if [ -n "${FP8_PARTS-sync,linear,hf,vllm}" ]; then
    timeout 420 "$py" benchmarks/bench_fp8.py --parts "${FP8_PARTS-sync,linear,hf,vllm}" >> "$OUT/bench.log" 2>&1 ||
      failed+=("bench_fp8")
    sed -n '/^fp8_rollout on/,$p' "$OUT/bench.log" | tail -n 45
  fi
  if [ "${FP8_GUARDRAILS:-1}" = 1 ]; then
    timeout ${GUARDRAILS_TIMEOUT:-360} "$py" benchmarks/bench_guardrails.py --shape 0.5b --steps ${GUARDRAILS_STEPS:-5} \
      --pairs ${GUARDRAILS_PAIRS:-2} >> "$OUT/bench.log" 2>&1 || failed+=("bench_guardrails")
    grep -A4 "^guardrails_cost" "$OUT/bench.log" | tail -n 5
  fi
  if [ "${FP8_TESTS:-1}" = 1 ]; then
    timeout 180 "$py" -m pytest -m gpu -q -p no:cacheprovider python_tests/ops/test_fp8_quantize.py \
      python_tests/rollout/test_fp8_rollout.py > "$OUT/pytest_fp8.log" 2>&1 || failed+=("pytest fp8")
    tail -n 3 "$OUT/pytest_fp8.log"
  fi
fi

# ---- agent_endpoint (issue 68): an agent program (urllib, 4 chat calls each) driving the rollout through the
# OpenAI-compatible endpoint against the built-in multi-turn rollout, the same turns and tokens, 16 x 8 = 128
# trajectories in flight, HF decode engine, 0.5B random weights, 256 model tokens; the endpoint with each
# call's KV cache continued and re-prefilled, the prefill tokens saved (~3-4 minutes); needs .bench_assets/ ----
if want agent_endpoint; then
  timeout ${AGENT_ENDPOINT_TIMEOUT:-500} "$py" benchmarks/bench_agent_endpoint.py --device cuda --shape 0.5b \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_agent_endpoint")
  sed -n '/^agent_endpoint on/,/^saved/p' "$OUT/bench.log" | tail -n 7
fi

# ---- bench (issue 17): `verl-fast bench` itself on the GPU (CUDA events, peak memory, the one table,
# JSON / Markdown / PNG under $OUT/bench); quick sizes, so it checks the harness, not the ops ----
if want bench; then
  timeout 400 "$py" -m verl_fast bench --device cuda --quick --ops gae,logprob,schedule --out "$OUT/bench" \
    >> "$OUT/bench.log" 2>&1 || failed+=("verl-fast bench")
  tail -n 30 "$OUT/bench.log"
fi

# ---- megatron (issue 14): GRPO update phase, Qwen2 1.5B shape, 2 GPUs: megatron-core TP=2 vs FSDP2;
# time, MFU, peak memory per GPU, then one profiled update each (~4 minutes); first the gpu tests of the
# SDPA core attention (flash kernel) and the sync-free gradient norm; last the Megatron GPU tests on 2
# GPUs (NCCL): actor TP=2, critic TP=2, Qwen3-MoE EP=2, each against HF on one GPU (~2 minutes) ----
if want megatron; then
  "$py" -m pytest -m gpu -q -p no:cacheprovider python_tests/megatron/test_megatron_attention.py python_tests/megatron/test_megatron_grad_norm.py \
    > "$OUT/pytest_megatron_fast.log" 2>&1 || failed+=("pytest megatron_fast")
  tail -n 3 "$OUT/pytest_megatron_fast.log"
  timeout 420 "$py" -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_megatron.py --profile \
    >> "$OUT/bench.log" 2>&1 || failed+=("bench_megatron")
  timeout 400 "$py" -m pytest -m gpu -q -p no:cacheprovider python_tests/megatron/test_megatron_trainer.py \
    > "$OUT/pytest_megatron.log" 2>&1 || failed+=("pytest megatron")
  tail -n 15 "$OUT/pytest_megatron.log"
  # verl's run_qwen2-7b_math_megatron.sh (--config-name=ppo_megatron_trainer.yaml) one step on a tiny model (issue 67)
  timeout 300 "$py" -m pytest -q -p no:cacheprovider python_tests/config/test_verl_recipes.py -k megatron \
    > "$OUT/pytest_verl_megatron_example.log" 2>&1 || failed+=("pytest verl megatron example")
  tail -n 3 "$OUT/pytest_verl_megatron_example.log"
fi

(cd "$OUT" && [ -d results ] && tar czf results.tgz results && rm -rf results)
echo "==================== summary ===================="
grep -E "passed|failed|error" "$OUT/pytest_gpu.log" 2>/dev/null | tail -n 3
cat "$VF_BENCH_SUMMARY"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"; tail -n 40 "$OUT/bench.log"; exit 1
fi
