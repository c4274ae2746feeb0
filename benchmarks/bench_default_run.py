"""The embedded default run (`verl-fast train`, 25 steps) against the plain GRPO loop, in one run.

Both commands run as subprocesses, back to back, on the same model (the demo SmolLM2-135M-Instruct
folder), data (reasoning-gym chain_sum, two one-digit terms), batch (4 prompts x 8 samples), sampling
(T=1, 16 new tokens) and optimiser settings (AdamW lr 2e-5, grad clip 1, bf16 autocast, zero-advantage
groups skipped). Timed: the wall time of the whole command, start-up included. Learning: the mean
training reward of the first 5 and the last 5 steps of each. The machine's load average is recorded
beside each run, because on a shared machine it moves the times more than anything else.

    python benchmarks/bench_default_run.py [--steps 25] [--repeats 1] [--baseline-dir DIR]

The plain loop is ../shared/baselines/grpo_toy/grpo.py (``--baseline-dir`` or ``$VF_GRPO_TOY``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report  # noqa: E402

DEFAULT_BASELINE = os.environ.get("VF_GRPO_TOY", "/work/shared/baselines/grpo_toy")
CASE = "default run, 25 steps"


def first_last(rewards: List[float], k: int = 5) -> Dict[str, float]:
    k = max(1, min(k, len(rewards) // 2))
    return {"first5": sum(rewards[:k]) / k, "last5": sum(rewards[-k:]) / k, "steps": len(rewards)}


def start(cmd: List[str], cwd: Path, env: Dict[str, str], log: Path):
    """Starts ``cmd``; the returned function waits for it and gives its wall time and load."""
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    out = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    ended: Dict[str, float] = {}

    def watch() -> None:  # the end time is taken when the process exits, not when the caller asks
        proc.wait()
        ended.update(wall_s=time.perf_counter() - t0, load_after=os.getloadavg()[0])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    def wait() -> Dict[str, float]:
        watcher.join()
        out.close()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}; its output: {log}")
        return {"load_before": load_before, **ended}

    return wait


def start_plain(baseline: Path, model_dir: Path, steps: int, work: Path):
    script = baseline / "grpo.py"
    if not script.is_file():
        raise FileNotFoundError(f"--baseline-dir {baseline}: no grpo.py there (the plain GRPO loop)")
    out = work / "plain.json"
    cmd = [sys.executable, str(script), "--P", "4", "--G", "8", "--bf16", "--skip_zero", "--lr", "2e-5",
           "--steps", str(steps), "--eval", "0", "--out", str(out)]
    env = {**os.environ, "SMOLLM2_DIR": str(model_dir)}
    wait = start(cmd, baseline, env, work / "plain.log")

    def finish() -> Dict[str, float]:
        res = wait()
        res.update(first_last([s["reward"] for s in json.loads(out.read_text())["steps"]]))
        return res

    return finish


def start_ours(steps: int, work: Path):
    out = work / "ours"
    cmd = [sys.executable, "-m", "verl_fast", "train", "--output_dir", str(out),
           "--set", f"trainer.total_steps={steps}"]
    wait = start(cmd, work, dict(os.environ), work / "ours.log")

    def finish() -> Dict[str, float]:
        res = wait()
        res.update(read_ours(out))
        return res

    return finish


def read_ours(out: Path) -> Dict[str, float]:
    res: Dict[str, float] = {}
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    res.update(first_last([r["reward/mean"] for r in records if "reward/mean" in r]))
    res["loop_s"] = sum(r.get("time/step", 0.0) for r in records)
    syncs = sorted(r["time/weight_sync"] for r in records if "time/weight_sync" in r)
    res["weight_sync_s"] = syncs[len(syncs) // 2] if syncs else None  # the median step's
    return res


def run(steps: int = 25, repeats: int = 1, baseline_dir: str = DEFAULT_BASELINE, concurrent: bool = False,
        work_dir: Optional[str] = None) -> Report:
    from verl_fast.models.demo import demo_model_path

    model_dir = demo_model_path()
    report = Report("default_run", "cpu", meta={"steps": steps, "baseline": str(baseline_dir), "runs": [],
                                                "concurrent": concurrent})
    with tempfile.TemporaryDirectory(prefix="vf_default_run_") as tmp:
        for i in range(repeats):
            work = Path(work_dir or tmp) / f"r{i}"
            work.mkdir(parents=True, exist_ok=True)
            if concurrent:  # both at once: on a shared, busy machine both then see the same load
                finish_plain, finish_ours = start_plain(Path(baseline_dir), model_dir, steps, work), start_ours(steps, work)
                plain, ours = finish_plain(), finish_ours()
            else:
                plain = start_plain(Path(baseline_dir), model_dir, steps, work)()
                ours = start_ours(steps, work)()
            report.meta["runs"].append({"plain": plain, "ours": ours})
            note = "reward first5 {first5:.3f} -> last5 {last5:.3f}; load {load_before:.1f}->{load_after:.1f}"
            report.add(CASE, "plain GRPO loop (HF generate)", plain["wall_s"] * 1e3, note=note.format(**plain))
            report.add(CASE, "verl_fast train", ours["wall_s"] * 1e3,
                       note=note.format(**ours) + f"; loop {ours['loop_s']:.1f} s")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--repeats", type=int, default=1, help="alternate plain, ours this many times")
    p.add_argument("--baseline-dir", default=DEFAULT_BASELINE, help="folder holding the plain loop's grpo.py")
    p.add_argument("--device", default="cpu", choices=["cpu"], help="the default run is a CPU job")
    p.add_argument("--quick", action="store_true", help="3 steps (a smoke run, not the measurement)")
    p.add_argument("--concurrent", action="store_true",
                   help="run both at the same time (a shared machine: both see the same load)")
    p.add_argument("--work", help="keep the runs' logs and outputs here (default: a temporary folder)")
    args = p.parse_args(argv)
    report = run(3 if args.quick else args.steps, args.repeats, args.baseline_dir, args.concurrent, args.work)
    print(report.table())
    for row in report.rows:
        print(f"  {row.impl:<30} {row.ms / 1e3:7.1f} s  {row.note}")
    print(f"saved {report.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
