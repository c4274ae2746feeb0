"""The benchmark harness (verl_fast.bench): timing, peak memory, the runner, the results JSON, the
Markdown / PNG report, `verl-fast bench` on the command line (which runs the scripts of a source
checkout), and the generated block of docs/benchmarks.md (scripts/bench_docs.py)."""

import importlib.util
import json
import textwrap
import time
from pathlib import Path

import pytest
import torch

from verl_fast.bench import claims, paths, report, runner
from verl_fast.bench.shapes import SHAPES, shape
from verl_fast.bench.timing import CPU_CACHE_BYTES, measure, peak_memory, rotating, summarize
from verl_fast.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _bench_docs():
    spec = importlib.util.spec_from_file_location("bench_docs", ROOT / "scripts" / "bench_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measure_times_a_known_sleep():
    stats = measure(lambda: time.sleep(0.03), warmup=1, rep=5)
    assert stats.runs == 5
    assert 30.0 <= stats.min_ms <= stats.p10_ms <= stats.median_ms <= stats.p90_ms
    assert stats.median_ms < 30.0 * 4  # a loaded machine oversleeps, but not by 4x
    short = measure(lambda: time.sleep(0.003), warmup=1, rep=5)
    assert short.median_ms < stats.median_ms


def test_measure_rotates_inputs_and_stops_at_the_deadline():
    seen = []
    stats = measure(seen.append, inputs=["a", "b", "c"], warmup=2, rep=4)
    assert seen == ["a", "b", "c", "a", "b", "c"] and stats.runs == 4
    assert measure(lambda: time.sleep(0.02), rep=50, warmup=0, max_seconds=0.05).runs < 10
    with pytest.raises(ValueError, match="inputs"):
        measure(lambda x: x, inputs=[])


def test_summarize_against_plain_percentiles():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    stats = summarize(values)
    ordered = sorted(values)

    def pct(q):  # linear interpolation between the two closest ranks
        k = (len(ordered) - 1) * q
        lo = int(k)
        return ordered[lo] + (ordered[min(lo + 1, len(ordered) - 1)] - ordered[lo]) * (k - lo)

    assert stats.median_ms == pytest.approx((3.0 + 4.0) / 2)
    assert stats.p10_ms == pytest.approx(pct(0.1)) and stats.p90_ms == pytest.approx(pct(0.9))
    assert stats.min_ms == 1.0 and stats.runs == 6


def test_rotating_inputs_outgrow_the_cache():
    nbytes = 32 << 20
    inputs = rotating(lambda i: i, nbytes)
    assert len(inputs) * nbytes > CPU_CACHE_BYTES and inputs[:3] == [0, 1, 2]


def test_peak_memory_of_a_known_allocation():
    size = 96 << 20

    def allocate():
        x = torch.ones(size // 4, dtype=torch.float32)  # written, so resident
        return float(x[-1])

    peak = peak_memory(allocate)
    if peak is None:
        pytest.skip("no /proc/self/clear_refs on this system")
    assert size * 0.9 <= peak <= size + (64 << 20)
    assert peak_memory(lambda: None) < size // 4


def test_shapes_registry():
    assert {"Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B", "Llama-3-8B", "Qwen3-30B-A3B"} <= set(SHAPES)
    assert shape("Qwen2.5-7B").params() == pytest.approx(7.62e9, rel=0.01)
    assert shape("Llama-3-8B").params() == pytest.approx(8.03e9, rel=0.01)
    with pytest.raises(KeyError, match="Qwen2.5-7B"):
        shape("qwen-7b")


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen3-4B", "Qwen2.5-1.5B"])
def test_shape_params_match_the_built_model(name):
    # the count a benchmark's MFU divides by, against the model transformers builds from the shape
    # (Qwen3's per-head query / key norms included)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    s = shape(name)
    cls = Qwen3Config if s.qk_norm else Qwen2Config
    cfg = cls(vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
              intermediate_size=s.intermediate_size, num_attention_heads=s.num_heads,
              num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, tie_word_embeddings=s.tied_embeddings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert s.params() == sum(p.numel() for p in model.parameters())


def _fake_report(name="fake"):
    return {"name": name, "environment": {"device": "test cpu"}, "floors_ms": {"case a": 1.0},
            "meta": {"quality": [{"case": "pack n=8", "plan": "fixed 4 seqs/micro-batch", "padded_util": 0.5},
                                 {"case": "pack n=8", "plan": "verl_fast padded layout", "padded_util": 0.98}]},
            "rows": [{"case": "case a", "impl": "python loop", "ms": 40.0},
                     {"case": "case a", "impl": "verl_fast eager", "ms": 4.0},
                     {"case": "case a", "impl": "verl_fast graph", "ms": 2.0,
                      "spread": {"median_ms": 2.0, "p10_ms": 1.9, "p90_ms": 2.5, "min_ms": 1.8, "runs": 10}}]}


def test_results_schema_report_files_and_docs_block(tmp_path):
    records = [{"op": "schedule", "status": "ok", "seconds": 1.5, "reports": [_fake_report()]},
               {"op": "e2e", "status": "missing", "reason": "bench_e2e.py is not here", "reports": []}]
    results = report.build_results(records, "cpu", quick=True)
    assert {"schema", "time", "device", "quick", "environment", "ops", "summary", "claims"} <= set(results)
    (row,) = results["summary"]
    assert row["baseline"] == "python loop" and row["ours"] == "verl_fast graph"
    assert row["speedup"] == pytest.approx(20.0) and row["over_floor"] == pytest.approx(2.0)
    util = next(c for c in results["claims"] if c["key"] == "utilisation")
    assert util["measured"].startswith("50% -> 98%") and util["seed"] == "63% -> 89%"
    assert len(results["claims"]) == len(claims.SEED)

    path = report.save_results(results, tmp_path)
    assert path.name == f"cpu-{results['time'][:10]}.json"
    assert report.save_results(results, tmp_path).name.endswith("_1.json")  # a second run that day
    assert json.loads(path.read_text())["summary"] == json.loads(json.dumps(results["summary"]))
    md, png = report.write_report(results, tmp_path, path.stem)
    assert "| schedule | case a | python loop 40 ms | 1 ms | 2 ms | 20.00x | 2.00x | 1.9-2.5 (10) | test cpu |" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "e2e: missing" in report.render_table(results)

    docs = _bench_docs()
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# x\n\nhand-written H200 table\n\n{docs.BEGIN}\nold\n{docs.END}\n\n## Running\n\ntext\n")
    docs.update(page, results, path.name)
    docs.update(page, results, path.name)  # rewrites its block, adds no second one
    text = page.read_text()
    assert text.count(docs.BEGIN) == 1 and "hand-written H200 table" in text and "old" not in text
    assert text.index(docs.BEGIN) < text.index("## Running") and "| schedule | case a |" in text
    assert "| design target | claimed (A100) |" in text
    page.write_text("# no block\n")
    with pytest.raises(SystemExit, match="no generated block"):
        docs.update(page, results, path.name)


def test_runner_runs_a_script_and_collects_its_report(tmp_path, monkeypatch):
    folder = runner.benchmarks_dir()
    script = tmp_path / "bench_sleep.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(folder)!r})
        from _common import Report, time_ms
        rep = Report("sleep", "cpu")
        rep.add("sleep", "time.sleep 20 ms", time_ms(lambda: time.sleep(0.02), "cpu", warmup=1, rep=3))
        rep.add("sleep", "verl_fast sleep 5 ms", time_ms(lambda: time.sleep(0.005), "cpu", warmup=1, rep=3))
        rep.save()
    """))
    monkeypatch.setitem(runner.OPS, "sleep", runner.Op("bench_sleep.py", device_flag=False, quick=()))
    record = runner.run_op("sleep", "cpu", True, tmp_path, echo=False)
    assert record["status"] == "ok", record.get("output_tail")
    (rep,) = record["reports"]
    (row,) = report.summarize_report("sleep", rep)
    assert row["spread"]["runs"] == 3 and row["ours_ms"] >= 5.0 and row["baseline_ms"] >= 20.0
    monkeypatch.setitem(runner.OPS, "nothere", runner.Op("bench_nothere.py"))
    assert runner.run_op("nothere", "cpu", True, tmp_path, echo=False)["status"] == "missing"


def test_the_summary_pairs_repeated_runs_by_their_medians():
    """A whole run repeated (the default run: plain loop, ours, plain, ours) is summarised by each
    impl's median, not by pairing one impl's first run with the other's fastest."""
    rows = [{"case": "run", "impl": impl, "ms": ms} for impl, ms in
            [("plain", 107.0), ("verl_fast train", 61.0), ("plain", 100.0), ("verl_fast train", 59.0),
             ("plain", 120.0), ("verl_fast train", 66.0), ("verl_fast variant", 70.0)]]
    (row,) = report.summarize_report("default_run", {"rows": rows})
    assert (row["baseline_ms"], row["ours"], row["ours_ms"]) == (107.0, "verl_fast train", 61.0)


def test_claims_read_from_the_claims_and_default_run_reports():
    rows = [("rollout in-process vs HTTP", "vLLM OpenAI HTTP server", 3200.0),
            ("rollout in-process vs HTTP", "verl_fast in-process vLLM", 1000.0),
            ("P99 rollout latency", "one batch, no bucketing", 1200.0),
            ("P99 rollout latency", "verl_fast length buckets", 430.0),
            ("rollout throughput, colocated", "bare engine", 1.0),
            ("rollout throughput, colocated", "verl_fast colocated with training", 1.25)]
    claims_rep = {"name": "claims", "meta": {"hardware": "test cpu"},
                  "rows": [{"case": c, "impl": i, "ms": ms} for c, i, ms in rows]}
    run_rep = {"name": "default_run", "rows": [], "meta": {"runs": [{"ours": {"weight_sync_s": 0.5}},
                                                                    {"ours": {"weight_sync_s": 0.3}}]}}
    results = {"ops": [{"op": "claims", "reports": [claims_rep]}, {"op": "default_run", "reports": [run_rep]}]}
    found = {c["key"]: c for c in claims.collect(results, "cpu")}
    assert found["inprocess_vs_http"]["measured"].startswith("3.20x")
    assert found["p99_bucketing"]["measured"] == "1.20 s -> 0.43 s"
    assert found["colocated"]["measured"] == "80%" and found["colocated"]["hardware"] == "test cpu"
    assert found["switch"]["measured"].startswith("400 ms per step")
    assert found["utilisation"]["measured"] == "not measured in this run"


def test_cli_lists_bench_and_regenerates_the_report(tmp_path, capsys):
    assert "bench" in build_parser().format_help()
    with pytest.raises(SystemExit, match="unknown benchmark"):
        runner.parse_ops("gae,nope", "cpu", True)
    assert runner.parse_ops(None, "cpu", True) == list(runner.QUICK_OPS)
    results = report.build_results([{"op": "gae", "status": "ok", "seconds": 1.0, "reports": [_fake_report()]}],
                                   "cpu", quick=True)
    report.save_results(results, tmp_path)
    for png in tmp_path.glob("cpu-*.png"):
        png.unlink()
    assert main(["bench", "--report-only", "--out", str(tmp_path)]) == 0
    assert "baseline/ours" in capsys.readouterr().out
    assert list(tmp_path.glob("cpu-*.png")) and list(tmp_path.glob("cpu-*.md"))


def test_without_a_checkout_the_suite_runs_and_the_scripts_are_missing(tmp_path, monkeypatch):
    """An installed wheel: the package's ops run, the checkout's scripts are "missing" in one line,
    and the results go to the current folder."""
    assert paths.benchmarks_dir() == ROOT / "benchmarks"  # this checkout, beside the editable package
    monkeypatch.setattr(paths, "__file__", str(tmp_path / "site" / "verl_fast" / "bench" / "paths.py"))
    monkeypatch.chdir(tmp_path)
    assert paths.benchmarks_dir() is None and paths.default_out_dir() == tmp_path
    record = runner.run_op("reshard", "cpu", True, None, echo=False)
    assert record["status"] == "missing" and record["reason"].endswith("runs from a clone of the repository")
    assert runner.op_command("gae", "cpu", True, None)[1:] == ["-m", "verl_fast.bench.ops_advantage", "--device", "cpu",
                                                              "--quick"]
    assert set(runner.QUICK_OPS) <= {name for name, op in runner.OPS.items() if op.module}
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "_common.py").write_text("")
    assert paths.benchmarks_dir() == tmp_path / "benchmarks"  # a checkout as the current folder


def test_the_step_benchmarks_tokenizer_round_trips_chat_text():
    from verl_fast.bench.ops_step import char_tokenizer

    tok = char_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert len(ids) == len("What is 12 + 7?") + len("user\n") + len("\nassistant\n") + 3
