"""Per-phase step figures: FLOP count, MFU, peak table, and the keys a training step reports."""

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.metrics.logger import step_summary
from verl_fast.models.packed import causal_pairs
from verl_fast.trainer import perf
from verl_fast.trainer.rl_trainer import RLTrainer


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def test_update_flops_matches_plain_count():
    lens = torch.tensor([5, 17, 1, 300])
    params, layers, width = 1234567, 7, 96
    want = 0.0
    for s in lens.tolist():  # per token: 6 per parameter; per causal query-key pair: 2 matmuls x 2 x 3
        pairs = sum(q + 1 for q in range(s))  # query q attends keys 0..q
        want += 6.0 * params * s + 3 * 2 * 2 * layers * width * pairs
    tokens, pairs = float(lens.sum()), causal_pairs(lens)
    assert perf.update_flops(params, layers, width, tokens, pairs) == pytest.approx(want, rel=1e-12)


def test_peak_table_by_device_name(monkeypatch):
    assert perf.peak_bf16_flops(torch.device("cpu")) is None
    for name, want in [("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GH200 480GB", 989e12),
                       ("NVIDIA L40S", 362e12), ("Tesla T4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert perf.peak_bf16_flops(torch.device("cuda")) == want, name


def test_phases_accumulate_and_mfu(tiny_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    p = perf.StepPerf(model, torch.device("cpu"))
    cfg = model.config
    assert p.num_params == sum(t.numel() for t in model.parameters())
    assert (p.num_layers, p.attn_width) == (cfg.num_hidden_layers, cfg.hidden_size)
    with p.phase("update_actor"):
        time.sleep(0.02)
    with p.phase("update_actor"):
        time.sleep(0.01)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 1, 1]])
    p.count_update(10, causal_pairs(mask.sum(-1)))
    p.count_step_tokens(mask)
    out = p.figures()
    assert 0.03 <= out["time/update_actor"] < 0.5
    assert "perf/mfu_update" not in out and "perf/peak_memory_gib" not in out  # CPU: no peak rate
    assert out["perf/tokens"] == 10
    p.peak = 1e12  # as on a GPU of 1 TFLOP/s
    want = perf.update_flops(p.num_params, p.num_layers, p.attn_width, 10, 6 + 6 + 10)
    assert p.figures()["perf/mfu_update"] == pytest.approx(want / out["time/update_actor"] / 1e12)
    assert perf.throughput({"time/step": 2.0, "perf/tokens": 10}) == {"perf/tokens_per_s_per_gpu": 5.0}
    p.begin()
    assert p.figures() == {"perf/tokens": 0.0, "perf/gc_s": 0.0, "perf/gc_collections": 0.0, "perf/gc_full": 0.0,
                           "perf/graph_compiles": 0.0}


def test_torch_compile_graphs_counted_per_step():
    p = perf.StepPerf(torch.nn.Linear(2, 2), torch.device("cpu"))
    fn = torch.compile(lambda x: (x * 2).sin())
    p.begin()
    fn(torch.ones(3))
    assert p.figures()["perf/graph_compiles"] == 1
    p.begin()
    fn(torch.ones(3))  # the same shape: the compiled graph runs again
    assert p.figures()["perf/graph_compiles"] == 0


def test_garbage_collector_pauses_counted_per_step(tiny_path):
    import gc

    p = perf.StepPerf(AutoModelForCausalLM.from_pretrained(tiny_path), torch.device("cpu"))
    perf.StepPerf(torch.nn.Linear(2, 2), torch.device("cpu"))  # a second trainer: one callback, not two
    assert gc.callbacks.count(perf._time_gc) == 1
    p.begin()
    with p.phase("reward"):
        gc.collect()
        gc.collect(0)
    out = p.figures()
    assert out["perf/gc_collections"] == 2 and out["perf/gc_full"] == 1
    assert 0 < out["perf/gc_s"] <= out["time/reward"]
    p.begin()
    assert p.figures()["perf/gc_collections"] == 0


def test_kernel_compile_counter_chains_onto_tritons_hooks(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(("before", kw["key"])) or True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(("after", kw["key"])))
    monkeypatch.setattr(perf, "_JIT", {"s": 0.0, "n": 0, "start": 0.0})
    perf._count_kernel_compiles()
    perf._count_kernel_compiles()  # a second trainer: chained once
    assert knobs.runtime.jit_cache_hook(key="k1") is True  # the earlier hook's answer (True skips the compile)
    time.sleep(0.01)
    knobs.runtime.jit_post_compile_hook(key="k1")
    assert calls == [("before", "k1"), ("after", "k1")]
    assert perf._JIT["n"] == 1 and perf._JIT["s"] >= 0.01


def test_progress_bar_summary():
    line = step_summary({"time/generation": 0.84, "time/update_actor": 0.41, "perf/tokens_per_s_per_gpu": 28512.3,
                         "perf/mfu_update": 0.234, "perf/peak_memory_gib": 15.26})
    assert line == "gen 0.8s  update 0.4s  28512 tok/s/gpu  mfu 23%  mem 15.3GiB"
    assert step_summary({"time/generation": 2.0}) == "gen 2.0s"


PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}, "data_source": "toy"}
           for a, b in [(1, 2), (3, 4)]]


def test_trainer_reports_phases_per_step(tiny_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = {"actor": {"lr": 1e-3, "micro_batch_size": 8, "use_kl_loss": True, "ppo_mini_batch_size": 4},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path / "run"), "save_freq": 1,
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    reward = lambda solution_str, ground_truth: float(len(solution_str) % 2)  # noqa: E731
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg)
    history = trainer.fit(PROMPTS)
    prompt_tokens = sum(len(r.prompt_ids) for r in trainer.processor.encode_all(PROMPTS))
    phases = ["generation", "reward", "old_logprob", "ref", "advantages", "update_actor"]
    for m in history:
        for name in phases:
            assert m[f"time/{name}"] >= 0, name
        assert sum(m[f"time/{n}"] for n in phases) <= m["time/step"]
        assert "time/values" not in m and "time/update_critic" not in m  # no critic in GRPO
        tokens = 4 * prompt_tokens + 8 * m["response/length"]  # n=4 samples of 2 prompts
        assert m["perf/tokens"] == pytest.approx(tokens)
        assert m["perf/tokens_per_s_per_gpu"] == pytest.approx(tokens / m["time/step"])
    assert history[0]["time/checkpoint"] > 0  # saved after step 1 (the last step's save is the final one)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["time/checkpoint"] == history[0]["time/checkpoint"]
    assert all(isinstance(v, float) for k, v in logged[1].items() if k.startswith(("time/", "perf/")))


@pytest.mark.gpu
def test_gpu_figures_peak_memory_and_mfu():
    device = torch.device("cuda")
    model = torch.nn.Linear(1024, 1024).to(device)
    p = perf.StepPerf(model, device)
    torch.cuda.empty_cache()
    p.begin()
    with p.phase("update_actor"):
        x = torch.randn(4096, 1024, device=device, requires_grad=True)
        model(x).sum().backward()
        # more than the cached free blocks together (earlier tests in this process may keep a segment that
        # empty_cache cannot release, partly free): a cudaMalloc whatever ran before
        spare = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        fresh = torch.empty(spare + 2**26, dtype=torch.uint8, device=device)
        del fresh
    p.count_update(4096, causal_pairs(torch.tensor([2048, 2048])))
    out = p.figures()
    assert out["perf/peak_memory_gib"] >= 4096 * 1024 * 4 / 2**30  # at least the input was live
    assert out["perf/cuda_mallocs"] >= 1 and out["perf/alloc_retries"] == 0  # ``fresh``
    p.begin()
    torch.cuda.empty_cache()  # gives the cached blocks back to the driver
    assert p.figures()["perf/cuda_frees"] >= 1
    if p.peak is not None:  # a GPU in the table
        assert 0 < out["perf/mfu_update"] < 1


@pytest.mark.gpu
def test_gpu_peak_memory_per_phase():
    """Each phase reports the peak while it ran, an enclosing phase its inner ones' too, and the step's
    peak is the largest whatever the resets between phases."""
    device = torch.device("cuda")
    p = perf.StepPerf(torch.nn.Linear(8, 8).to(device), device)
    mib = 2**20
    base = torch.cuda.memory_allocated(device)
    p.begin()
    big = torch.empty(256 * mib, dtype=torch.uint8, device=device)  # before any phase, freed before too
    del big
    with p.phase("generation"):
        small = torch.empty(16 * mib, dtype=torch.uint8, device=device)
        del small
    with p.phase("update_actor"):
        with p.phase("old_logprob"):
            mid = torch.empty(64 * mib, dtype=torch.uint8, device=device)
            del mid
        tiny = torch.empty(4 * mib, dtype=torch.uint8, device=device)
        del tiny
    out = p.figures()
    gib = 2**30
    assert out["perf/peak_memory_gib"] * gib >= base + 256 * mib
    assert base + 16 * mib <= out["perf/phase_peak_memory_gib/generation"] * gib < base + 256 * mib
    assert out["perf/phase_peak_memory_gib/old_logprob"] * gib >= base + 64 * mib
    assert out["perf/phase_peak_memory_gib/update_actor"] == out["perf/phase_peak_memory_gib/old_logprob"]
    assert out["perf/phase_peak_memory_gib/generation"] < out["perf/peak_memory_gib"]


@pytest.mark.gpu
def test_token_counts_compile_the_log_prob_kernels_once():
    """Micro-batches of every token count share one compile of the log-prob kernels: a count outside
    the first one's specialization class (divisible by 16 or not; per-row outputs' alignment) compiles
    nothing. Counts from 128 up: below, the fused kernels' tiles shrink to the problem (new constants)."""
    pytest.importorskip("triton")
    from verl_fast.ops.logprobs import linear_logprobs, logprobs_from_logits

    device = torch.device("cuda")
    p = perf.StepPerf(torch.nn.Linear(2, 2), device)
    torch.manual_seed(0)
    weight = torch.randn(1024, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    counts = []
    for n in (256, 300, 1024, 129):
        p.begin()
        hidden = torch.randn(1, n, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, 1024, (1, n), device=device)
        logp, entropy = linear_logprobs(hidden, weight, labels, 1.0, True)
        (logp.sum() + entropy.sum()).backward()
        logits = torch.randn(2, n, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
        logprobs_from_logits(logits, labels.expand(2, n), 1.0).sum().backward()
        torch.cuda.synchronize()
        counts.append(p.figures()["perf/kernel_compiles"])
    assert counts[0] >= 1 and counts[1:] == [0, 0, 0], counts


def test_a_lora_update_counts_the_frozen_base_forward_and_input_gradients(tiny_path):
    """A LoRA actor's update: every parameter's forward and input gradients (4 a token), the adapters'
    weight gradients only (2 a token); counting the trained parameters alone reported ~1% MFU at 7B."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path),
                                peft.LoraConfig(r=4, target_modules="all-linear"))
    p = perf.StepPerf(model, torch.device("cpu"))
    total = sum(t.numel() for t in model.parameters())
    trained = sum(t.numel() for t in model.parameters() if t.requires_grad)
    assert 0 < p.trained == trained < p.num_params == total
    p.count_update(10, 0)
    assert p.flops == pytest.approx((4 * total + 2 * trained) * 10, rel=1e-12)
    assert perf.update_flops(total, 2, 8, 10, 0) == pytest.approx(6 * total * 10)  # training all of them
