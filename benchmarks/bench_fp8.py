"""FP8 rollout against bf16 at the Qwen2.5-7B shape, one GPU, one process (``rollout.quantization: fp8``):

- ``sync``: the weight sync's work on the GPU. bf16: the resharding plan HF -> vLLM's fused layout in bf16 (what
  the direct sync runs every step). FP8: every projection quantised by the FP8 kernel (128 x 128 blocks)
  straight into its rows of the fused FP8 destination and its scales, all of them in one ``quantize_many``
  call (a launch per 32 projections), the other tensors copied in bf16 (``torch._foreach_copy_``: what an FP8
  engine's parameters receive). Beside it, each part alone: the kernel with its TB/s, the call's host time
  (before the GPU waits), the
  other tensors' copy, and two copies for scale: the projections copied in bf16, and one flat copy (the
  device's copy rate). Median of ``--reps`` calls, CUDA-synchronised.
- ``linear``: the FP8 products alone at the decode's M = 128 for the 7B's four projection shapes (q/k/v
  stacked, o, gate/up stacked, down): the bf16 matmul against ``fp8_linear.product`` for each activation
  scaling (``fp8_linear.ACTIVATIONS``: per token / per tensor), with its input's quantisation (eager ops) and
  the ``_scaled_mm`` alone; CUDA-graph replays, microseconds a product and TB/s of weight bytes.
- ``hf``: the HF decode as the trainer runs it (compiled, graph-captured, bf16 autocast over float32 weights;
  ``bench_decode.run_variant`` "kernel_attention"), 16 prompts x 8 samples x ``--tokens`` new tokens: bf16
  against FP8 linear layers (``rollout/fp8_linear.py``: per-channel weights, each activation scaling,
  ``torch._scaled_mm``). Tokens per second of the median call (the first call compiles: reported apart).
- ``vllm`` (where vLLM is importable): a vLLM engine of dummy weights, bf16 against block-FP8 (the folder's
  config declaring ``fp8_sync.QUANTIZATION_CONFIG``, weights from one FP8 sync), the same prompts; tokens/s
  of the median ``generate`` and the FP8 sync's time through vLLM's reload path.

    python benchmarks/bench_fp8.py [--parts sync,linear,hf,vllm] [--tokens 256] [--reps 3]
    python benchmarks/bench_fp8.py --shape small --parts sync --device cpu   # a smoke test on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402
from bench_e2e import SHAPES  # noqa: E402

PROMPTS, SAMPLES = 16, 8


def build(shape: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=49152, max_position_embeddings=4096, **{"tie_word_embeddings": True, **SHAPES[shape]})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def median_s(fn: Callable[[], object], reps: int, device: str) -> float:
    times = []
    for _ in range(reps + 1):  # the first: warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def projections(sd, device: str):
    """The projections' FP8 jobs: (sources, outs, scales), each projection's rows of its fused FP8 destination
    (q, k, v -> qkv_proj; gate, up -> gate_up_proj) and of its scales; and the other tensors (bf16 copies)."""
    from verl_fast.ops.reshard import fp8
    from verl_fast.rollout import fp8_sync

    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    jobs, rest = [], []
    for name, x in sd.items():
        if not fp8_sync.quantized(name, x):
            rest.append((x, torch.empty(x.shape, dtype=torch.bfloat16, device=device)))
            continue
        module, part = name.split(".")[-2], name.rsplit(".", 2)[0]
        jobs.append((f"{part}.{fused.get(module, module)}", x))
    shapes: Dict[str, list] = {}
    for key, x in jobs:
        shapes.setdefault(key, [0, x.shape[1]])[0] += x.shape[0]
    dests = {key: (torch.empty(n, cols, dtype=fp8.FP8, device=device),
                   torch.empty(fp8.scale_shape((n, cols), fp8.BLOCK), dtype=torch.float32, device=device))
             for key, (n, cols) in shapes.items()}
    sources, outs, scales, at = [], [], [], {}
    for key, x in jobs:
        q, s = dests[key]
        r = at.get(key, 0)
        sources.append(x)
        outs.append(q[r:r + x.shape[0]])
        scales.append(s[r // 128:(r + x.shape[0]) // 128])
        at[key] = r + x.shape[0]
    return sources, outs, scales, rest


def host_s(fn: Callable[[], object], reps: int, device: str) -> float:
    """The median time of fn's call on the host (on a GPU: what it costs before anything waits for the GPU)."""
    times = []
    for _ in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times[1:])


def sync_part(model, shape: str, device: str, reps: int, report: Report) -> Dict[str, float]:
    from verl_fast.bench.record import copy_bandwidth_gbs
    from verl_fast.ops.reshard import ModelSpec, fp8, hf_layout, plan, vllm_layout

    spec = ModelSpec.from_hf_config(model.config, dtype=torch.bfloat16)
    sd = {k: v.detach() for k, v in model.named_parameters()}
    bf16 = plan(hf_layout(spec, dtype=torch.bfloat16), vllm_layout(spec, 1, {0: 0}, dtype=torch.bfloat16))
    out = bf16.allocate_destinations(torch.device(device))
    t_bf16 = median_s(lambda: bf16.execute(sd, out), reps, device)
    del out
    sources, outs, scales, rest = projections(sd, device)
    rest_src, rest_dst = [x for x, _ in rest], [y for _, y in rest]
    case = f"sync, {shape} HF -> engine layout"
    weights = sum(x.numel() for x in sd.values())
    report.add(case, "baseline: bf16 reshard", t_bf16 * 1e3,
               note=f"{weights * 2 / t_bf16 / 1e9:.0f} GB/s of bf16 written")
    # the kernel's bytes: every bf16 weight read once, FP8 bytes and scales written
    kernel_bytes = sum(x.numel() * 3 for x in sources) + sum(s.numel() * 4 for s in scales)
    rest_bytes = sum(x.numel() * 4 for x in rest_src)
    t_rest = median_s(lambda: torch._foreach_copy_(rest_dst, rest_src), reps, device)
    report.add(case, "part: the other tensors' bf16 copy", t_rest * 1e3, note=f"{rest_bytes / t_rest / 1e12:.2f} TB/s")
    result = {"bf16_s": t_bf16, "rest_s": t_rest, "kernel_bytes": kernel_bytes, "bf16_bytes_moved": weights * 4,
              "fp8_bytes_moved": kernel_bytes + rest_bytes}
    run = lambda: fp8.quantize_many(sources, outs, scales, fp8.BLOCK)  # noqa: E731
    t_kernel, t_host = median_s(run, reps, device), host_s(run, reps, device)

    def full():
        run()
        torch._foreach_copy_(rest_dst, rest_src)

    t_full = median_s(full, reps, device)
    result.update(fp8_s=t_full, kernel_s=t_kernel, host_s=t_host)
    report.add(case, "part: the FP8 kernel", t_kernel * 1e3,
               note=f"{kernel_bytes / t_kernel / 1e12:.2f} TB/s of {kernel_bytes / 1e9:.2f} GB; host {t_host * 1e3:.2f} ms")
    report.add(case, "verl_fast fp8", t_full * 1e3, note=f"{t_full / t_bf16:.2f}x the bf16 sync")
    # for scale: the projections copied in bf16 (4 bytes an element), and the device's flat copy rate
    scratch = torch.empty(max(x.numel() for x in sources), dtype=torch.bfloat16, device=device)
    t_copy = median_s(lambda: [scratch[:x.numel()].view(x.shape).copy_(x) for x in sources], reps, device)
    copy_bytes = sum(x.numel() * 4 for x in sources)
    result["projection_copy_s"], result["flat_copy_gbs"] = t_copy, copy_bandwidth_gbs(device)
    report.add(case, "part: projections' bf16 copy", t_copy * 1e3,
               note=f"{copy_bytes / t_copy / 1e12:.2f} TB/s; a flat copy: {result['flat_copy_gbs'] / 1e3:.2f} TB/s")
    return result


LINEAR_M = 128  # the decode's rows: 16 prompts x 8 samples


def linear_shapes(shape: str) -> Dict[str, tuple]:
    """(N, K) of the four products of a decoder layer, as the decode runs them (q/k/v and gate/up stacked)."""
    c = SHAPES[shape]
    h, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"]
    kv_rows = 2 * kv * h // c["num_attention_heads"]
    return {"qkv": (h + kv_rows, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}


def graph_us(fn: Callable[[], object], reps: int, calls: int = 20) -> float:
    """Microseconds a call of fn, from CUDA-graph replays of ``calls`` calls (the decode's graphs: no launch
    overhead), median of ``reps`` + 1 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_s(graph.replay, max(reps, 5), "cuda") / calls * 1e6


def linear_part(shape: str, reps: int, report: Report) -> Dict[str, dict]:
    from verl_fast.ops.reshard import fp8
    from verl_fast.rollout import fp8_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    out: Dict[str, dict] = {}
    for name, (n, k) in linear_shapes(shape).items():
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        x = torch.randn(LINEAR_M, k, device="cuda", generator=g, dtype=torch.bfloat16)
        wq, ws = fp8.quantize(w, "channel")
        case = f"linear M={LINEAR_M} {name} {n}x{k}"
        rows = {"bf16": (graph_us(lambda: x @ w.t(), reps), n * k * 2)}
        for act in fp8_linear.ACTIVATIONS:
            per_token = act == "token"
            q, s = fp8_linear.quantize_rows(x, per_token)
            # the GEMM alone: row-wise scales, or the tensor-wise product before the per-channel multiply
            scale_b = ws.view(1, -1) if per_token else s.new_ones(())

            def gemm(q=q, s=s, scale_b=scale_b):
                return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16)

            try:
                rows[f"fp8 {act}"] = (graph_us(lambda: fp8_linear.product(x, wq, ws, None, None, per_token), reps),
                                      n * k + n * 4)
                rows[f"fp8 {act}: _scaled_mm alone"] = (graph_us(gemm, reps), n * k + n * 4)
            except RuntimeError as err:  # one variant refused by this torch / GPU: the others still measured
                print(f"{case} fp8 {act}: {str(err).splitlines()[0]}", flush=True)
        for impl, (us, nbytes) in rows.items():
            report.add(case, "baseline: bf16 matmul" if impl == "bf16" else impl, us / 1e3,
                       note=f"{us:.1f} us, {nbytes / us / 1e6:.2f} TB/s of weights; {rows['bf16'][0] / us:.2f}x bf16")
        out[name] = {impl: us for impl, (us, _) in rows.items()}
    return out


def hf_part(model, tokens: int, reps: int, report: Report) -> Dict[str, float]:
    from bench_decode import prompts, run_variant
    from verl_fast.rollout.fp8_linear import ACTIVATIONS, FP8Decode

    ids, mask = prompts(PROMPTS, model.config.vocab_size)
    out = {}
    for mode in ("bf16",) + tuple(f"fp8 {act}" for act in ACTIVATIONS):
        ctx = FP8Decode(mode.split()[1]).swapped(model) if mode != "bf16" else contextlib.nullcontext()
        with ctx:
            r = run_variant(model, ids, mask, SAMPLES, tokens, "kernel_attention", reps)
        rate = PROMPTS * SAMPLES * tokens / r["median_s"]
        # where a step's time goes: its kernels (one profiled call), the share of the call some kernel ran
        out[mode] = {"tokens_per_s": rate, "first_s": r["first_s"], "median_s": r["median_s"],
                     "step_ms": r["step_ms"], "kernels_per_token": r["kernels_per_token"],
                     "busy_share": r["busy_share"], "top_kernels": r["top_kernels"]}
        print(f"{mode}: {r['step_ms']:.2f} ms a step, {r['kernels_per_token']:.0f} kernels a step, busy "
              f"{r['busy_share']:.0%}; top: " + "; ".join(f"{k['name'][:70]} {k['total_ms']:.1f} ms x{k['calls']}"
                                                          for k in r["top_kernels"][:10]), flush=True)
        report.add(f"HF decode, {PROMPTS}x{SAMPLES}x{tokens} tokens", "baseline: bf16" if mode == "bf16" else
                   f"verl_fast {mode} (_scaled_mm)", r["median_s"] * 1e3,
                   note=f"{rate:.0f} tokens/s ({rate / out['bf16']['tokens_per_s']:.2f}x bf16); first call "
                        f"{r['first_s']:.1f} s")
    out["speedup"] = {act: out[f"fp8 {act}"]["tokens_per_s"] / out["bf16"]["tokens_per_s"] for act in ACTIVATIONS}
    return out


def vllm_part(model, tokens: int, reps: int, report: Report) -> Dict[str, float]:
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    from verl_fast.records.generation import SamplingSpec
    from verl_fast.rollout.fp8_sync import QUANTIZATION_CONFIG
    from verl_fast.rollout.vllm_engine import VLLMInferenceEngine
    from verl_fast.rollout.vllm_env import configure_vllm_env

    configure_vllm_env()
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token="t1", pad_token="t0")
    g = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(2, model.config.vocab_size, (int(n),), generator=g).tolist()
                  for n in torch.randint(60, 121, (PROMPTS,), generator=g)]
    spec = SamplingSpec(n=SAMPLES, temperature=1.0, max_tokens=tokens, logprobs=True, seed=0)
    out = {}
    for mode in ("bf16", "fp8"):
        with tempfile.TemporaryDirectory(prefix="bench_fp8_") as folder:
            model.config.save_pretrained(folder)
            if mode == "fp8":
                cfg = json.loads((Path(folder) / "config.json").read_text())
                (Path(folder) / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANTIZATION_CONFIG}))
            tok.save_pretrained(folder)
            engine = VLLMInferenceEngine(folder, dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.45,
                                         max_model_len=512, max_num_seqs=PROMPTS * SAMPLES, enable_sleep_mode=False,
                                         cudagraph_batch=PROMPTS * SAMPLES, fp8_weights=mode == "fp8",
                                         **({"quantization": "fp8"} if mode == "fp8" else {}))
            try:
                sync_s = median_s(lambda: engine.sync_from(model), 1, "cuda")
                gen_s = median_s(lambda: engine.generate(prompt_ids, spec), reps, "cuda")
            finally:
                engine.close()
        rate = PROMPTS * SAMPLES * tokens / gen_s  # upper bound: sequences stop at EOS too (random weights)
        out[mode] = {"tokens_per_s": rate, "generate_s": gen_s, "sync_s": sync_s}
        report.add(f"vLLM generate, {PROMPTS}x{SAMPLES}x{tokens} tokens", "baseline: bf16" if mode == "bf16" else
                   "verl_fast fp8 (block 128x128)", gen_s * 1e3, note=f"{rate:.0f} tokens/s; sync {sync_s * 1e3:.0f} ms")
    out["speedup"] = out["fp8"]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", default="sync,linear,hf,vllm")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    report = Report("fp8_rollout", args.device, meta={"shape": args.shape, "tokens": args.tokens})
    if "sync" in parts:
        model = build(args.shape, args.device, torch.bfloat16)
        report.meta["sync"] = sync_part(model, args.shape, args.device, args.reps, report)
        del model
        report.save(summary=False)
    if "linear" in parts:
        report.meta["linear"] = linear_part(args.shape, args.reps, report)
        report.save(summary=False)
    if "hf" in parts or "vllm" in parts:
        model = build(args.shape, args.device, torch.float32)  # the trainer's fp32 weights, bf16 autocast
        if "hf" in parts:
            report.meta["hf"] = hf_part(model, args.tokens, args.reps, report)
            report.save(summary=False)
        if "vllm" in parts:
            try:
                import vllm  # noqa: F401
            except ImportError:
                print("vllm part skipped: vLLM is not importable here", flush=True)
            else:
                report.meta["vllm"] = vllm_part(model, args.tokens, args.reps, report)
    report.save()
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
