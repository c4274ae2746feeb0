"""The update at long sequences on one GPU: its measured peak memory beside the memory plan's estimate
(``strategies/memory_plan.estimate``), its trained tokens/s and MFU, for the rows of issue 66's targets:

- the memory rows (each must stay <= 75 GiB on an 80 GB H100): the Qwen2.5-1.5B shape, full fine-tune,
  512-token prompts and a 16,384-token cap; the Qwen2.5-7B shape with LoRA r 64 on every linear layer at
  an 8,192-token cap;
- prime-rl's single-H100 trainer rows, the update alone (target: >= 2x their tokens/s at equal or lower
  memory): the Qwen3-0.6B shape, full fine-tune, 16,384-token sequences; the Qwen3-4B shape
  (Qwen3-4B-Instruct-2507's config) with LoRA r 16 on every linear layer, 65,536-token sequences. Their
  figures (``PRIME_RL``) are saved beside ours. The 0.6B row runs twice: with the defaults (the plan
  spends the free memory on speed) and memory-matched (gradient checkpointing, one sequence a
  micro-batch), since prime-rl's figure comes at a peak far below what the defaults take.

Each row runs in its own process: the random-weight model of the shape (float32, ``verl_fast.bench.shapes``)
built on the device, the trainer's strategy with no memory key set unless the row names one
(``FSDPStrategy``: gradient checkpointing, bf16 copies, compiled blocks, the packed varlen attention and
the fused log-prob head all by their auto rules), micro-batches under the trainer's auto token budget
(``Updates.token_budget``'s rule) over the row's sequences of the whole length (every response at the
cap: the update's worst case), then the old-log-prob pass, one forward / backward of the policy loss over
every micro-batch and one optimizer step, ``--steps`` times. Recorded per row, from the last step: the
peak allocated memory, the old-log-prob pass's and the update's (forward / backward and optimizer step)
times, the update's trained tokens/s, its MFU and the estimate by phase.

MFU counts the FLOPs explicitly, as prime-rl counts theirs: 6 x parameters x tokens (embeddings counted
once where tied; a LoRA row's adapters left out, its frozen base counted as trained) plus the attention's
quadratic term, 12 x layers x (heads x head_dim) x the causal query-key pairs the passes ran (n (n + 1) / 2
for a sequence of n tokens: ``trainer/perf.update_flops``), over the update's time and the device's
dense bf16 peak (``trainer/perf.PEAK_BF16_FLOPS``).

    python benchmarks/bench_long_caps.py --device cuda [--rows-set 1.5b_16k,qwen3_4b_lora_64k]
    python benchmarks/bench_long_caps.py --device cpu --tiny        # smoke test, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402

GIB = 2**30
H100_FIT = 75 * GIB

# prime-rl's single-H100 trainer benchmarks (github.com/PrimeIntellect-ai/prime-rl, benchmarks/baselines/,
# "benchmark-<machine>-<model>-rl-<lora rank or full>-1gpu-Recompute-flash_attention_3-<seq_len>-cp1-ep1.json":
# seq_len-token sequences, 2 micro-batches a step, activation recompute, FlashAttention 3, an H100 80GB HBM3),
# and the figures issue 66 quotes from them
PRIME_RL = {
    "Qwen3-0.6B": {"file": "benchmarks/baselines/benchmark-1xh100-Qwen--Qwen3-0.6B-rl-full-1gpu-Recompute-"
                           "flash_attention_3-16384-cp1-ep1.json", "commit": "767aaadfcfccdda9ee2be745571081d637b99b81",
                   "model": "Qwen/Qwen3-0.6B", "seq_len": 16384, "lora_rank": None, "tokens_per_s": 11896.0,
                   "mfu": 0.1108, "peak_memory_gib": 12.53, "step_s": 1.99, "issue_66": {"tokens_per_s": 11900.0,
                                                                                          "mfu": 0.111}},
    "Qwen3-4B": {"file": "benchmarks/baselines/benchmark-8xh100-Qwen--Qwen3-4B-Instruct-2507-rl-16-1gpu-Recompute-"
                         "flash_attention_3-65536-cp1-ep1.json", "commit": "8dcafdd064aadc69e2985cc81bfd0983bd3cfa3b",
                 "model": "Qwen/Qwen3-4B-Instruct-2507", "seq_len": 65536, "lora_rank": 16, "tokens_per_s": 4107.0,
                 "mfu": 0.3686, "peak_memory_gib": 44.87, "step_s": 31.98, "issue_66": {"tokens_per_s": 4160.0,
                                                                                        "mfu": 0.37}},
}


@dataclass(frozen=True)
class LongRow:
    shape: str  # a name of verl_fast.bench.shapes, or "tiny" / "tiny_qwen3"
    prompt: int  # prompt tokens; prompt + cap is the sequence
    cap: int
    rank: Optional[int] = None  # LoRA rank (alpha 2r, every linear layer) or full fine-tune
    rows: int = 2  # sequences of the whole length a step
    actor: Dict[str, Any] = field(default_factory=dict)  # actor keys set (none: the defaults)
    timeout: int = 150  # seconds for the row's process on the GPU
    published: Optional[str] = None  # its PRIME_RL entry


ROWS = {
    "1.5b_16k": LongRow("Qwen2.5-1.5B", 512, 16384, timeout=100),
    "7b_lora_8k": LongRow("Qwen2.5-7B", 512, 8192, 64, timeout=130),
    "qwen3_0.6b_16k": LongRow("Qwen3-0.6B", 512, 15872, timeout=80, published="Qwen3-0.6B"),
    "qwen3_0.6b_16k_matched": LongRow("Qwen3-0.6B", 512, 15872, actor={"gradient_checkpointing": True,
                                                                       "max_token_len_per_gpu": 16384},
                                      timeout=80, published="Qwen3-0.6B"),
    "qwen3_4b_lora_64k": LongRow("Qwen3-4B", 512, 65024, 16, rows=1, timeout=170, published="Qwen3-4B"),
    # CPU smoke rows: the same code paths at tiny sizes (the Qwen3 one past its model's positions, packed,
    # checkpointed, the fused head's chunked torch path)
    "tiny": LongRow("tiny", 16, 48),
    "tiny_lora": LongRow("tiny", 16, 48, 8),
    "tiny_qwen3_long": LongRow("tiny_qwen3", 64, 2000, 8, rows=1,
                               actor={"use_remove_padding": True, "gradient_checkpointing": True,
                                      "fused_logprobs": "on"}),
}
GPU_ROWS = ("qwen3_4b_lora_64k", "qwen3_0.6b_16k", "1.5b_16k", "7b_lora_8k", "qwen3_0.6b_16k_matched")
TINY_ROWS = ("tiny", "tiny_lora", "tiny_qwen3_long")


def hf_config(row: LongRow):
    """The row's HF config. Positions: the published configs' (40,960 for both Qwen3 shapes) where the
    sequence fits, else the sequence's length: the default RoPE computes any position's angles, so the
    cost of a longer context is the same (a user past the trained context would add YaRN scaling,
    which changes the angles, not the work)."""
    from transformers import Qwen2Config, Qwen3Config

    from verl_fast.bench.shapes import shape

    length = row.prompt + row.cap
    if row.shape == "tiny":
        return Qwen2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if row.shape == "tiny_qwen3":  # fewer positions than the row's tokens, as the 65,536-token row has
        return Qwen3Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    s = shape(row.shape)
    if s.qk_norm:  # Qwen3: rope_theta 1e6 in both published configs
        return Qwen3Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                           intermediate_size=s.intermediate_size, num_attention_heads=s.num_heads,
                           num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                           tie_word_embeddings=s.tied_embeddings, max_position_embeddings=max(40960, length),
                           rope_theta=1e6)  # transformers 5 moves it into rope_parameters, 4.x keeps it
    return Qwen2Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                       intermediate_size=s.intermediate_size, num_attention_heads=s.num_heads,
                       num_key_value_heads=s.num_kv_heads, tie_word_embeddings=s.tied_embeddings,
                       max_position_embeddings=max(32768, length))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def worker(name: str, device: torch.device, steps: int, save: Callable[[Dict[str, Any]], None]) -> None:
    """Runs the row, handing ``save`` its result after every step (a row cut short keeps its steps)."""
    from transformers import AutoModelForCausalLM

    from verl_fast.config import from_dict
    from verl_fast.models import lora as lora_mod
    from verl_fast.records.experience import Experience
    from verl_fast.strategies import memory_plan
    from verl_fast.strategies.fsdp_strategy import FSDPStrategy
    from verl_fast.trainer.batching import micro_batches, token_budget
    from verl_fast.trainer.perf import peak_bf16_flops, update_flops

    row = ROWS[name]
    cfg = from_dict({"actor": {"model_name": "m", **row.actor,
                               **({"lora": {"r": row.rank, "alpha": 2 * row.rank}} if row.rank else {})},
                     "rollout": {"max_new_tokens": row.cap, "n": 8},
                     "trainer": {"train_batch_size": 16, "max_prompt_length": row.prompt, "device": device.type}})
    hf = hf_config(row)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else H100_FIT
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())  # before adapters: the MFU's count
    if row.rank:
        model = lora_mod.apply(model, cfg.actor.lora)
    strategy = FSDPStrategy(cfg, model, None, None, needs_reference=False)
    length = row.prompt + row.cap
    ids = torch.randint(3, hf.vocab_size, (row.rows, length), device=device)
    exp = Experience(input_ids=ids, attention_mask=torch.ones_like(ids),
                     prompt_index=torch.arange(row.rows, device=device),
                     response_mask=torch.ones(row.rows, row.cap, dtype=torch.long, device=device),
                     advantages=torch.randn(row.rows, row.cap, device=device))
    budget = cfg.actor.max_token_len_per_gpu or token_budget(
        strategy.actor, strategy.optimizer, device, compiled=strategy.compiled,
        half=strategy.autocast_dtype in (torch.bfloat16, torch.float16), checkpointed=strategy.checkpointing,
        casts_weights=strategy.autocast_dtype is not None and strategy.bf16 is None,
        state_bytes=memory_plan.OPTIMIZER_STATE_BYTES[cfg.actor.optimizer])
    micro = micro_batches(torch.arange(row.rows, device=device), exp.attention_mask.sum(-1), max_tokens=budget,
                          packed=strategy.packs_sequences)
    # the plan at the micro-batch these rows make (the trainer's would be cut from a whole step's rows)
    est = memory_plan.estimate(cfg, memory_plan.shape_of(strategy.actor), hf, free, peft=bool(row.rank),
                               compiled=strategy.compiled, fused_head=device.type == "cuda",
                               micro_tokens=max(int(exp.attention_mask[idx].sum()) for idx in micro))

    def loss_fn(logp, ent, sub):
        ratio = torch.exp(logp - sub.old_logprobs)
        return -(ratio * sub.advantages).mean(), {}

    attn_width = hf.num_attention_heads * (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    peak = peak_bf16_flops(device)
    out = []
    for _ in range(steps):
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        exp.old_logprobs = strategy.actor_logprobs(exp, micro).detach()
        sync(device)
        mid = time.perf_counter()
        _, (tokens, pairs) = strategy.forward_backward(exp, micro, loss_fn)
        strategy.optimizer_step()
        sync(device)
        end = time.perf_counter()
        out.append({"old_logprob_s": mid - start, "update_s": end - mid, "tokens": tokens, "pairs": pairs,
                    "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None})
        last = out[-1]
        flops = update_flops(params, hf.num_hidden_layers, attn_width, last["tokens"], last["pairs"])
        save({"row": name, "steps": out, "estimate": est.as_dict(), "free_bytes": free, "token_budget": budget,
              "micro_batches": len(micro), "resolved": {k: str(v) for k, v in strategy.resolved().items()},
              "sequence_tokens": length, "sequences": row.rows, "lora_rank": row.rank, "parameters": params,
              "update_flops": flops, "tokens_per_s": last["tokens"] / last["update_s"],
              "mfu": flops / last["update_s"] / peak if peak else None,
              "published": PRIME_RL.get(row.published) if row.published else None})


def summary(result: Dict[str, Any]) -> str:
    """The row's line: its memory against the plan, its speed against prime-rl's where it has theirs."""
    last, est = result["steps"][-1], result["estimate"]
    peak = last["peak_bytes"]
    fits = "" if peak is None else f"; fits 75 GiB: {peak <= H100_FIT}"
    planned = max(est["update_peak"], est["logprob_peak"])  # the passes this runs (no rollout)
    note = (f"peak {'-' if peak is None else f'{peak / GIB:.1f}'} GiB against the plan's {planned / GIB:.1f} "
            f"(static {est['static'] / GIB:.1f} with the decode's bf16 copy, not held here; activations "
            f"{est['activations'] / GIB:.1f} as {est['mode']} at {est['micro_tokens']} tokens, head "
            f"{est['head'] / GIB:.2f}; log-prob pass {est['logprob_pass'] / GIB:.2f}){fits}; "
            f"{result['micro_batches']} micro-batches at {result['token_budget']} tokens; update "
            f"{result['tokens_per_s']:.0f} tokens/s")
    if result["mfu"] is not None:
        note += f", MFU {100 * result['mfu']:.1f}%"
    theirs = result["published"]
    if theirs:
        note += (f" (prime-rl: {theirs['tokens_per_s']:.0f} tokens/s, MFU {100 * theirs['mfu']:.1f}%, peak "
                 f"{theirs['peak_memory_gib']:.1f} GiB: x{result['tokens_per_s'] / theirs['tokens_per_s']:.2f})")
    return note


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows-set", default=",".join(GPU_ROWS), help=f"rows among {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=int, help="seconds per row (default: the row's own on a GPU, 600 on a CPU)")
    ap.add_argument("--tiny", action="store_true", help="the tiny rows (CPU smoke test)")
    ap.add_argument("--name", default="long_caps")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:
        worker(args.run, torch.device(args.device), args.steps, lambda r: Path(args.out).write_text(json.dumps(r)))
        return 0
    # a SIGTERM (gpu_run.sh's timeout) ends the row's process too: subprocess.run kills it on the exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chosen = list(TINY_ROWS) if args.tiny else args.rows_set.split(",")
    unknown = [r for r in chosen if r not in ROWS]
    if unknown:
        print(f"--rows-set: unknown rows {', '.join(unknown)}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    report = Report(args.name + ("_tiny" if args.tiny else ""), args.device)
    report.meta.update(steps=args.steps, fit_bytes=H100_FIT, results={},
                       flops="6 x parameters x tokens + 12 x layers x heads x head_dim x causal query-key pairs")
    failed = False
    for name in chosen:
        out = Path(tempfile.mkdtemp(prefix="bench_long_caps_")) / "result.json"
        cmd = [sys.executable, __file__, "--run", name, "--out", str(out), "--device", args.device,
               "--steps", str(args.steps)]
        timeout = args.timeout or (ROWS[name].timeout if args.device.startswith("cuda") else 600)
        cut = ""
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out after {timeout} s", flush=True)
            failed, cut = True, f" (cut at {timeout} s)"
        else:
            if done.returncode != 0:
                print(f"{name}: failed\n{(done.stdout + done.stderr)[-3000:]}", flush=True)
                failed = True
                continue
        if not out.is_file():
            continue
        result = json.loads(out.read_text())
        result["cut_short"] = bool(cut)
        report.meta["results"][name] = result
        last = result["steps"][-1]
        note = summary(result) + f"; {len(result['steps'])} of {args.steps} steps{cut}"
        report.add(f"update {name}", "verl_fast", last["update_s"] * 1e3, extra_bytes=last["peak_bytes"], note=note)
        print(f"{name}: {last['update_s']:.2f} s an update (old log-probs {last['old_logprob_s']:.2f} s), {note}",
              flush=True)
        report.save(summary=False)  # after every row: a call cut short keeps the rows it finished
    report.save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
