"""GRPO update phase (old log-probs + one PPO epoch of updates) on 2 GPUs: the actor trained by
megatron-core at TP=2 (``actor.strategy: megatron``, bf16 parameters, fp32 main weights in the
distributed optimizer) against FSDP2 (fp32 parameters sharded over 2 ranks, bf16 mixed precision), the
same global batch of sequences, the same RLTrainer code around them.

    torchrun --nproc_per_node 2 benchmarks/bench_megatron.py [--layers 28] [--seqs 64] [--length 512] [--profile]

Shape: the 1.5B Qwen2 (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936,
tied embeddings), random weights. The Megatron layers' core attention is ``SDPAttention`` (torch's
flash kernel through ``scaled_dot_product_attention``; MegatronGPT puts it in the local layer spec), and
its log-prob head projects the response positions only. Reports time per update, model FLOPs
utilisation (6 x parameters x tokens plus attention, over 2 GPUs at the H200's dense bf16 peak) and peak
memory per GPU; JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests" / "support"))

from _common import Report  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H200 SXM dense bf16


def hf_config(layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=1536, num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=4096, rms_norm_eps=1e-6)


def experience(n: int, length: int, vocab: int, device):
    from verl_fast.records.experience import Experience

    g = torch.Generator().manual_seed(0)
    prompt = length // 2
    ids = torch.randint(0, vocab, (n, length), generator=g)
    attn = torch.ones_like(ids)
    resp = attn[:, prompt:].float()
    adv = torch.randn(n, 1, generator=g).expand(n, length - prompt).contiguous()
    return Experience(input_ids=ids, attention_mask=attn, response_mask=resp, prompt_index=torch.arange(n) // 8,
                      advantages=adv, returns=adv).to(device)


def flops_per_update(cfg, tokens: int, length: int) -> float:
    """Forward + backward of the update and the forward of the old log-probs: 8 x params x tokens
    (6 for the update, 2 for the log-probs), plus the attention scores (causal: half of S^2)."""
    h, L, V, I = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    params = L * (h * (h + 2 * kv) + h * h + 3 * h * I) + V * h  # layers + output layer
    attention = L * 2 * h * length  # QK^T and AV per token, causal half: 2 * 2 * h * S / 2
    return 4 * (2 * params + 2 * attention) * tokens


def run(strategy: str, args, device) -> dict:
    from tiny_models import build_tokenizer
    from transformers import AutoModelForCausalLM

    from verl_fast.trainer.rl_trainer import RLTrainer

    cfg = hf_config(args.layers)
    torch.manual_seed(0)
    megatron = strategy == "megatron"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if megatron else torch.float32).to(device)
    world = dist.get_world_size()
    # two optimiser steps per update; the mini-batch size counts each DP rank's sequences
    actor = {"lr": 1e-6, "micro_batch_size": args.micro, "use_kl_loss": False, "skip_zero_advantage": False,
             "ppo_mini_batch_size": args.seqs // 2 // (1 if megatron else world)}
    if megatron:
        actor.update(strategy="megatron", tensor_model_parallel_size=2, dtype="bfloat16")
    else:  # bf16 parameters in forward and backward, fp32 gradient reduction and optimizer (as Megatron's)
        actor.update(strategy="fsdp2", mixed_precision="bfloat16", fused_logprobs="on")
    trainer = RLTrainer(actor_model=model, tokenizer=build_tokenizer(), reward_fn=lambda solution_str: 0.0,
                        config={"actor": actor, "rollout": {"type": "hf", "n": 8},
                                "trainer": {"progress_bar": False, "plot": False}})
    exp = experience(args.seqs, args.length, cfg.vocab_size, device)
    if trainer.world > 1:  # FSDP2: each DP rank its half of the global batch
        exp = exp.select(torch.arange(trainer.rank, args.seqs, trainer.world, device=device))

    def update():
        exp.old_logprobs = trainer._old_logprobs(exp)
        return trainer.update_actor(exp)

    update()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.rep):
        dist.barrier()
        start = time.perf_counter()
        metrics = update()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.tensor([torch.cuda.max_memory_allocated()], device=device)
    if args.profile:
        profile_update(strategy, update)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    seconds = sorted(times)[len(times) // 2]
    mfu = flops_per_update(cfg, args.seqs * args.length, args.length) / seconds / (2 * PEAK_BF16_FLOPS)
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    return {"ms": seconds * 1e3, "mfu": mfu, "peak_gib": float(peak) / 2**30, "pg_loss": metrics["actor/pg_loss"]}


def profile_update(strategy: str, update) -> None:
    """One more update under torch.profiler; rank 0 prints the GPU time per kernel and how much of the
    wall time the GPU was busy (a low share means the host's launches are the limit)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        update()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    if dist.get_rank() == 0:
        events = prof.key_averages()
        busy_ms = sum(e.self_device_time_total for e in events) / 1e3
        print(f"---- {strategy} profile (rank 0): wall {wall_ms:.0f} ms under the profiler, kernel time "
              f"(summed over streams) {busy_ms:.0f} ms ({busy_ms / wall_ms:.0%})")
        print(events.table(sort_by="self_device_time_total", row_limit=25))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--seqs", type=int, default=64, help="sequences in the global batch")
    p.add_argument("--length", type=int, default=512, help="tokens per sequence (half prompt, half response)")
    p.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--rep", type=int, default=3)
    p.add_argument("--only", choices=("fsdp2", "megatron"), default=None)
    p.add_argument("--profile", action="store_true", help="print each strategy's GPU time per kernel")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local)
    results = {s: run(s, args, device) for s in ("fsdp2", "megatron") if args.only in (None, s)}
    if dist.get_rank() == 0:
        report = Report("megatron_update", "cuda")
        report.meta = {"shape": "qwen2 1.5B", "layers": args.layers, "seqs": args.seqs, "length": args.length,
                       "micro": args.micro, "gpus": 2, "results": results}
        for s, r in results.items():
            report.add(f"update {args.seqs}x{args.length}", "verl_fast megatron tp2" if s == "megatron"
                       else "fsdp2 (2 ranks)", r["ms"], extra_bytes=int(r["peak_gib"] * 2**30),
                       note=f"MFU {r['mfu']:.3f}, peak {r['peak_gib']:.1f} GiB/GPU")
        print(report.table())
        for s, r in results.items():
            print(f"{s}: {r['ms']:.1f} ms, MFU {r['mfu']:.3f}, peak {r['peak_gib']:.1f} GiB per GPU")
        print(f"saved {report.save()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
