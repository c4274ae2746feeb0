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
  ``kernels.decode_attention`` (``static_kv.KERNEL``; the cache's empty columns unread, the scores in
  registers);
- ``fused``: ``kernel_attention`` with the decode step's fused Triton kernels (``decode(fused=True)``:
  rotary + KV-cache write in one kernel a layer, ``kernels.rope_cache``; the sampling tail in one,
  ``kernels.decode_sampling``): what ``rollout.hf_fused_kernels: auto`` runs on a GPU.

``kernel_attention:block_n=32,warps=8,stages=3,splits=2`` runs the kernel with other launch settings
(any of the four; ``splits`` fixed instead of ``splits_for``'s choice): a sweep in one call.

Ragged lengths (``ragged``, ``ragged_whole``): the trainer's default decode (``kernel_attention``) up to
``--cap`` new tokens, rows ending where they sample one of the ``vocab / --mean`` lowest token ids (a
random-weight model's next-token distribution is close to uniform, so lengths are close to geometric
with that mean; the decode is told only the stop ids). ``ragged`` compacts finished rows out of the
batch, ``ragged_whole`` steps the whole batch to the longest row (the GPU's default, ``rollout.hf_compact_rows``),
``ragged_fused`` is ``ragged_whole`` with the fused kernels. Reported: the steps run, the rows'
lengths and the batch rows from each step, all of the last timed call; generated tokens and tokens/s;
the median of the calls' time per step (each call's time over its own steps); and the floor (per step,
the bf16 weights once and the unfinished rows' KV cache, at the card's HBM bandwidth).

(Inductor's ``max-autotune``, its Triton GEMM templates timed against cuBLAS per product, was tried on
the 0.5B shape: 3-17 s of autotuning per GEMM shape, the compile not done within 190 s; not a variant.)

Per variant: the first call (compile + capture), the median of the next ``--reps`` calls, the kernels
per token, the GPU-busy share and the ten kernels of most GPU time of one profiled call, and the floor:
the bf16 weights and the KV cache read once per token at the card's HBM bandwidth (the prefill not counted).

    python benchmarks/bench_decode.py [--shapes 0.5b,1.5b,7b] [--variants unmerged,merged,prefill_each,kernel_attention]
    python benchmarks/bench_decode.py --variants kernel_attention,ragged,ragged_whole --cap 1024 --mean 150
    python benchmarks/bench_decode.py --variants kernel_attention,fused,ragged_whole,ragged_fused  # A/B
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

VARIANTS = ("unmerged", "merged", "prefill_each", "kernel_attention", "fused", "ragged", "ragged_whole", "ragged_fused")
RAGGED = ("ragged", "ragged_whole", "ragged_fused")
FUSED = ("fused", "ragged_fused")
WHOLE = ("ragged_whole", "ragged_fused")  # the whole batch stepped to the longest row


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
    if base not in VARIANTS or (spec and base in RAGGED + FUSED + ("unmerged", "merged", "prefill_each")):
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)} (settings after "
                         f"kernel_attention: {', '.join(KNOBS)})")
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in KNOBS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"variant {variant!r}: {item!r} is not one of {', '.join(KNOBS)} = a positive int")
        out[KNOBS[key]] = int(value)
    return out


def run_variant(model, ids, mask, n: int, tokens: int, variant: str, reps: int, stop=(-1,), shared=None):
    """``variant``'s first call, the median of ``reps`` more and one profiled call; ``shared``: a dict
    that keeps the compiled forward and graph pool from one call of the same settings to the next (the
    ragged variants differ in compaction only: one compile serves both)."""
    from verl_fast.kernels import decode_attention as kernel_module
    from verl_fast.rollout import hf_decode, merged_projections, static_kv

    base = variant.partition(":")[0]
    saved = merged_projections.ATTENTIONS, merged_projections.MLPS
    if base == "unmerged":
        merged_projections.ATTENTIONS = merged_projections.MLPS = frozenset()
    kernel = static_kv.KERNEL
    static_kv.KERNEL = base in ("kernel_attention",) + FUSED + RAGGED
    knobs = knobs_of(variant)
    if "splits_for" in knobs:
        knobs["splits_for"] = lambda *_, s=knobs["splits_for"]: s
    launch = {name: getattr(kernel_module, name) for name in knobs}
    for name, value in knobs.items():
        setattr(kernel_module, name, value)
    key = ("ragged" if base in RAGGED else variant) + ("+fused" if base in FUSED else "")
    if shared is None or shared.get("key") != key:
        torch._dynamo.reset()
        shared = {} if shared is None else shared
        shared.update(key=key, compiled=hf_decode.CompiledForward(), graphs=hf_decode.GraphPool())
    rows = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(n)  # each prompt's n samples
    if variant == "prefill_each":
        ids, mask, rows = ids[rows], mask[rows], None
    log: list = []

    def call():
        log.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = hf_decode.decode(model, ids, mask, tokens, 1.0, 0, 1.0, list(stop), 0, use_graph=True,
                                   graphs=shared["graphs"], compiled=shared["compiled"], rows=rows,
                                   min_rows=None if base in WHOLE else hf_decode.MIN_ROWS, log=log,
                                   fused=base in FUSED)
        torch.cuda.synchronize()
        return out

    try:
        start = time.perf_counter()
        _, _, mode = call()
        first = time.perf_counter() - start
        times, per_step = [], []
        for _ in range(reps):
            torch.manual_seed(len(times))  # the same draws for every variant's i-th call
            start = time.perf_counter()
            new, _, _ = call()
            times.append(time.perf_counter() - start)
            per_step.append(times[-1] / log[-1][0])  # a ragged call's steps are its own draws'
        batches = [list(x) for x in log]  # the last timed call's: its steps and rows go with its tokens
        torch.manual_seed(0)
        profiled = kernel_profile(call)
    finally:
        merged_projections.ATTENTIONS, merged_projections.MLPS = saved
        static_kv.KERNEL = kernel
        for name, value in launch.items():
            setattr(kernel_module, name, value)
    steps = batches[-1][0]
    profiled_steps = log[-1][0]
    lengths = (torch.cumsum(torch.isin(new, torch.tensor(list(stop))), 1) == 0).sum(1) + 1  # through the stop
    lengths = lengths.clamp(max=tokens)
    return {"variant": variant, "mode": mode, "first_s": first, "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times), "kernels_per_token": profiled["kernels"] / profiled_steps,
            "busy_share": profiled["gpu_busy_s"] / profiled["wall_s"], "top_kernels": profiled["top_kernels"],
            "steps": steps, "step_ms": statistics.median(per_step) * 1e3, "batches": batches,
            "lengths": lengths.tolist()}


def floor_s(weights: int, kv_per_token: int, width: int, lengths, bandwidth: float) -> float:
    """Every step of the longest row: the weights once and each unfinished row's KV cache (its prompt
    width and the tokens it has so far) read once, at ``bandwidth`` bytes a second."""
    steps = max(lengths)
    kv = sum(sum(width + t for t in range(length)) for length in lengths)
    return (steps * weights + kv * kv_per_token) / bandwidth


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--cap", type=int, default=1024, help="the ragged variants' new-token cap")
    p.add_argument("--mean", type=int, default=150, help="the ragged variants' mean response length")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    for variant in args.variants.split(","):
        try:
            knobs_of(variant)
        except ValueError as e:
            p.error(str(e))
    report = Report("decode", "cuda")
    report.meta.update(setup=f"{args.prompts} prompts x {args.n}, {args.tokens} new tokens (ragged: geometric "
                             f"lengths of mean {args.mean} up to {args.cap}), bf16 autocast, CUDA graphs")
    for shape in args.shapes.split(","):
        model = build(shape)
        ids, mask = prompts(args.prompts, model.config.vocab_size)
        samples = ids.shape[0] * args.n
        weights = sum(p.numel() for p in model.parameters()) * 2  # bf16 copies, the tied head once
        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # keys + values, bf16
        rows, shared = [], {}
        for variant in args.variants.split(","):
            ragged = variant in RAGGED
            tokens = args.cap if ragged else args.tokens
            stop = range(cfg.vocab_size // args.mean) if ragged else (-1,)
            r = run_variant(model, ids, mask, args.n, tokens, variant, args.reps, stop, shared)
            floor = floor_s(weights, kv_per_token, ids.shape[1], r["lengths"], hbm_bytes_per_s())
            generated = sum(r["lengths"])
            r.update(floor_s=floor, generated=generated, tokens_per_s=generated / r["median_s"],
                     floor_step_ms=floor / r["steps"] * 1e3)
            rows.append(r)
            case = (f"{shape} ragged {samples}x<={args.cap} (mean {args.mean})" if ragged
                    else f"{shape} decode {samples}x{args.tokens}")
            report.floors[case] = floor * 1e3
            print(f"{shape} {variant:<10} first {r['first_s']:6.1f} s  median {r['median_s']:.3f} s "
                  f"(min {r['min_s']:.3f}, max {r['max_s']:.3f})  {r['steps']} steps, {generated} tokens "
                  f"(longest {max(r['lengths'])}), {r['tokens_per_s'] / 1e3:.1f}k tokens/s, {r['step_ms']:.2f} ms "
                  f"a step (floor {r['floor_step_ms']:.2f})  {r['kernels_per_token']:.0f} kernels/step  "
                  f"GPU busy {r['busy_share']:.0%}  floor {floor:.3f} s  mode {r['mode']}", flush=True)
            if ragged:
                print(f"{shape} {variant:<10} batch rows from step: {r['batches']}", flush=True)
            print(f"{shape} {variant:<10} top kernels: " + "; ".join(
                f"{k['name'][:50]} {k['total_ms']:.0f} ms x{k['calls']}" for k in r["top_kernels"][:6]), flush=True)
            report.add(case, f"verl_fast {variant}" if variant == "merged" else variant, r["median_s"] * 1e3,
                       note=f"first {r['first_s']:.1f} s, {r['steps']} steps, {r['tokens_per_s'] / 1e3:.1f}k tokens/s, "
                            f"{r['step_ms']:.2f} ms/step (floor {r['floor_step_ms']:.2f}), "
                            f"{r['kernels_per_token']:.0f} kernels/step, busy {r['busy_share']:.0%}")
            report.meta[shape] = rows
            report.save(summary=False)  # what is done so far, should a time limit cut the run
        del model
        torch.cuda.empty_cache()
    print(report.table())
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
