"""The update at long caps on one GPU: its measured peak memory beside the memory plan's estimate
(``strategies/memory_plan.estimate``), for the rows of issue 66's targets (each must stay <= 75 GiB on
an 80 GB H100): the Qwen2.5-1.5B shape, full fine-tune, 512-token prompts and a 16,384-token cap; the
Qwen2.5-7B shape with LoRA r 64 on every linear layer at an 8,192-token cap.

Each row runs in its own process: the random-weight model of the shape (float32, vocab 151,936) built on
the device, the trainer's strategy with no memory key set (``FSDPStrategy``: gradient checkpointing,
bf16 copies, compiled blocks, the fused log-prob head all by their auto rules), micro-batches under the
trainer's auto token budget (``Updates.token_budget``'s rule) over ``--rows`` sequences of the whole
length (every response at the cap: the update's worst case), then the old-log-prob pass, one
forward / backward of the policy loss over every micro-batch and one optimizer step, ``--steps`` times.
Recorded per row: the peak allocated memory of the last step, the step's time, the estimate by phase.

    python benchmarks/bench_long_caps.py --device cuda [--rows-set 1.5b_16k,7b_lora_8k]
    python benchmarks/bench_long_caps.py --device cpu --tiny        # smoke test, tiny shape
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402

GIB = 2**30
H100_FIT = 75 * GIB
# row -> (model shape, prompt tokens, cap, LoRA rank or None)
ROWS = {"1.5b_16k": ("Qwen2.5-1.5B", 512, 16384, None), "7b_lora_8k": ("Qwen2.5-7B", 512, 8192, 64),
        "tiny": ("tiny", 16, 48, None), "tiny_lora": ("tiny", 16, 48, 8)}


def hf_config(name: str):
    from transformers import Qwen2Config

    from verl_fast.bench.shapes import shape

    if name == "tiny":
        return Qwen2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    s = shape(name)
    return Qwen2Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                       intermediate_size=s.intermediate_size, num_attention_heads=s.num_heads,
                       num_key_value_heads=s.num_kv_heads, tie_word_embeddings=s.tied_embeddings,
                       max_position_embeddings=32768)


def worker(row: str, device: torch.device, rows: int, steps: int) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from verl_fast.config import from_dict
    from verl_fast.models import lora as lora_mod
    from verl_fast.records.experience import Experience
    from verl_fast.strategies import memory_plan
    from verl_fast.strategies.fsdp_strategy import FSDPStrategy
    from verl_fast.trainer.batching import micro_batches, token_budget

    name, prompt, cap, rank = ROWS[row]
    cfg = from_dict({"actor": {"model_name": "m", **({"lora": {"r": rank, "alpha": 2 * rank}} if rank else {})},
                     "rollout": {"max_new_tokens": cap, "n": 8},
                     "trainer": {"train_batch_size": 16, "max_prompt_length": prompt, "device": device.type}})
    hf = hf_config(name)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else H100_FIT
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    if rank:
        model = lora_mod.apply(model, cfg.actor.lora)
    strategy = FSDPStrategy(cfg, model, None, None, needs_reference=False)
    est = memory_plan.estimate(cfg, memory_plan.shape_of(strategy.actor), hf, free, peft=bool(rank),
                               compiled=strategy.compiled, fused_head=device.type == "cuda")
    length = prompt + cap
    ids = torch.randint(3, hf.vocab_size, (rows, length), device=device)
    exp = Experience(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_index=torch.arange(rows, device=device),
                     response_mask=torch.ones(rows, cap, dtype=torch.long, device=device),
                     advantages=torch.randn(rows, cap, device=device))
    budget = token_budget(strategy.actor, strategy.optimizer, device, compiled=strategy.compiled,
                          half=strategy.autocast_dtype in (torch.bfloat16, torch.float16),
                          checkpointed=strategy.checkpointing,
                          casts_weights=strategy.autocast_dtype is not None and strategy.bf16 is None,
                          state_bytes=memory_plan.OPTIMIZER_STATE_BYTES[cfg.actor.optimizer])
    micro = micro_batches(torch.arange(rows, device=device), exp.attention_mask.sum(-1), max_tokens=budget,
                          packed=strategy.packs_sequences)

    def loss_fn(logp, ent, sub):
        ratio = torch.exp(logp - sub.old_logprobs)
        return -(ratio * sub.advantages).mean(), {}

    out = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        exp.old_logprobs = strategy.actor_logprobs(exp, micro).detach()
        strategy.forward_backward(exp, micro, loss_fn)
        strategy.optimizer_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append({"wall_s": time.perf_counter() - start,
                    "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None})
    return {"row": row, "steps": out, "estimate": est.as_dict(), "free_bytes": free, "token_budget": budget,
            "micro_batches": len(micro), "resolved": {k: str(v) for k, v in strategy.resolved().items()},
            "tokens_per_step": rows * length}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows-set", default="1.5b_16k,7b_lora_8k", help=f"rows among {', '.join(ROWS)}")
    ap.add_argument("--rows", type=int, default=2, help="sequences of the whole length per step")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=280, help="seconds per row")
    ap.add_argument("--tiny", action="store_true", help="the tiny rows (CPU smoke test)")
    ap.add_argument("--name", default="long_caps")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:
        result = worker(args.run, torch.device(args.device), args.rows, args.steps)
        Path(args.out).write_text(json.dumps(result))
        return 0
    chosen = ["tiny", "tiny_lora"] if args.tiny else args.rows_set.split(",")
    report = Report(args.name + ("_tiny" if args.tiny else ""), args.device)
    report.meta.update(rows=args.rows, steps=args.steps, fit_bytes=H100_FIT, results={})
    failed = False
    for row in chosen:
        out = Path(tempfile.mkdtemp(prefix="bench_long_caps_")) / "result.json"
        cmd = [sys.executable, __file__, "--run", row, "--out", str(out), "--device", args.device,
               "--rows", str(args.rows), "--steps", str(args.steps)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{row}: timed out after {args.timeout} s", flush=True)
            failed = True
            continue
        if done.returncode != 0 or not out.is_file():
            print(f"{row}: failed\n{(done.stdout + done.stderr)[-3000:]}", flush=True)
            failed = True
            continue
        result = json.loads(out.read_text())
        report.meta["results"][row] = result
        last, est = result["steps"][-1], result["estimate"]
        peak = last["peak_bytes"]
        fits = "" if peak is None else f"; fits 75 GiB: {peak <= H100_FIT}"
        note = (f"peak {'-' if peak is None else f'{peak / GIB:.1f}'} GiB against the plan's {est['peak'] / GIB:.1f} "
                f"(update {est['update_peak'] / GIB:.1f}: static {est['static'] / GIB:.1f}, activations "
                f"{est['activations'] / GIB:.1f} as {est['mode']}, head {est['head'] / GIB:.2f}; rollout "
                f"{est['rollout_peak'] / GIB:.1f} at {est['rollout_prompts']} prompts a decode call){fits}; "
                f"{result['micro_batches']} micro-batches at {result['token_budget']} tokens")
        report.add(f"update {row}", "verl_fast", last["wall_s"] * 1e3, extra_bytes=peak, note=note)
        print(f"{row}: {last['wall_s']:.2f} s a step, {note}", flush=True)
    report.save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
