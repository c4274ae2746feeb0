"""The demo task's reward curve under ``trainer.async_mode`` off, one_step and full, and under synchronous
partial rollouts (``partial``: ``rollout.partial_step_tokens=8``, rounds of 4 tokens, the 16-token cap:
a sample still running after 8 tokens is carried into the next step), three seeds each, on the CPU: does
learning from samples one or more versions old (corrected per token by ``algorithm.rollout_correction``)
stay within the synchronous run's seed-to-seed spread?

Each run is the embedded default run (`verl-fast train`: GRPO on SmolLM2-135M-Instruct, reasoning-gym
chain_sum, 4 prompts x 8 samples, 16 new tokens, lr 2e-5) with ``rollout.type=hf`` in every mode (the
same engine), ``algorithm.rollout_correction=true`` in every mode (the same loss), and the seed set
in ``trainer.seed`` and ``rollout.seed``. Recorded: every step's ``reward/mean`` per run, the mean of
the last ``--last`` steps per run, and per mode the mean and the spread (min, max, std) of that over
the seeds; an async mode is "within" when its mean lies inside the synchronous seeds' [min, max].

    python benchmarks/bench_async_cpu.py [--steps 15] [--seeds 0,1,2] [--modes off,one_step,full]
    python benchmarks/bench_async_cpu.py --modes off,partial --name partial_curves
    python benchmarks/bench_async_cpu.py --steps 2 --seeds 0,1 --set actor.model_name=TINY_DIR  # smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402

CASE = "demo reward, last steps"
# the keys of each mode beyond trainer.async_mode=<mode> (partial: synchronous, with partial rollouts)
MODES = {"off": [], "one_step": [], "full": [],
         "partial": ["rollout.partial_step_tokens=8", "rollout.partial_round_tokens=4"]}


def run_one(mode: str, seed: int, steps: int, work: Path, extra: List[str]) -> Dict[str, object]:
    out = work / f"{mode}_{seed}"
    sets = [*extra, f"trainer.total_steps={steps}", f"trainer.seed={seed}", f"rollout.seed={seed}", "rollout.type=hf",
            "algorithm.rollout_correction=true", f"trainer.async_mode={'off' if mode == 'partial' else mode}",
            *MODES[mode], "trainer.hf_export=none",
            "trainer.plot=false", "trainer.progress_bar=false"]
    cmd = [sys.executable, "-m", "verl_fast", "train", "--output_dir", str(out)]
    for item in sets:
        cmd += ["--set", item]
    start = time.perf_counter()
    with open(work / f"{mode}_{seed}.log", "w") as log:
        code = subprocess.run(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = (work / f"{mode}_{seed}.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}; its log ends:\n" + "\n".join(tail))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    stale = [r.get("async/staleness_mean", r.get("partial/max_age", 0.0)) for r in records if "reward/mean" in r]
    return {"rewards": rewards, "wall_s": time.perf_counter() - start, "staleness_mean": stale,
            "carried_groups": [r.get("partial/carried_groups", 0.0) for r in records if "reward/mean" in r]}


def kept_runs(path, steps: int, seeds: List[int]) -> Dict[str, List[Dict[str, object]]]:
    """The runs per mode of an earlier result (``--keep``), refused unless it ran the same seeds and at least
    ``steps`` steps; longer runs are cut to their first ``steps`` (the demo's learning rate is constant, so
    they are the steps a shorter run makes)."""
    if path is None:
        return {}
    meta = json.loads(path.read_text())["meta"]
    if meta["steps"] < steps or meta["seeds"] != seeds:
        raise SystemExit(f"--keep {path}: it ran steps={meta['steps']} seeds={meta['seeds']}, not steps>={steps} "
                         f"seeds={seeds}")
    return {mode: [{**run, "rewards": run["rewards"][:steps], "kept_from": f"{path.name}, its first {steps} steps"}
                   for run in runs] for mode, runs in meta["runs"].items() if len(runs) == len(seeds)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--modes", default="off,one_step,full")
    p.add_argument("--last", type=int, default=5, help="steps at the end averaged per run")
    p.add_argument("--keep", type=Path, help="an earlier async_curves JSON: the modes whose runs it holds (same steps "
                   "and seeds) are taken from it, not run again (a sweep finished in parts)")
    p.add_argument("--jobs", type=int, default=1, help="runs of a mode at once")
    p.add_argument("--name", default="async_curves", help="the report's name (results/<name>_cpu.json)")
    p.add_argument("--set", action="append", default=[], help="SECTION.KEY=VALUE for every run (a smoke test: "
                   "actor.model_name=<a tiny model folder>)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    report = Report(args.name, "cpu", meta={"steps": args.steps, "seeds": seeds, "last": args.last, "runs": {}})
    summary: Dict[str, Dict[str, float]] = {}
    kept = kept_runs(args.keep, args.steps, seeds)
    with tempfile.TemporaryDirectory(prefix="bench_async_cpu_") as tmp:
        for mode in modes:
            runs: List[Dict[str, object]] = kept.get(mode, [])
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                for seed, run in zip(seeds[len(runs):], pool.map(lambda seed: run_one(mode, seed, args.steps, Path(tmp),
                                                                                    args.set), seeds[len(runs):])):
                    runs.append(run)
                    print(f"{mode} seed {seed}: rewards {[round(r, 3) for r in run['rewards']]}", flush=True)
            report.meta["runs"][mode] = runs
            ends = [statistics.mean(r["rewards"][-args.last:]) for r in runs]
            summary[mode] = {"mean": statistics.mean(ends), "min": min(ends), "max": max(ends),
                             "std": statistics.stdev(ends) if len(ends) > 1 else 0.0,
                             "wall_s": statistics.mean(r["wall_s"] for r in runs)}
            report.meta["summary"] = summary
            report.save(summary=False)
    sync = summary.get("off")
    for mode, s in summary.items():
        within = "" if sync is None or mode == "off" else (
            "; within the synchronous spread" if sync["min"] <= s["mean"] <= sync["max"] else
            "; OUTSIDE the synchronous spread")
        report.add(CASE, ("baseline: " if mode == "off" else "verl_fast ") + mode, s["wall_s"] * 1e3,
                   note=f"last-{args.last} reward {s['mean']:.3f} (seeds {s['min']:.3f}..{s['max']:.3f}, "
                        f"std {s['std']:.3f}){within}")
    report.meta["within"] = {m: bool(sync and sync["min"] <= s["mean"] <= sync["max"]) for m, s in summary.items()}
    report.save(summary=False)
    print(report.table())
    for r in report.rows:
        print(f"{r.impl}: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
