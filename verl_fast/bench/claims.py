"""The seed documents' headline claims (their A100 figures), each beside what we measured, with the
hardware it was measured on. A claim without a measurement in this run says where it would come from.

Sources, by the report they are read from:
- in-process vs HTTP rollout, P99 latency with length bucketing, colocated throughput: the
  ``claims`` benchmark (benchmarks/bench_claims.py), rows by case name;
- batch utilisation: the ``schedule`` benchmark's packing quality (fixed-count micro-batches against
  ours, padded token utilisation);
- train/rollout switch: a report row whose case names the switch or the weight sync (the hybrid
  engine's benchmark), else the default run's mean per-step weight sync.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, Iterator, List, Optional, Tuple

SEED = {
    "inprocess_vs_http": ("in-process rollout vs the same vLLM behind HTTP", "3.2x faster"),
    "p99_bucketing": ("P99 rollout latency, without -> with length bucketing", "1.2 s -> 0.43 s"),
    "colocated": ("colocated rollout throughput / bare engine", "93%"),
    "utilisation": ("batch utilisation, fixed -> ours", "63% -> 89%"),
    "switch": ("train/rollout switch time", "2.3 s -> 87 ms (8xA100)"),
}


def _reports(results: Dict[str, Any], op: Optional[str] = None) -> Iterator[Tuple[str, Dict[str, Any]]]:
    for rec in results.get("ops", []):
        if op is None or rec["op"] == op:
            for rep in rec.get("reports", []):
                yield rec["op"], rep


def _rows(results: Dict[str, Any], op: str, case: str) -> Dict[str, Dict[str, Any]]:
    return {r["impl"]: r for _, rep in _reports(results, op) for r in rep.get("rows", []) if r["case"] == case}


def _hardware(rep_or_results: Dict[str, Any], default: str) -> str:
    env = rep_or_results.get("environment") or {}
    return env.get("device") or default


def _claims_bench(results: Dict[str, Any], device: str) -> List[Dict[str, Any]]:
    out = []
    meta = next((rep.get("meta", {}) for _, rep in _reports(results, "claims")), {})
    hw = meta.get("hardware", device)
    rows = _rows(results, "claims", "rollout in-process vs HTTP")
    inproc, http = rows.get("verl_fast in-process vLLM"), rows.get("vLLM OpenAI HTTP server")
    if inproc and http:
        out.append(_claim("inprocess_vs_http", f"{http['ms'] / inproc['ms']:.2f}x (per batch: HTTP {http['ms'] / 1e3:.2f} s, "
                                               f"in-process {inproc['ms'] / 1e3:.2f} s)", hw, "claims"))
    rows = _rows(results, "claims", "P99 rollout latency")
    plain, bucketed = rows.get("one batch, no bucketing"), rows.get("verl_fast length buckets")
    if plain and bucketed:
        out.append(_claim("p99_bucketing", f"{plain['ms'] / 1e3:.2f} s -> {bucketed['ms'] / 1e3:.2f} s", hw, "claims"))
    rows = _rows(results, "claims", "rollout throughput, colocated")
    bare, colo = rows.get("bare engine"), rows.get("verl_fast colocated with training")
    if bare and colo:
        out.append(_claim("colocated", f"{bare['ms'] / colo['ms']:.0%}", hw, "claims"))
    return out


def _utilisation(results: Dict[str, Any], device: str) -> Optional[Dict[str, Any]]:
    fixed, ours = [], []
    for _, rep in _reports(results, "schedule"):
        for q in rep.get("meta", {}).get("quality", []):
            if not str(q.get("case", "")).startswith("pack") or q.get("padded_util") is None:
                continue
            if str(q.get("plan", "")).startswith("fixed"):
                fixed.append(q["padded_util"])
            elif q.get("plan") == "verl_fast padded layout":
                ours.append(q["padded_util"])
        if fixed and ours:
            return _claim("utilisation", f"{statistics.median(fixed):.0%} -> {statistics.median(ours):.0%} "
                                         "(padded tokens, GSM8K+Alpaca-like mix)", _hardware(rep, device), "schedule")
    return None


def _switch(results: Dict[str, Any], device: str) -> Optional[Dict[str, Any]]:
    for op, rep in _reports(results):
        for r in rep.get("rows", []):
            text = f"{r['case']} {r['impl']}".lower()
            if op != "default_run" and str(r["impl"]).startswith("verl_fast") and ("switch" in text or "weight sync" in text):
                return _claim("switch", f"{r['ms']:.3g} ms ({r['case']})", _hardware(rep, device), op)
    for _, rep in _reports(results, "default_run"):
        syncs = [run["ours"].get("weight_sync_s") for run in rep.get("meta", {}).get("runs", [])]
        syncs = [s for s in syncs if s is not None]
        if syncs:
            return _claim("switch", f"{statistics.median(syncs) * 1e3:.0f} ms per step (weight sync into vLLM, "
                                    "SmolLM2-135M)", _hardware(rep, device), "default_run")
    return None


def _claim(key: str, measured: str, hardware: str, source: str) -> Dict[str, Any]:
    claim, seed = SEED[key]
    return {"key": key, "claim": claim, "seed": seed, "measured": measured, "hardware": hardware, "source": source}


def collect(results: Dict[str, Any], device: str) -> List[Dict[str, Any]]:
    """One entry per seed claim: ours where this run measured it, else 'not measured in this run'."""
    found = {c["key"]: c for c in _claims_bench(results, device)}
    for c in (_utilisation(results, device), _switch(results, device)):
        if c is not None:
            found[c["key"]] = c
    return [found.get(k) or _claim(k, "not measured in this run", "-", "-") for k in SEED]
