"""Rewrites the generated block of docs/benchmarks.md (between its markers) from the latest
`verl-fast bench` results JSON; the hand-written tables around it stay.

    python scripts/bench_docs.py [RESULTS_DIR] [--page docs/benchmarks.md]
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict

from verl_fast.bench import report

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- verl-fast bench: begin (generated) -->", "<!-- verl-fast bench: end -->"
ROWS_PER_OP = 3  # the full table is in the Markdown report beside the results JSON


def _load(env: Dict[str, Any]) -> str:
    load = env.get("load_before")
    return f"{load:.1f}" if isinstance(load, (int, float)) else "unknown"


def block(results: Dict[str, Any], source: str) -> str:
    """The generated block: up to ROWS_PER_OP rows per op, then the design targets beside ours."""
    head = ["op", "case", "baseline", "floor", "ours", "baseline/ours", "measured on"]
    lines = [BEGIN, f"Latest `verl-fast bench` results ({results['time'][:10]}, load average "
             f"{_load(results['environment'])} when written; `benchmarks/results/{source}`, every case in the "
             "`.md` beside it; regenerate this block with `python scripts/bench_docs.py`):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown: Dict[str, int] = {}
    for r in results["summary"]:
        shown[r["op"]] = shown.get(r["op"], 0) + 1
        if shown[r["op"]] > ROWS_PER_OP:
            continue
        lines.append(f"| {r['op']} | {r['case']} | {r['baseline'] or ''} {report._fmt_ms(r['baseline_ms'])} | "
                     f"{report._fmt_ms(r['floor_ms'])} | {report._fmt_ms(r['ours_ms'])} | "
                     f"{report._fmt_x(r['speedup'])} | {r.get('hardware') or ''} |")
    if results.get("claims"):
        lines += ["", "| design target | claimed (A100) | ours | hardware |", "|---|---|---|---|"]
        lines += [f"| {c['claim']} | {c['seed']} | {c['measured']} | {c['hardware']} |" for c in results["claims"]]
    return "\n".join(lines + [END])


def update(page: Path, results: Dict[str, Any], source: str) -> None:
    """Replaces the block between the markers of ``page``; raises naming the page when it has none."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{page}: no generated block (the lines {BEGIN} ... {END}) to rewrite")
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    page.write_text(text[:start] + block(results, source) + text[stop:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    p.add_argument("--page", default=str(PAGE), help="the page whose block to rewrite")
    args = p.parse_args(argv)
    latest = report.latest_results(Path(args.results))
    if latest is None:
        raise SystemExit(f"no <device>-<date>.json in {args.results}; run `verl-fast bench` first")
    update(Path(args.page), json.loads(latest.read_text()), latest.name)
    print(f"{args.page}: block rewritten from {latest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
