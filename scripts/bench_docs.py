"""Rewrites the generated block of docs/benchmarks.md (between its markers) from the latest
`verl-fast bench` results JSON; with ``--e2e``, the GRPO-step rows at users' lengths in README.md and
docs/benchmarks.md (their own markers) from ``bench_e2e``'s ragged / demo results
(``e2e_ragged_<row>_cuda.json``, gpu_run.sh's ragged section). The hand-written tables around them stay.

    python scripts/bench_docs.py [RESULTS_DIR] [--page docs/benchmarks.md]
    python scripts/bench_docs.py --e2e [RESULTS_DIR]
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

from verl_fast.bench import report

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- verl-fast bench: begin (generated) -->", "<!-- verl-fast bench: end -->"
E2E_BEGIN, E2E_END = "<!-- bench_e2e ragged: begin (generated) -->", "<!-- bench_e2e ragged: end -->"
E2E_PAGES = (ROOT / "README.md", PAGE)
E2E_ORDER = ("demo", "cap1k_trl", "cap1k_partial", "cap1k_partial_05b", "cap1k", "cap4k", "cap8k", "7b4k", "7b4k_trl", "uniform")  # users' shapes first
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
    replace_block(page, BEGIN, END, block(results, source))


def replace_block(page: Path, begin: str, end: str, content: str) -> None:
    """``content`` (markers included) in place of ``page``'s block between ``begin`` and ``end``."""
    text = page.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{page}: no generated block (the lines {begin} ... {end}) to rewrite")
    start, stop = text.index(begin), text.index(end) + len(end)
    page.write_text(text[:start] + content + text[stop:])


def _n(value: Any, spec: str, unit: str = "") -> str:
    return f"{format(value, spec)}{unit}" if isinstance(value, (int, float)) else ""


def e2e_rows(results: Dict[str, Any], source: str) -> List[str]:
    """One table row per run of one ragged / demo results file."""
    lines, device = [], results["meta"].get("device_name", "")
    for label, meta in results["meta"].items():
        if not isinstance(meta, dict) or "runs" not in meta:
            continue
        trl = (meta["runs"].get("trl_vllm") or {}).get("step_s")
        for key, run in meta["runs"].items():
            got, d = run.get("lengths") or {}, (run.get("lengths") or {}).get("distribution") or {}
            if run.get("step_s") is None:
                if run.get("failure"):
                    lines.append(f"| {label} | {key} | {run['failure'][:80]} |" + " |" * 7)
                continue
            ours = key.startswith("ours")
            gen = (run.get("phases_s") or {}).get("generation")
            floor = got.get("decode_floor_s")
            steps = f"{_n(got.get('decode_steps'), '.0f')} / {_n(d.get('mean'), '.0f')}" if got else ""
            spread = (f"{d.get('median', '')} / {d.get('p90', '')} / {d.get('p99', '')} / {d.get('max', '')} / "
                      f"{_n(100 * d['at_cap'], '.1f', '%')}") if d else ""
            lines.append(
                f"| {label} | {'verl_fast, defaults' if key in ('ours', 'ours:default') else key} | {_n(run['step_s'], '.2f', ' s')} | "
                f"{_n(run['step_s'] / trl if ours and trl else (1 if key == 'trl_vllm' else None), '.2f', 'x')} | "
                f"{_n(gen, '.2f', ' s')}{f' ({floor:.2f} s)' if floor else ''} | "
                f"{_n(got.get('generated_tokens_per_s_of_generation') if ours else got.get('generated_tokens_per_s_of_step'), ',.0f')} | "
                f"{steps} | {spread} | {_n(run.get('peak_memory_gib'), '.1f')} | "
                f"`{source}`, {device}, {results['time'][:10]} |")
    return lines


def e2e_block(folder: Path) -> str:
    """The generated rows at users' lengths, ragged / demo files in E2E_ORDER (users' shapes first)."""
    files = {p.name[len("e2e_ragged_"):-len("_cuda.json")]: p for p in folder.glob("e2e_ragged_*_cuda.json")}
    order = [r for r in E2E_ORDER if r in files] + sorted(set(files) - set(E2E_ORDER))
    head = ["shape @ cap", "run", "step", "/ TRL vLLM", "generation (decode floor)", "generated tok/s",
            "decode steps / mean length", "length median / p90 / p99 / max / at cap", "peak GiB", "measured"]
    lines = [E2E_BEGIN, "GRPO steps at users' lengths, ours (defaults) beside TRL 1.16 + vLLM colocate where the same "
             "warm machine ran it (`benchmarks/bench_e2e.py --lengths ragged`, `--shapes demo`; generated by `python "
             "scripts/bench_docs.py --e2e`; generated tok/s: of our generation phase, of TRL's whole step; an "
             "empty / TRL vLLM cell: TRL was not run on that machine):", ""]
    if not order:
        return "\n".join(lines + ["No results yet: `SECTIONS=ragged bash benchmarks/gpu_run.sh` on the GPU machine, "
                                  "then `python scripts/bench_docs.py --e2e`.", E2E_END])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in order:
        results = json.loads(files[row].read_text())
        lines += e2e_rows(results, files[row].name)
    return "\n".join(lines + [E2E_END])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    p.add_argument("--page", default=str(PAGE), help="the page whose block to rewrite")
    p.add_argument("--e2e", action="store_true", help="rewrite the rows at users' lengths in README.md and "
                   "docs/benchmarks.md from the e2e_ragged_*_cuda.json results instead")
    args = p.parse_args(argv)
    if args.e2e:
        content = e2e_block(Path(args.results))
        for page in E2E_PAGES:
            replace_block(page, E2E_BEGIN, E2E_END, content)
            print(f"{page}: rows at users' lengths rewritten from {args.results}")
        return 0
    latest = report.latest_results(Path(args.results))
    if latest is None:
        raise SystemExit(f"no <device>-<date>.json in {args.results}; run `verl-fast bench` first")
    update(Path(args.page), json.loads(latest.read_text()), latest.name)
    print(f"{args.page}: block rewritten from {latest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
