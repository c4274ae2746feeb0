"""`verl-fast bench`: runs the benchmarks by name, each in a process of its own.

The suite ships in the package (``python -m verl_fast.bench.ops_<op>``: the advantages, the log-prob
kernels, the scheduler, an end-to-end GRPO step) and runs from a plain install; the other ops are
benchmarks/bench_<op>.py scripts of a source checkout, reported "missing" without one.

A benchmark saves its Report JSON files under ``$VF_BENCH_RESULTS``; the runner points that at
a private folder per op, collects what each wrote, and hands everything to the report (one table,
``<device>-<date>.json``, Markdown, PNG). A process per op keeps one benchmark's state (vLLM inside
the process, thread settings, allocator caches) out of the next one's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from verl_fast.bench import report as report_mod
from verl_fast.bench.paths import benchmarks_dir, default_out_dir
from verl_fast.bench.timing import cpu_load


@dataclass(frozen=True)
class Op:
    script: Optional[str] = None  # a benchmarks/ script of a checkout
    module: Optional[str] = None  # else a module of this package, verl_fast.bench.<module>
    device_flag: bool = True  # takes --device
    quick: Sequence[str] = ("--quick",)  # extra arguments under --quick
    full: Sequence[str] = ()  # extra arguments without --quick
    timeout_s: int = 1800
    devices: Sequence[str] = ("cpu", "cuda")
    extra: Dict[str, Sequence[str]] = field(default_factory=dict)  # per-device extra arguments


OPS: Dict[str, Op] = {
    "gae": Op(module="ops_advantage"),
    "logprob": Op(module="ops_logprob", quick=("--tokens", "64", "--hidden", "64", "--vocab", "1024", "--no-sweep")),
    "schedule": Op(module="ops_schedule", device_flag=False),
    "step": Op(module="ops_step"),
    "reshard": Op("bench_reshard.py", quick=("--only", "1")),
    "rollout": Op("bench_rollout.py", quick=("--models", "tiny", "--rep", "2")),
    "e2e": Op("bench_e2e.py", quick=("--tiny",)),
    "claims": Op("bench_claims.py"),
    "default_run": Op("bench_default_run.py", devices=("cpu",)),
}
QUICK_OPS = ("gae", "logprob", "schedule", "step")
# the op each script's saved Report belongs to, by the report name's first word
REPORT_OPS = {"advantage": "gae", "bench": "logprob", "schedule": "schedule", "reshard": "reshard",
              "weight": "reshard", "rollout": "rollout", "e2e": "e2e", "claims": "claims", "default": "default_run",
              "step": "step"}
DEFAULT_OPS = {"cpu": ("gae", "logprob", "schedule", "step", "reshard", "rollout", "claims", "default_run"),
               "cuda": ("gae", "logprob", "step", "reshard", "e2e")}


def op_command(name: str, device: str, quick: bool, folder: Optional[Path]) -> List[str]:
    op = OPS[name]
    cmd = [sys.executable, "-m", f"verl_fast.bench.{op.module}"] if op.module else \
        [sys.executable, str(folder / op.script)]
    if op.device_flag:
        cmd += ["--device", device]
    cmd += list(op.quick if quick else op.full)
    return cmd + list(op.extra.get(device, ()))


def run_op(name: str, device: str, quick: bool, folder: Optional[Path], echo: bool = True) -> Dict[str, object]:
    """Runs one benchmark (``folder``: the checkout's benchmarks/, None without a checkout); returns
    its status, wall time, load, output tail and saved reports."""
    op = OPS[name]
    record: Dict[str, object] = {"op": name, "script": op.script or f"verl_fast.bench.{op.module}", "reports": []}
    if device not in op.devices:
        return {**record, "status": "skipped", "reason": f"runs on {'/'.join(op.devices)} only"}
    if op.script and (folder is None or not (folder / op.script).is_file()):
        where = folder or "this folder: it runs from a clone of the repository"
        return {**record, "status": "missing", "reason": f"{op.script} is not in {where}"}
    cmd = op_command(name, device, quick, folder)
    with tempfile.TemporaryDirectory(prefix=f"vf_bench_{name}_") as tmp:
        env = {**os.environ, "VF_BENCH_RESULTS": tmp, "PYTHONUNBUFFERED": "1"}
        env.pop("VF_BENCH_SUMMARY", None)
        load, start = cpu_load(), time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=folder or tmp, capture_output=True, text=True, timeout=op.timeout_s)
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            output, code = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {op.timeout_s} s", -1
        record.update(seconds=time.perf_counter() - start, load_before=load, load_after=cpu_load(),
                      command=" ".join(cmd), status="ok" if code == 0 else "failed", returncode=code,
                      output_tail=output[-4000:])
        record["reports"] = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json"))]
    if echo:
        print(f"[{name}] {record['status']} in {record['seconds']:.1f} s (load {load})", flush=True)
        if code != 0:
            print(output[-2000:], flush=True)
    return record


def collect_saved(folder: Path, device: str, ops: List[str]) -> List[Dict[str, object]]:
    """Records of ``ops`` from the Report JSONs already saved in ``folder`` (``<name>_<device>.json``)."""
    records: Dict[str, Dict[str, object]] = {name: {"op": name, "status": "missing", "reports": [],
                                                    "reason": f"no saved report in {folder}"} for name in ops}
    for path in sorted(folder.glob(f"*_{device}.json")):
        rep = json.loads(path.read_text())
        op = REPORT_OPS.get(str(rep.get("name", "")).split("_")[0])
        if op in records:
            rec = records[op]
            rec.update(status="ok", reason=f"saved {rep.get('time', '')}", seconds=0.0)
            rec["reports"].append(rep)
    return list(records.values())


def parse_ops(text: Optional[str], device: str, quick: bool) -> List[str]:
    if not text:
        return list(QUICK_OPS if quick else DEFAULT_OPS[device])
    ops = [o.strip() for o in text.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise SystemExit(f"--ops: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(OPS)}")
    return ops


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", help=f"comma list of {', '.join(OPS)} (default: all that run on the device; "
                                 f"with --quick: {','.join(QUICK_OPS)})")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--quick", action="store_true", help="small sizes (CI on the CPU, about a minute)")
    p.add_argument("--out", help="results folder (default: a checkout's benchmarks/results, else the current folder)")
    p.add_argument("--collect", action="store_true",
                   help="run nothing: one results JSON from the <name>_<device>.json files the scripts saved in DIR")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the Markdown and PNG from the latest results JSON")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else default_out_dir()
    if args.report_only:
        latest, results, md, png = report_mod.regenerate(out)
        print(report_mod.render_table(results))
        print(f"results: {latest}\nreport: {md}\nchart: {png}")
        return 0
    device = args.device or ("cuda" if _cuda() else "cpu")
    folder = benchmarks_dir()
    ops = parse_ops(args.ops, device, args.quick)
    records = collect_saved(out, device, ops) if args.collect else [run_op(name, device, args.quick, folder) for name in ops]
    results = report_mod.build_results(records, device, args.quick)
    latest = report_mod.save_results(results, out)
    print(report_mod.render_table(results))
    md, png = report_mod.write_report(results, out, latest.stem)
    print(f"results: {latest}\nreport: {md}\nchart: {png}")
    failed = [r["op"] for r in results["ops"] if r["status"] == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
