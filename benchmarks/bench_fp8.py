"""FP8 rollout against bf16 at the Qwen2.5-7B shape, one GPU, one process (``rollout.quantization: fp8``):

- ``sync``: the weight sync's work on the GPU. bf16: the resharding plan HF -> vLLM's fused layout in bf16 (what
  the direct sync runs every step). FP8: every projection quantised by the FP8 kernel (128 x 128 blocks)
  straight into its rows of the fused FP8 destination and its scales, all of them in one ``quantize_many``
  call (a launch per 32 projections), the other tensors copied in bf16 (what an FP8 engine's parameters
  receive); the bytes that moves are recorded beside its time. Median of ``--reps`` calls, CUDA-synchronised.
- ``hf``: the HF decode as the trainer runs it (compiled, graph-captured, bf16 autocast over float32 weights;
  ``bench_decode.run_variant`` "kernel_attention"), 16 prompts x 8 samples x ``--tokens`` new tokens: bf16
  against FP8 linear layers (``rollout/fp8_linear.py``: per-channel weights, per-token activations,
  ``torch._scaled_mm``). Tokens per second of the median call (the first call compiles: reported apart).
- ``vllm`` (where vLLM is importable): a vLLM engine of dummy weights, bf16 against block-FP8 (the folder's
  config declaring ``fp8_sync.QUANTIZATION_CONFIG``, weights from one FP8 sync), the same prompts; tokens/s
  of the median ``generate`` and the FP8 sync's time through vLLM's reload path.

    python benchmarks/bench_fp8.py [--parts sync,hf,vllm] [--tokens 256] [--reps 3]
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


def sync_part(model, shape: str, device: str, reps: int, report: Report) -> Dict[str, float]:
    from verl_fast.ops.reshard import ModelSpec, fp8, hf_layout, plan, vllm_layout
    from verl_fast.rollout import fp8_sync

    spec = ModelSpec.from_hf_config(model.config, dtype=torch.bfloat16)
    sd = {k: v.detach() for k, v in model.named_parameters()}
    bf16 = plan(hf_layout(spec, dtype=torch.bfloat16), vllm_layout(spec, 1, {0: 0}, dtype=torch.bfloat16))
    out = bf16.allocate_destinations(torch.device(device))
    t_bf16 = median_s(lambda: bf16.execute(sd, out), reps, device)
    # FP8: each projection into its rows of the fused destination (q, k, v -> qkv_proj; gate, up -> gate_up_proj)
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    dests, jobs, rest = {}, [], []
    for name, x in sd.items():
        if not fp8_sync.quantized(name, x):
            rest.append((x, torch.empty(x.shape, dtype=torch.bfloat16, device=device)))
            continue
        module, part = name.split(".")[-2], name.rsplit(".", 2)[0]
        target, _ = fused.get(module, (module, 0))
        jobs.append((f"{part}.{target}", x))
    rows: Dict[str, int] = {}
    for key, x in jobs:
        rows[key] = rows.get(key, 0) + x.shape[0]
    for key, n in rows.items():
        cols = next(x.shape[1] for k, x in jobs if k == key)
        dests[key] = (torch.empty(n, cols, dtype=fp8.FP8, device=device),
                      torch.empty(fp8.scale_shape((n, cols), fp8.BLOCK), dtype=torch.float32, device=device))
    sources, outs, scales, at = [], [], [], {}  # each projection's views into its fused destination, made once
    for key, x in jobs:
        q, s = dests[key]
        r = at.get(key, 0)
        sources.append(x)
        outs.append(q[r:r + x.shape[0]])
        scales.append(s[r // 128:(r + x.shape[0]) // 128])
        at[key] = r + x.shape[0]

    def fp8_sync_once():
        fp8.quantize_many(sources, outs, scales, fp8.BLOCK)  # one launch per 32 projections
        for x, y in rest:
            y.copy_(x)

    t_fp8 = median_s(fp8_sync_once, reps, device)
    # the FP8 sync's floor: every bf16 weight read once, FP8 bytes and scales written, the rest copied in bf16
    moved = sum(x.numel() * 3 for x in sources) + sum(s.numel() * 4 for s in scales) + sum(x.numel() * 4 for x, _ in rest)
    weights = sum(x.numel() for x in sd.values())
    report.add(f"sync, {shape} HF -> engine layout", "baseline: bf16 reshard", t_bf16 * 1e3,
               note=f"{weights * 2 / t_bf16 / 1e9:.0f} GB/s of bf16 written")
    report.add(f"sync, {shape} HF -> engine layout", "verl_fast fp8 (kernel into fused rows)", t_fp8 * 1e3,
               note=f"{t_fp8 / t_bf16:.2f}x the bf16 sync; {moved / t_fp8 / 1e9:.0f} GB/s of {moved / 1e9:.2f} GB moved")
    return {"bf16_s": t_bf16, "fp8_s": t_fp8, "fp8_bytes_moved": moved, "bf16_bytes_moved": weights * 4}


def hf_part(model, tokens: int, reps: int, report: Report) -> Dict[str, float]:
    from bench_decode import prompts, run_variant
    from verl_fast.rollout.fp8_linear import FP8Decode

    ids, mask = prompts(PROMPTS, model.config.vocab_size)
    out = {}
    for mode in ("bf16", "fp8"):
        ctx = FP8Decode().swapped(model) if mode == "fp8" else contextlib.nullcontext()
        with ctx:
            r = run_variant(model, ids, mask, SAMPLES, tokens, "kernel_attention", reps)
        rate = PROMPTS * SAMPLES * tokens / r["median_s"]
        out[mode] = {"tokens_per_s": rate, "first_s": r["first_s"], "median_s": r["median_s"]}
        report.add(f"HF decode, {PROMPTS}x{SAMPLES}x{tokens} tokens", "baseline: bf16" if mode == "bf16" else
                   "verl_fast fp8 (_scaled_mm)", r["median_s"] * 1e3,
                   note=f"{rate:.0f} tokens/s; first call {r['first_s']:.1f} s")
    out["speedup"] = out["fp8"]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
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
    p.add_argument("--parts", default="sync,hf,vllm")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    report = Report("fp8_rollout", args.device, meta={"shape": args.shape, "tokens": args.tokens})
    if "sync" in parts:
        model = build(args.shape, args.device, torch.bfloat16)
        report.meta["sync"] = sync_part(model, args.shape, args.device, args.reps, report)
        del model
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
