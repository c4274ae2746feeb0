"""The demo task's reward curve with FP8 rollout (``rollout.quantization: fp8``, emulated on the CPU: the HF
decode's linear layers on FP8 weights and activations, rollout correction on) against the unquantised
rollout, three seeds each: does the FP8 run end within the unquantised runs' seed-to-seed spread?

Each run is ``verl-fast train`` of the embedded default config (``bench_async_cpu.run_one``, synchronous,
``algorithm.rollout_correction=true`` in both modes: the same loss), seeded by ``trainer.seed`` and
``rollout.seed``. Recorded: every step's ``reward/mean`` and the engine/actor log-prob gap
(``guardrails/sync_logprob_diff``) per run; a mode's summary is the mean of its last ``--last`` steps' rewards
over the seeds; FP8 is "within" when that mean lies inside the unquantised seeds' [min, max].

    python benchmarks/bench_fp8_cpu.py [--steps 12] [--seeds 0,1,2] [--jobs 3]
    python benchmarks/bench_fp8_cpu.py --steps 2 --seeds 0 --set actor.model_name=TINY_DIR  # smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402
from bench_async_cpu import run_one  # noqa: E402

CASE = "demo reward, last steps"
MODES = {"bf16": [], "fp8": ["rollout.quantization=fp8"]}  # "bf16": the unquantised rollout (the actor's dtype)


def gaps(out: Path) -> List[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r.get("guardrails/sync_logprob_diff", float("nan")) for r in records if "reward/mean" in r]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--last", type=int, default=4, help="steps at the end averaged per run")
    p.add_argument("--set", action="append", default=[], help="SECTION.KEY=VALUE for every run")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (their wall_s then overlap)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    report = Report("fp8_curves", "cpu", meta={"steps": args.steps, "seeds": seeds, "last": args.last, "runs": {}})
    summary: Dict[str, Dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_fp8_cpu_") as tmp, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        def one(mode: str, seed: int) -> Dict[str, object]:
            work = Path(tmp) / mode
            work.mkdir(exist_ok=True)
            run = run_one("off", seed, args.steps, work, [*MODES[mode], *args.set])
            run["sync_logprob_diff"] = gaps(work / f"off_{seed}")
            print(f"{mode} seed {seed}: rewards {[round(r, 3) for r in run['rewards']]}", flush=True)
            return run

        started: Dict[str, list] = {mode: [] for mode in MODES}
        for seed in seeds:  # the modes' runs side by side, seed by seed
            for mode in MODES:
                started[mode].append(pool.submit(one, mode, seed))
        for mode, futures in started.items():
            runs = [f.result() for f in futures]
            report.meta["runs"][mode] = runs
            ends = [statistics.mean(r["rewards"][-args.last:]) for r in runs]
            summary[mode] = {"mean": statistics.mean(ends), "min": min(ends), "max": max(ends),
                             "std": statistics.stdev(ends) if len(ends) > 1 else 0.0,
                             "wall_s": statistics.mean(r["wall_s"] for r in runs),
                             "sync_logprob_diff": statistics.mean(statistics.mean(r["sync_logprob_diff"]) for r in runs)}
            report.meta["summary"] = summary
            report.save(summary=False)
    base, ours = summary["bf16"], summary["fp8"]
    within = base["min"] <= ours["mean"] <= base["max"]
    for mode, s in summary.items():
        report.add(CASE, "baseline: bf16 rollout" if mode == "bf16" else "verl_fast fp8 rollout", s["wall_s"] * 1e3,
                   note=f"last-{args.last} reward {s['mean']:.3f} (seeds {s['min']:.3f}..{s['max']:.3f}, std "
                        f"{s['std']:.3f}); engine-actor log-prob gap {s['sync_logprob_diff']:.4f}/token" +
                        ("" if mode == "bf16" else "; within the bf16 spread" if within else "; OUTSIDE the bf16 spread"))
    report.meta["within"] = within
    report.save(summary=False)
    print(report.table())
    for r in report.rows:
        print(f"{r.impl}: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
