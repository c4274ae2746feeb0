"""The rollout's decode alone: ``hf_decode.decode`` as the trainer runs it on a GPU (the step's forward
compiled, captured in a CUDA graph, bf16 autocast over float32 weights), 16 prompts x 8 samples x 256
new tokens of the Qwen2 shapes of bench_e2e, in variants of our own code, one process:

- ``unmerged``: each layer's seven products as transformers' modules run them (the forwards before
  ``merged_projections``; the merge switched off by emptying its class lists);
- ``merged``: q/k/v and gate/up as one product each, each prompt prefilled once for its samples
  (``rows``), the attention in its matmul form (every cache column attended, float32 scores written
  and read back);
- ``prefill_each``: merged, the prompt's rows prefilled one by one (the loop before ``rows``);
- ``kernel_attention``: merged, each step's attention through the Triton kernel
  ``kernels.decode_attention`` (``hf_decode.KERNEL``; the cache's empty columns unread, the scores in
  registers): the trainer's default.

``kernel_attention:block_n=32,warps=8,stages=3,splits=2`` runs the kernel with other launch settings
(any of the four; ``splits`` fixed instead of ``splits_for``'s choice): a sweep in one call.

(Inductor's ``max-autotune``, its Triton GEMM templates timed against cuBLAS per product, was tried on
the 0.5B shape: 3-17 s of autotuning per GEMM shape, the compile not done within 190 s; not a variant.)

Per variant: the first call (compile + capture), the median of the next ``--reps`` calls, the kernels
per token, the GPU-busy share and the ten kernels of most GPU time of one profiled call, and the floor:
the bf16 weights and the KV cache read once per token at the card's HBM bandwidth (the prefill not counted).

    python benchmarks/bench_decode.py [--shapes 0.5b,1.5b,7b] [--variants unmerged,merged,prefill_each,kernel_attention]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, hbm_bytes_per_s  # noqa: E402
from bench_e2e import SHAPES, kernel_profile  # noqa: E402

VARIANTS = ("unmerged", "merged", "prefill_each", "kernel_attention")


def build(shape: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=49152, max_position_embeddings=4096, **{"tie_word_embeddings": True, **SHAPES[shape]})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def prompts(count: int, vocab: int):
    """``count`` random prompts of 60-120 tokens, left-padded: ids and mask [count, W]."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(60, 121, (count,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


KNOBS = {"block_n": "BLOCK_N", "warps": "NUM_WARPS", "stages": "NUM_STAGES", "splits": "splits_for"}


def knobs_of(variant: str) -> dict:
    """``kernel_attention:block_n=32,warps=8`` -> {"BLOCK_N": 32, "NUM_WARPS": 8}; raises ValueError
    naming an unknown variant or setting."""
    base, _, spec = variant.partition(":")
    if base not in VARIANTS or (spec and base != "kernel_attention"):
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)} (settings after "
                         f"kernel_attention: {', '.join(KNOBS)})")
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in KNOBS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"variant {variant!r}: {item!r} is not one of {', '.join(KNOBS)} = a positive int")
        out[KNOBS[key]] = int(value)
    return out


def run_variant(model, ids, mask, n: int, tokens: int, variant: str, reps: int):
    from verl_fast.kernels import decode_attention as kernel_module
    from verl_fast.rollout import hf_decode, merged_projections

    torch._dynamo.reset()
    saved = merged_projections.ATTENTIONS, merged_projections.MLPS
    if variant == "unmerged":
        merged_projections.ATTENTIONS = merged_projections.MLPS = frozenset()
    kernel = hf_decode.KERNEL
    hf_decode.KERNEL = variant.partition(":")[0] == "kernel_attention"
    knobs = knobs_of(variant)
    if "splits_for" in knobs:
        knobs["splits_for"] = lambda *_, s=knobs["splits_for"]: s
    launch = {name: getattr(kernel_module, name) for name in knobs}
    for name, value in knobs.items():
        setattr(kernel_module, name, value)
    compiled = hf_decode.CompiledForward()
    graphs = hf_decode.GraphPool()
    rows = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(n)  # each prompt's n samples
    if variant == "prefill_each":
        ids, mask, rows = ids[rows], mask[rows], None

    def call():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = hf_decode.decode(model, ids, mask, tokens, 1.0, 0, 1.0, [-1], 0, use_graph=True, graphs=graphs,
                                   compiled=compiled, rows=rows)
        torch.cuda.synchronize()
        return out

    try:
        start = time.perf_counter()
        _, _, mode = call()
        first = time.perf_counter() - start
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        profiled = kernel_profile(call)
    finally:
        merged_projections.ATTENTIONS, merged_projections.MLPS = saved
        hf_decode.KERNEL = kernel
        for name, value in launch.items():
            setattr(kernel_module, name, value)
    return {"variant": variant, "mode": mode, "first_s": first, "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times), "kernels_per_token": profiled["kernels"] / tokens,
            "busy_share": profiled["gpu_busy_s"] / profiled["wall_s"], "top_kernels": profiled["top_kernels"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    for variant in args.variants.split(","):
        try:
            knobs_of(variant)
        except ValueError as e:
            p.error(str(e))
    report = Report("decode", "cuda")
    report.meta.update(setup=f"{args.prompts} prompts x {args.n}, {args.tokens} new tokens, bf16 autocast, CUDA graph")
    for shape in args.shapes.split(","):
        model = build(shape)
        ids, mask = prompts(args.prompts, model.config.vocab_size)
        samples = ids.shape[0] * args.n
        weights = sum(p.numel() for p in model.parameters()) * 2  # bf16 copies, the tied head once
        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # keys + values, bf16
        mean_cache = ids.shape[1] + args.tokens / 2  # positions a step reads, on average
        floor = args.tokens * (weights + samples * mean_cache * kv_per_token) / hbm_bytes_per_s()
        case = f"{shape} decode {samples}x{args.tokens}"
        report.floors[case] = floor * 1e3
        rows = []
        for variant in args.variants.split(","):
            r = run_variant(model, ids, mask, args.n, args.tokens, variant, args.reps)
            rows.append(r)
            print(f"{shape} {variant:<10} first {r['first_s']:6.1f} s  median {r['median_s']:.3f} s "
                  f"(min {r['min_s']:.3f}, max {r['max_s']:.3f})  {r['kernels_per_token']:.0f} kernels/token  "
                  f"GPU busy {r['busy_share']:.0%}  floor {floor:.3f} s  mode {r['mode']}", flush=True)
            print(f"{shape} {variant:<10} top kernels: " + "; ".join(
                f"{k['name'][:50]} {k['total_ms']:.0f} ms x{k['calls']}" for k in r["top_kernels"][:6]), flush=True)
            report.add(case, f"verl_fast {variant}" if variant == "merged" else variant, r["median_s"] * 1e3,
                       note=f"first {r['first_s']:.1f} s, {r['kernels_per_token']:.0f} kernels/token, "
                            f"busy {r['busy_share']:.0%}")
            report.meta[shape] = rows
            report.save(summary=False)  # what is done so far, should a time limit cut the run
        del model
        torch.cuda.empty_cache()
    print(report.table())
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
