"""vLLM in the trainer against vLLM alone (issue 48): the same engine, prompts and sampling, one process.

Per engine variant, one worker process builds ``VLLMInferenceEngine`` as the trainer's factory does
(bf16, ``cudagraph_batch`` = the batch, a KV cache sized for the step, sleep level 0, in-process) and
times, alternating, medians of ``--reps``:
- ``alone``: ``llm.generate`` on the engine's own ``vllm.LLM`` with the very ``SamplingParams`` our
  wrapper builds (no per-step detokenisation), and with vLLM's default ``detokenize=True``;
- ``ours``: ``engine.generate`` (request building, output collection, the responses decoded in one
  batch), and the same between ``wake_up()`` / ``sleep()`` as the trainer's step runs it.
Random weights never emit EOS, so every response runs to ``--tokens``; the floor is the bf16 weights
read once per decode step at the card's HBM bandwidth (H200 4.8 TB/s, H100 3.35).

Engine start: the first variant's worker runs twice, the second start finding the first's caches
(torch.compile, Inductor, Triton, CUDA graphs' compile artefacts: ``VLLM_CACHE_ROOT``,
``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR`` pointed at ``--cache-dir``, kept across runs).

Variants (``--variants``; each a fresh engine, ~1 min cold on the H200): ``default``, ``async``
(``async_scheduling=True``), ``seqs256`` (``max_num_seqs=256``), ``graphs_all`` (vLLM's own capture
sizes up to 512), ``no_prefix_cache``, ``logprobs`` (the sampled tokens' log-probs asked for, as the
rollout correction does). ``--import-profile`` starts the first variant once more with Python's import
timer on and keeps the heaviest modules. Skips cleanly (exit 0, a note in the JSON) where vLLM does not import.

    python benchmarks/bench_vllm_alone.py [--device cuda|cpu] [--shape 0.5b] [--variants default,async]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, hbm_bytes_per_s  # noqa: E402

VARIANTS: Dict[str, Dict[str, Any]] = {
    "default": {},
    "async": {"engine": {"async_scheduling": True}},
    "seqs256": {"engine": {"max_num_seqs": 256}},
    "graphs_all": {"engine": {"cudagraph_batch": None}},
    "no_prefix_cache": {"engine": {"enable_prefix_caching": False}},
    "logprobs": {"logprobs": True},
}


def cache_env(cache_dir: Path) -> Dict[str, str]:
    """The compile caches of vLLM, Inductor and Triton under ``cache_dir`` (kept across runs)."""
    return {"VLLM_CACHE_ROOT": str(cache_dir / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
            "TRITON_CACHE_DIR": str(cache_dir / "triton")}


def model_folder(args, workdir: Path) -> Path:
    if args.device == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests" / "support"))
        from tiny_models import save_tiny_model

        return save_tiny_model(workdir / "tiny", family="qwen2", num_layers=2, hidden_size=64, num_heads=2,
                               num_kv_heads=1, intermediate_size=128, vocab_size=512)
    from bench_e2e import build_model

    return build_model(args.shape, workdir / args.shape, "cuda")


# ---------------------------------------------------------------- worker (one engine)


def prompts_of(tokenizer, count: int) -> List[List[int]]:
    from bench_e2e import chat_prompts

    out = []
    for messages in chat_prompts(count):
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except ValueError:  # a tokenizer without a chat template (the CPU check's tiny one)
            ids = tokenizer(messages[-1]["content"])["input_ids"]
        out.append([int(t) for t in ids])
    return out


def timed(fn, reps: int) -> List[float]:
    import torch

    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def worker(args) -> Dict[str, Any]:
    from verl_fast.records.generation import SamplingSpec
    from verl_fast.rollout.vllm_engine import VLLMInferenceEngine

    variant = VARIANTS[args.worker]
    seqs = args.prompts * args.n
    kw = dict(dtype="bfloat16" if args.device == "cuda" else "float32", max_num_seqs=max(seqs, 1),
              cudagraph_batch=seqs, sleep_level=0, max_model_len=1024 if args.device == "cuda" else 256)
    if args.device == "cuda":
        kw.update(gpu_memory_utilization=0.5, kv_cache_memory_bytes=2 << 30)
    kw.update(variant.get("engine", {}))
    start = time.perf_counter()
    engine = VLLMInferenceEngine(str(args.model), **kw)  # vLLM imported by it, as in the trainer
    init_s = time.perf_counter() - start
    prompts = prompts_of(engine._tokenizer, args.prompts)
    specs = [SamplingSpec(n=args.n, temperature=1.0, max_tokens=args.tokens, seed=1000 + i,
                          logprobs=variant.get("logprobs", False)) for i in range(len(prompts))]
    params = [engine._to_vllm_params(s)[0] for s in specs]
    vllm_prompts = [{"prompt_token_ids": p} for p in prompts]
    detok = [p.clone() for p in params]
    for p in detok:
        p.detokenize = True

    def alone(ps=params):
        out = engine.llm.generate(vllm_prompts, ps, use_tqdm=False)
        return sum(len(c.token_ids) for o in out for c in o.outputs)

    def ours():
        return int(engine.generate(prompts, specs).response_mask.sum())

    def ours_step():
        engine.wake_up()
        try:
            return ours()
        finally:
            engine.sleep()

    runs = {"vLLM alone (our SamplingParams)": alone, "vLLM alone, detokenize=True": lambda: alone(detok),
            "ours: engine.generate": ours, "ours: wake + generate + sleep": ours_step}
    tokens, times = {}, {name: [] for name in runs}
    for rep in range(args.reps + 1):  # alternated, so drift hits every row alike; the first is warm-up
        for name, fn in runs.items():
            if rep == 0:
                tokens[name] = fn()  # first-call compiles; the token counts
            else:
                times[name] += timed(fn, 1)
            engine.wake_up()  # untimed: the step row leaves the engine asleep (its KV cache unmapped)
    engine.close()
    return {"variant": args.worker, "init_s": init_s, "import_s": engine.import_seconds, "llm_init_s": engine.init_seconds,
            "tokens": tokens,
            "median_s": {k: statistics.median(v) for k, v in times.items()}, "times_s": times}


# ---------------------------------------------------------------- parent


def run_worker(args, variant: str, out: Path, profile_imports: bool = False) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", variant, "--model", str(args.model), "--device", args.device,
           "--prompts", str(args.prompts), "--n", str(args.n), "--tokens", str(args.tokens), "--reps", str(args.reps),
           "--json", str(out)]
    env = {**os.environ, **cache_env(args.cache_dir), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if profile_imports:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    if args.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, timeout=args.worker_timeout, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"variant": variant, "error": f"worker exited {proc.returncode}", "log_tail": tail}
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - t0
    # where the engine start goes, as vLLM logs it (its first 60 INFO lines, each with its time stamp:
    # configuration, weights loaded, torch.compile, graph capture, KV cache, and the gaps between them)
    result["start_log"] = [line[-240:] for line in (proc.stdout + proc.stderr).splitlines() if "INFO" in line][:60]
    if profile_imports:
        result["imports"] = import_profile(proc.stderr)
    return result


def import_profile(stderr: str, top: int = 25) -> Dict[str, List[List[Any]]]:
    """Python's ``-X importtime`` lines (``import time: self | cumulative | name``, microseconds) as the
    ``top`` heaviest modules by their own time and the top-level imports by cumulative time, in seconds."""
    rows = []
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            own, cumulative, name = line[len("import time:"):].split("|", 2)
            if own.strip().isdigit():
                rows.append((int(own) / 1e6, int(cumulative) / 1e6, name.rstrip()))
    return {"self": [[n.strip(), o] for o, _, n in sorted(rows, key=lambda r: -r[0])[:top]],
            "top_level": [[n.strip(), c] for _, c, n in sorted(rows, key=lambda r: -r[1]) if not n.startswith("  ")][:top]}


def weight_bytes(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                t = s.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 2  # served in bf16
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--variants", default="default")
    p.add_argument("--prompts", type=int, default=None, help="default 16 (cuda), 4 (cpu)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt; default 8 (cuda), 2 (cpu)")
    p.add_argument("--tokens", type=int, default=None, help="new tokens; default 256 (cuda), 8 (cpu)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "vf_vllm_cache")
    p.add_argument("--worker-timeout", type=float, default=300.0)
    p.add_argument("--import-profile", action="store_true",
                   help="one more start of the first variant under PYTHONPROFILEIMPORTTIME: where `import vllm` goes")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.prompts = args.prompts or (4 if cpu else 16)
    args.n = args.n or (2 if cpu else 8)
    args.tokens = args.tokens or (8 if cpu else 256)
    if args.worker:
        args.json.write_text(json.dumps(worker(args)))
        return 0
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {','.join(VARIANTS)}")
    report = Report("vllm_alone", args.device)
    if importlib.util.find_spec("vllm") is None:
        report.meta["skipped"] = "vLLM is not importable here"
        print("bench_vllm_alone: skipped (vLLM is not importable)")
        report.save(summary=False)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        args.model = model_folder(args, tmp)
        report.meta.update(shape=args.shape, prompts=args.prompts, n=args.n, tokens=args.tokens,
                           cache_dir=str(args.cache_dir), weight_bytes_bf16=weight_bytes(args.model))
        # the floor is the GPU's (its HBM bandwidth); none on the CPU
        floor_s = args.tokens * report.meta["weight_bytes_bf16"] / hbm_bytes_per_s() if args.device == "cuda" else None
        results = []
        for i, variant in enumerate(variants):
            starts = 2 if i == 0 else 1  # the first variant again: a second start, the caches warm
            for k in range(starts):
                res = run_worker(args, variant, tmp / f"{variant}_{k}.json")
                res["start"] = "second" if k else "first"
                results.append(res)
                if "error" in res:
                    print(f"{variant}: {res['error']}\n{res['log_tail']}", flush=True)
                    continue
                case = f"{variant} ({res['start']} start)"
                if floor_s is not None:
                    report.floors[case] = floor_s * 1e3
                report.add("engine start", f"{variant}, {res['start']} start", res["init_s"] * 1e3,
                           note=f"the worker process: {res['process_s']:.1f} s")
                report.add("engine start", f"{variant}, {res['start']} start: import vllm", res["import_s"] * 1e3,
                           note="vllm and the modules vllm.LLM loads (lazily, at its first touch)")
                report.add("engine start", f"{variant}, {res['start']} start: vllm.LLM()", res["llm_init_s"] * 1e3)
                for name, s in res["median_s"].items():
                    report.add(case, name, s * 1e3, note=f"{res['tokens'][name]} tokens")
                # as each worker ends, so a run cut short by its time limit still shows the finished ones
                print(f"{case}: start {res['init_s']:.1f} s, " + ", ".join(
                    f"{name} {s * 1e3:.1f} ms" for name, s in res["median_s"].items()), flush=True)
        if args.import_profile:  # one more start of the first variant, its imports timed module by module
            res = run_worker(args, variants[0], tmp / "imports.json", profile_imports=True)
            imports = res.get("imports") or {}
            report.meta["import_profile"] = imports or res  # the worker's error where it failed
            for name, seconds in imports.get("top_level", [])[:12]:
                print(f"import (top level, cumulative): {name} {seconds:.2f} s", flush=True)
            for name, seconds in imports.get("self", [])[:12]:
                print(f"import (own time): {name} {seconds:.2f} s", flush=True)
        report.meta["workers"] = results
    path = report.save()
    print(report.table())
    print(f"saved {path}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
