"""SFT: our trainer's step (``algorithm.type: sft``) against TRL's ``SFTTrainer`` on the same data, in
the same call, on one GPU: tokens/s, the step time per 8192 tokens, MFU, peak memory.

The setup: Qwen2-shaped models with random float32 weights built from a config on the device
(``0.5b`` and ``1.5b`` as ``bench_e2e.py``; ``7b-lora``: the Qwen2.5-7B shape, hidden 3584, 28 layers,
28 heads, 4 KV heads, intermediate 18944, with LoRA r 64, alpha 128 on every linear layer), the demo
tokenizer (vocab 49152, tied embeddings for the three). Data: conversational prompt / completion rows
of random words (prompts 32-256 tokens, completions 64-1024), the loss on the completion tokens.
Ours: the defaults (no precision keys: bf16 autocast on a GPU, rows packed without padding,
token-budget micro-batches, compiled norms and MLPs), ``--rows`` rows a step, lr 1e-5, ``train_step``
timed (no checkpoint). TRL 1.16: ``SFTConfig(packing=True, padding_free=True, bf16=True,
max_length=--pack, per_device_train_batch_size`` = the packed rows holding as many tokens as our step,
``completion_only_loss`` (its default for prompt / completion data), its other defaults (gradient
checkpointing on, as it ships). MFU of both from the same count: 6 x parameters per token plus the
causal attention pairs of the rows (``perf.update_flops``; with LoRA the frozen weights' gradient is
not computed, so 4 x plus 2 x the adapters', stated in the table's note), over the step's wall time. Each run is its own
process; the first ``--skip`` steps are warm-up, the figures medians of the rest.

    python benchmarks/bench_e2e.py --prepare-assets          # the demo tokenizer into .bench_assets/
    python benchmarks/bench_sft.py --device cuda [--shapes 0.5b,1.5b,7b-lora] [--impls ours,trl]
    python benchmarks/bench_sft.py --device cpu --tiny       # smoke test of both paths, tiny model, +- LoRA
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402
from bench_e2e import ASSETS, SHAPES  # noqa: E402

SFT_SHAPES = {**SHAPES, "7b-lora": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                        num_key_value_heads=4, intermediate_size=18944),
              "tiny-lora": SHAPES["tiny"]}  # a shape whose name ends in -lora trains LoRA adapters
LORA = {"r": 64, "alpha": 128, "target_modules": "all-linear"}
WORDS = ("alpha beta gamma delta number answer because first second then value sum the of and is to "
         "question result check step").split()
PER = 8192  # the table's step time is per this many tokens


def rows(count: int, seed: int, tiny: bool) -> List[Dict[str, Any]]:
    """Conversational prompt / completion rows of random words (a word is about a token)."""
    rng = random.Random(seed)
    p_range, c_range = ((4, 16), (8, 32)) if tiny else ((32, 256), (64, 1024))
    out = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*p_range)))
        completion = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*c_range)))
        out.append({"prompt": [{"role": "user", "content": prompt}],
                    "completion": [{"role": "assistant", "content": completion}]})
    return out


def build(shape: str, device: str):
    """The random-weight model of ``shape`` on ``device`` (float32) and the demo tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if not (ASSETS / "tokenizer.json").is_file():
        raise SystemExit(f"{ASSETS} has no tokenizer: run `python benchmarks/bench_e2e.py --prepare-assets`")
    tok = AutoTokenizer.from_pretrained(ASSETS)
    eos = tok.eos_token_id
    cfg = Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, max_position_embeddings=8192, eos_token_id=eos,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos,
                      bos_token_id=tok.bos_token_id, **SFT_SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model, tok


def flops_per_token(model, data_tokens: List[int], lora: bool) -> float:
    """The update's FLOPs per real token of ``data_tokens``-long rows (module docstring)."""
    from verl_fast.trainer.perf import update_flops

    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    # LoRA: the adapters peft put into the model (none yet where it wraps a copy: then 4 x parameters)
    trained = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) if lora else None
    pairs = sum(n * (n + 1) / 2 for n in data_tokens)
    attn_width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    return update_flops(params, cfg.num_hidden_layers, attn_width, sum(data_tokens), pairs, trained) / sum(data_tokens)


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def worker_ours(args) -> Dict[str, Any]:
    from verl_fast.trainer.rl_trainer import RLTrainer

    model, tok = build(args.shape, args.device)
    data = rows(args.rows * args.steps, 0, args.tiny)
    cfg = {"algorithm": {"type": "sft", "sft_max_length": args.pack},
           "actor": {"lr": 1e-5, **({"lora": LORA} if args.shape.endswith("lora") else {})},
           "trainer": {"total_steps": args.steps, "train_batch_size": args.rows, "progress_bar": False,
                       "plot": False, "output_dir": tempfile.mkdtemp(prefix="bench_sft_ours_"), "device": args.device}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg)
    trainer.total_steps = args.steps
    examples = trainer.algorithm.encode(trainer.processor, data)
    steps = []
    for i in range(args.steps):
        batch = examples[i * args.rows : (i + 1) * args.rows]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        cuda_sync()
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        cuda_sync()
        steps.append({"wall_s": time.perf_counter() - start, "tokens": float(sum(len(e.ids) for e in batch)),
                      "loss": metrics["sft/loss"], "peak_memory_gib": peak_gib(),
                      "token_budget": metrics.get("perf/token_budget")})
        print(f"ours {args.shape}: step {i + 1} {steps[-1]['wall_s']:.2f} s loss {metrics['sft/loss']:.3f} "
              f"peak {steps[-1]['peak_memory_gib']:.1f} GiB token budget {steps[-1]['token_budget']}", flush=True)
    lengths = [len(e.ids) for e in examples]
    return {"impl": "verl_fast", "steps": steps, "flops_per_token": flops_per_token(model, lengths,
                                                                                     args.shape.endswith("lora"))}


def worker_trl(args) -> Dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    model, tok = build(args.shape, args.device)
    data = rows(args.rows * args.steps, 0, args.tiny)

    class Timer(TrainerCallback):
        def __init__(self):
            self.steps: List[Dict[str, float]] = []
            self.tokens: List[float] = []

        def on_step_begin(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            cuda_sync()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            cuda_sync()
            self.steps.append({"wall_s": time.perf_counter() - self.start, "peak_memory_gib": peak_gib()})

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "num_tokens" in logs:
                self.tokens.append(float(logs["num_tokens"]))

    # as many packed rows of --pack tokens a step as hold our step's tokens
    lengths = [len(tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=False))
               for r in data]
    per_step = max(1, round(sum(lengths) / args.steps / args.pack))
    peft = None
    if args.shape.endswith("lora"):
        from peft import LoraConfig

        peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules="all-linear", task_type="CAUSAL_LM")
    config = SFTConfig(output_dir=tempfile.mkdtemp(prefix="bench_sft_trl_"), per_device_train_batch_size=per_step,
                       max_length=args.pack, packing=True, padding_free=True, bf16=args.device == "cuda",
                       learning_rate=1e-5, max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none",
                       disable_tqdm=True, seed=0, use_cpu=args.device == "cpu", dataset_num_proc=1)
    timer = Timer()
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(data), processing_class=tok,
                         peft_config=peft, callbacks=[timer])
    trainer.train()
    cumulative = [0.0] + timer.tokens  # num_tokens is the running total
    for step, (a, b) in zip(timer.steps, zip(cumulative, cumulative[1:])):
        step["tokens"] = b - a
    return {"impl": f"trl {trl.__version__}", "steps": timer.steps,
            "flops_per_token": flops_per_token(model, lengths, args.shape.endswith("lora"))}


def summary(result: Dict[str, Any], skip: int) -> Dict[str, float]:
    timed = [s for s in result["steps"][skip:] if s.get("tokens")] or result["steps"][-1:]
    tps = statistics.median(s["tokens"] / s["wall_s"] for s in timed)
    return {"tokens_per_s": tps, "ms_per_8k": PER / tps * 1e3, "flops_per_s": tps * result["flops_per_token"],
            "peak_memory_gib": max(s["peak_memory_gib"] for s in timed), "steps": float(len(timed)),
            **({"token_budget": timed[-1]["token_budget"]} if timed[-1].get("token_budget") else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="0.5b,1.5b,7b-lora")
    ap.add_argument("--impls", default="ours,trl")
    ap.add_argument("--rows", type=int, default=32, help="rows per step (ours); TRL's packed rows hold as many tokens")
    ap.add_argument("--pack", type=int, default=4096, help="TRL's max_length (packed row), our sft_max_length")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=200, help="seconds per run")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape, short rows, few steps (CPU smoke test)")
    ap.add_argument("--name", default="sft", help="the report's name (results/<name>_<device>.json)")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # a worker: impl
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:
        result = (worker_ours if args.run == "ours" else worker_trl)(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    shapes = ["tiny", "tiny-lora"] if args.tiny and args.shapes == ap.get_default("shapes") else args.shapes.split(",")
    from verl_fast.trainer.perf import peak_bf16_flops

    peak = peak_bf16_flops(torch.device(args.device)) if args.device == "cuda" else None
    report = Report(args.name + ("_tiny" if args.tiny else ""), args.device)
    report.meta.update(rows=args.rows, pack=args.pack, steps=args.steps, skip=args.skip, lora=LORA)
    for shape in shapes:
        case = f"{shape} ms/{PER // 1024}k tok"
        for impl in args.impls.split(","):
            out = Path(tempfile.mkdtemp(prefix="bench_sft_")) / "result.json"
            cmd = [sys.executable, __file__, "--run", impl, "--shape", shape, "--out", str(out), "--device",
                   args.device, "--rows", str(args.rows), "--pack", str(args.pack), "--steps", str(args.steps)]
            cmd += ["--tiny"] if args.tiny else []
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"{shape} {impl}: timed out after {args.timeout} s", flush=True)
                continue
            if done.returncode != 0 or not out.is_file():
                print(f"{shape} {impl}: failed\n{(done.stdout + done.stderr)[-3000:]}", flush=True)
                continue
            result = json.loads(out.read_text())
            s = summary(result, min(args.skip, len(result["steps"]) - 1))
            mfu = s["flops_per_s"] / peak if peak else None
            note = f"{s['tokens_per_s']:.0f} tok/s" + (f", MFU {100 * mfu:.1f}%" if mfu is not None else "") + \
                f", peak {s['peak_memory_gib']:.1f} GiB"
            name = "verl_fast (ours)" if impl == "ours" else result["impl"] + " SFTTrainer"
            report.add(case, name, s["ms_per_8k"], note=note)
            report.meta[f"{shape}/{impl}"] = {**s, "mfu": mfu}
            print(f"{shape} {name}: {note}", flush=True)
            if peak and impl == "ours":
                report.floors[case] = PER * result["flops_per_token"] / peak * 1e3  # at 100% MFU
    print(report.table())
    print("\n".join(f"{r.case:<28} {r.impl:<26} {r.note}" for r in report.rows))
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
