"""The metrics a run exports: the OpenMetrics endpoint scraped during a run, the TensorBoard event
file read back, both against metrics.jsonl."""

import json
import math
import socket
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.metrics.logger import GAUGES, HISTOGRAMS, MetricsServer, sanitize
from verl_fast.trainer.rl_trainer import RLTrainer

PROMPTS = [{"prompt": f"What is {a} + {b}?"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def run(tiny_path, output_dir, reward, **trainer):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(output_dir),
                       "progress_bar": False, "plot": False, "device": "cpu", **trainer}}
    RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg).fit(PROMPTS)
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-9)


def test_endpoint_scraped_during_a_run_matches_the_jsonl(tiny_path, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scraped, calls = [], []

    def reward(solution_str):
        calls.append(solution_str)
        if len(calls) == 9:  # step 2's first sample (2 prompts x 4 samples a step): step 1 is exported
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                scraped.append(r.read().decode())
        return float(len(solution_str) % 2)

    rows = run(tiny_path, tmp_path, reward, metrics_port=port)
    assert scraped, "the endpoint was not scraped during step 2"
    families = {f.name: f for f in text_string_to_metric_families(scraped[0])}
    step1 = rows[0]
    names = {key: name for key, (name, _) in GAUGES.items()}
    numeric = {k: v for k, v in step1.items() if isinstance(v, (int, float))}
    assert {"reward/mean", "actor/entropy", "actor/clipfrac", "time/generation", "time/step"} <= set(numeric)
    for key, value in numeric.items():  # every numeric entry, with the same number
        name = names.get(key, sanitize(key))
        assert name in families, (key, name)
        (sample,) = families[name].samples
        assert same(sample.value, float(value)), (key, sample.value, value)
    for key, (name, _) in HISTOGRAMS.items():
        if key not in numeric:
            continue
        samples = {s.name: s.value for s in families[name].samples if not s.labels.get("le")}
        assert families[name].type == "histogram"
        assert samples[name + "_count"] == 1 and same(samples[name + "_sum"], numeric[key]), (name, samples)
    assert families["verl_reward_mean"].type == "gauge"


def test_endpoint_binds_loopback_unless_told():
    local = MetricsServer(0)
    try:
        assert local.server.server_address[0] == "127.0.0.1"
    finally:
        local.close()
    everywhere = MetricsServer(0, host="0.0.0.0")
    try:
        assert everywhere.server.server_address[0] == "0.0.0.0"
    finally:
        everywhere.close()


def test_tensorboard_event_file_holds_the_jsonl_numbers(tiny_path, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = run(tiny_path, tmp_path, lambda solution_str: float(len(solution_str) % 2),
               loggers=["jsonl", "tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key in ("reward/mean", "actor/pg_loss", "time/step", "actor/grad_norm"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in logged] == [1, 2], key
        assert all(same(v, r[key]) for (_, v), r in zip(logged, rows)), (key, logged)
