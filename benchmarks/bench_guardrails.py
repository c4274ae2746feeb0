"""What the guardrails add to a training step (docs/faults.md#guardrails; the target: <= 1% of a step at 0.5B).

Each run is ``verl-fast train`` of the embedded default config (``bench_async_cpu.run_one``: synchronous, the
HF engine) on a random Qwen2 model of ``--shape`` (``tiny``: the tests' tiny model; ``0.5b``: Qwen2.5-0.5B's
shape, bench_e2e.SHAPES) with the tests' small tokenizer, seeded alike, on sums of two digits written here as
JSONL and scored by the response's last number (``reward_fn.type: gsm8k``: the default run's task and scoring,
without reasoning-gym, which the GPU machine lacks); on a GPU the step is the GPU rows' (``GPU``: 16 prompts x 8 samples x 256 new
tokens, the schema's micro-batch size in place of the preset's 32); guardrails on (the defaults) and off
(``OFF``: no sync check, so the engine returns no log-probs either, no watchdog, no non-finite step count),
``--pairs`` pairs run one after the other, the order alternating (on/off, off/on, ...) so that a machine's
drift falls on both. A run's figure is the median ``time/step`` of its steps after the first (the first
compiles); a mode's is the median over its runs; the cost is on / off - 1. Beside it, the checks' own time
inside the on runs' steps (``perf/guardrails_s``, median), against the step: the part of the cost that is
the trainer's checks, without the A/B's step-to-step noise (the rest: the engine returning log-probs, and
the watchdog's thread).

    python benchmarks/bench_guardrails.py [--shape tiny] [--steps 6] [--pairs 2] [--set SECTION.KEY=VALUE]
    python benchmarks/bench_guardrails.py --shape 0.5b --steps 6 --pairs 2   # the GPU section (gpu_run.sh)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "python_tests" / "support"))
from _common import Report  # noqa: E402
from bench_async_cpu import run_one  # noqa: E402
from bench_e2e import SHAPES  # noqa: E402

OFF = ["guardrails.sync_check=false", "guardrails.watchdog=off", "guardrails.max_nonfinite_steps=0"]
CASE = "a training step, guardrails on vs off"
# on a GPU: the step of the GPU rows (bench_e2e's 16 x 8 x 256), not the CPU preset's 4 x 8 x 16
GPU = ["trainer.device=cuda", "trainer.train_batch_size=16", "rollout.max_new_tokens=256",
       "actor.micro_batch_size=8"]


def write_sums(path: Path, count: int = 1000, seed: int = 42) -> Path:
    """``count`` verl-format rows asking for the sum of two one-digit numbers (the default run's chain_sum)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"data_source": "sums", "prompt": [{"role": "user", "content": f"{a} + {b} ="}],
                                "reward_model": {"ground_truth": str(a + b)}}) + "\n")
    return path


def step_figures(out: Path) -> Dict[str, List[float]]:
    """Each step's ``time/step`` and ``perf/guardrails_s`` (the checks' own seconds) from a run's metrics."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "time/step" in r]
    return {"step_s": [r["time/step"] for r in steps], "checks_s": [r.get("perf/guardrails_s", 0.0) for r in steps]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="SECTION.KEY=VALUE for every run")
    args = p.parse_args(argv)
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step compiles and is left out)")
    from tiny_models import save_tiny_model

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = Report("guardrails_cost", device, meta={"shape": args.shape, "steps": args.steps, "pairs": args.pairs,
                                                     "off": OFF, "set": args.set, "gpu_step": GPU if device == "cuda" else None, "runs": {"on": [], "off": []}})
    with tempfile.TemporaryDirectory(prefix="bench_guardrails_") as tmp:
        hf = {} if args.shape == "tiny" else SHAPES[args.shape]  # HF config names -> tiny_models' arguments
        names = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                 "num_key_value_heads": "num_kv_heads"}
        shape = {names.get(k, k): v for k, v in hf.items()}
        model = save_tiny_model(Path(tmp) / "model", family="qwen2", **shape)
        task = [f"trainer.dataset={write_sums(Path(tmp) / 'sums.jsonl')}", "trainer.dataset_kwargs={}",
                "reward_fn.type=gsm8k",
                *(GPU if device == "cuda" else [])]
        for pair in range(args.pairs):
            for mode in (("on", "off") if pair % 2 == 0 else ("off", "on")):
                work = Path(tmp) / f"{mode}_{pair}"
                work.mkdir()
                extra = [f"actor.model_name={model}", *task, *args.set, *(OFF if mode == "off" else [])]
                run = run_one("off", 0, args.steps, work, extra)
                figures = step_figures(work / "off_0")
                report.meta["runs"][mode].append({**figures, "wall_s": run["wall_s"]})
                print(f"pair {pair} {mode}: steps {[round(t, 3) for t in figures['step_s']]}, the checks "
                      f"{[round(t * 1e3, 2) for t in figures['checks_s']]} ms", flush=True)
    med: Dict[str, float] = {mode: statistics.median(statistics.median(r["step_s"][1:]) for r in runs)
                             for mode, runs in report.meta["runs"].items()}
    cost = med["on"] / med["off"] - 1
    # the checks' own time inside the on runs' steps: what the A/B's step-to-step noise cannot resolve
    checks = statistics.median(statistics.median(r["checks_s"][1:]) for r in report.meta["runs"]["on"])
    report.meta.update(cost=cost, checks_s=checks, checks_share=checks / med["on"])
    report.add(CASE, "baseline: guardrails off", med["off"] * 1e3, note=f"{args.shape}, median of steps 2..")
    report.add(CASE, "verl_fast guardrails on (defaults)", med["on"] * 1e3,
               note=f"{cost * 100:+.2f}% of a step; the checks' own time {checks * 1e3:.2f} ms "
                    f"({checks / med['on'] * 100:.2f}% of a step)")
    report.save()
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
