"""The benchmark report: one results JSON per run, one table, a Markdown page and a PNG chart.

Results JSON (``<device>-<date>.json``)::

    {"schema": 1, "time": ISO time, "device": "cpu" | "cuda", "quick": bool,
     "environment": {"device": name, "torch", "cuda", "triton", "python", "load_before"},
     "ops": [{"op", "status": ok|failed|missing|skipped, "seconds", "reports": [Report JSON, ...]}],
     "summary": [{"op", "case", "baseline", "baseline_ms", "floor_ms", "ours", "ours_ms", "speedup",
                  "over_floor", "ours_extra_bytes", "spread"}],
     "claims": [{"claim", "seed", "measured", "hardware", "source"}]}

"claims" holds the design targets (figures claimed on A100s, under the key "seed") beside ours.

python -m verl_fast.bench.report [DIR] rebuilds the Markdown and PNG from the latest results JSON in
DIR (the same as ``verl-fast bench --report-only``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from verl_fast.bench import claims as claims_mod
from verl_fast.bench.paths import default_out_dir
from verl_fast.bench.timing import cpu_load

SCHEMA = 1
RESULTS_NAME = re.compile(r"^(cpu|cuda)-\d{4}-\d{2}-\d{2}(?:_\d+)?\.json$")


def environment(device: str) -> Dict[str, Any]:
    import torch

    env: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "python": platform.python_version(), "load_before": cpu_load()}
    env["device"] = device_name(device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the CPU model and its core count."""
    import os

    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def summarize_report(op: str, rep: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per case: the first baseline, the fastest of ours (impl ``verl_fast...``), the floor. An impl
    timed several times in one report (repeats of a whole run) counts by its median row."""
    floors = rep.get("floors_ms") or {}
    cases: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for row in rep.get("rows", []):
        if isinstance(row.get("ms"), (int, float)):
            cases.setdefault(row["case"], {}).setdefault(row["impl"], []).append(row)
    out = []
    for case, impls in cases.items():
        rows = [sorted(repeats, key=lambda r: r["ms"])[(len(repeats) - 1) // 2] for repeats in impls.values()]
        ours = [r for r in rows if str(r["impl"]).startswith("verl_fast")]
        base = [r for r in rows if not str(r["impl"]).startswith("verl_fast")]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["ms"])
        b = base[0] if base else None
        floor = floors.get(case)
        out.append({"op": op, "case": case, "baseline": b["impl"] if b else None,
                    "baseline_ms": b["ms"] if b else None, "floor_ms": floor, "ours": best["impl"],
                    "ours_ms": best["ms"], "speedup": b["ms"] / best["ms"] if b and best["ms"] > 0 else None,
                    "over_floor": best["ms"] / floor if floor else None,
                    "ours_extra_bytes": best.get("extra_bytes"), "spread": best.get("spread"),
                    "hardware": (rep.get("environment") or {}).get("device")})
    return out


def build_results(records: List[Dict[str, Any]], device: str, quick: bool) -> Dict[str, Any]:
    summary = [row for r in records for rep in r.get("reports", []) for row in summarize_report(r["op"], rep)]
    env = environment(device)
    results = {"schema": SCHEMA, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": device, "quick": quick,
               "environment": env, "ops": records, "summary": summary}
    results["claims"] = claims_mod.collect(results, env["device"])
    return results


def save_results(results: Dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{results['device']}-{results['time'][:10]}"
    path, i = out / f"{stem}.json", 1
    while path.exists():  # several runs in one day keep their own files
        path, i = out / f"{stem}_{i}.json", i + 1
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return path


def latest_results(out: Path) -> Optional[Path]:
    found = [p for p in out.glob("*.json") if RESULTS_NAME.match(p.name)] if out.is_dir() else []
    return max(found, key=lambda p: (json.loads(p.read_text()).get("time", ""), p.name)) if found else None


def _fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return ""
    if ms >= 10_000:
        return f"{ms / 1e3:.1f} s"
    return f"{ms:.4g} ms"


def _fmt_x(x: Optional[float]) -> str:
    return f"{x:.2f}x" if x is not None else ""


def _spread(row: Dict[str, Any]) -> str:
    s = row.get("spread")
    return f"{s['p10_ms']:.3g}-{s['p90_ms']:.3g} ({s['runs']})" if s else ""


def table_rows(results: Dict[str, Any]) -> Tuple[List[str], List[List[str]]]:
    head = ["op", "case", "baseline", "floor", "ours", "baseline/ours", "ours/floor", "ours p10-p90 ms (runs)",
            "measured on"]
    rows = [[r["op"], r["case"], f"{r['baseline'] or ''} {_fmt_ms(r['baseline_ms'])}".strip(),
             _fmt_ms(r["floor_ms"]), _fmt_ms(r["ours_ms"]), _fmt_x(r["speedup"]), _fmt_x(r["over_floor"]),
             _spread(r), r.get("hardware") or ""] for r in results["summary"]]
    return head, rows


def render_table(results: Dict[str, Any]) -> str:
    head, rows = table_rows(results)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    env = results["environment"]
    out = [f"verl-fast bench on {env['device']} ({results['time']}, load {env.get('load_before')})",
           line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    for op in results["ops"]:
        if op["status"] != "ok":
            out.append(f"{op['op']}: {op['status']} {op.get('reason', '')}".rstrip())
    if results.get("claims"):
        out.append("\ndesign targets (claimed on A100) beside ours:")
        out += [f"  {c['claim']}: target {c['seed']}; ours {c['measured']} [{c['hardware']}]" for c in results["claims"]]
    return "\n".join(out)


def markdown(results: Dict[str, Any]) -> str:
    head, rows = table_rows(results)
    env = results["environment"]
    lines = [f"# verl-fast bench: {env['device']}", "",
             f"{results['time']}; torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}, "
             f"Python {env['python']}; load average {env.get('load_before')}"
             + ("; --quick sizes" if results.get("quick") else ""), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    lines += ["", "| op | status | seconds |", "|---|---|---|"]
    lines += [f"| {o['op']} | {o['status']} {o.get('reason', '')} | {o.get('seconds', 0):.1f} |" for o in results["ops"]]
    if results.get("claims"):
        lines += ["", "## Design targets (claimed on A100) beside ours", "",
                  "| claim | target (A100) | ours | hardware | source |", "|---|---|---|---|---|"]
        lines += [f"| {c['claim']} | {c['seed']} | {c['measured']} | {c['hardware']} | {c['source']} |"
                  for c in results["claims"]]
    return "\n".join(lines) + "\n"


def chart(results: Dict[str, Any], path: Path) -> Path:
    """Horizontal bars per case: baseline, ours and floor (log scale, milliseconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["summary"]
    labels = [f"{r['op']}: {r['case']}"[:60] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.45 * max(len(rows), 1)))
    bars = (("baseline_ms", "baseline", "#bbbbbb"), ("ours_ms", "verl_fast", "#1f77b4"), ("floor_ms", "floor", "#2ca02c"))
    h = 0.27
    for k, (key, name, color) in enumerate(bars):
        ys = [i + (k - 1) * h for i in range(len(rows))]
        ax.barh(ys, [r[key] or 0 for r in rows], height=h, label=name, color=color)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    if any(r["ours_ms"] for r in rows):
        ax.set_xscale("log")
    ax.set_xlabel("milliseconds (log scale; shorter is better)")
    ax.set_title(f"verl-fast bench, {results['environment']['device']}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: Dict[str, Any], out: Path, stem: str) -> Tuple[Path, Optional[Path]]:
    """The Markdown page, and the PNG chart where matplotlib is installed (else None)."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{stem}.md"
    md.write_text(markdown(results))
    try:
        return md, chart(results, out / f"{stem}.png")
    except ImportError as error:
        print(f"no PNG chart: {error} (pip install matplotlib)")
        return md, None


def regenerate(out: Path) -> Tuple[Path, Dict[str, Any], Path, Optional[Path]]:
    """Markdown and PNG again from the latest results JSON in ``out``."""
    latest = latest_results(out)
    if latest is None:
        raise SystemExit(f"no <device>-<date>.json in {out}; run `verl-fast bench` first")
    results = json.loads(latest.read_text())
    md, png = write_report(results, out, latest.stem)
    return latest, results, md, png


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="rebuild the benchmark report from the latest results JSON")
    p.add_argument("out", nargs="?", help="results folder (default: a checkout's benchmarks/results, else here)")
    args = p.parse_args(argv)
    latest, _, md, png = regenerate(Path(args.out) if args.out else default_out_dir())
    print(f"results: {latest}\nreport: {md}\nchart: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
