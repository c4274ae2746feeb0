"""The static-KV-cache decode loop (rollout/hf_decode.py) against plain ``generate``: greedy tokens
exactly, sampled tokens' log-probs against a teacher-forced forward, the sampler's distribution
against a float64 reference, stop tokens, and the fallbacks. The CUDA-graph path: gpu-marked."""

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import build_model, build_tokenizer, save_tiny_model
from verl_fast.rollout import decode_memory, hf_decode, static_kv
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.hf_engine import HFGenerateEngine


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tok):
    m = build_model(request.param, vocab_size=len(tok), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    m.generation_config.eos_token_id = tok.eos_token_id
    return m


def prompts(tok, count=5):
    texts = ["What is 1 + 2?", "the answer is", "compute the sum of 41 and 7 please", "x", "What is 99 - 3? total"]
    return [tok(texts[i % len(texts)])["input_ids"] for i in range(count)]


def engines(model, tok, device="cpu"):
    model.to(device)
    return (HFGenerateEngine(model, tok, fast_decode="on"), HFGenerateEngine(model, tok, fast_decode="off"))


def teacher_forced_logprobs(model, prompt, response, temperature):
    """Log-probs of ``response`` after ``prompt`` from one plain forward (no cache, no padding)."""
    ids = torch.tensor([list(prompt) + list(response)], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, ids[0, len(prompt):, None]).squeeze(-1).cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_equals_generate(model, tok, device):
    fast, plain = engines(model, tok, device)
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=12)
    a, b = fast.generate(prompts(tok), spec), plain.generate(prompts(tok), spec)
    assert fast.last_mode == ("graph" if device == "cuda" else "eager") and plain.last_mode == "generate"
    figures = fast.metrics()
    assert figures.keys() == {"cuda_graph", "prefill_s", "decode_s", "graph_captures", "decode_calls"}
    assert figures["decode_calls"] == 1.0
    assert figures["cuda_graph"] == figures["graph_captures"] == float(device == "cuda")  # one batch size: one graph
    assert figures["prefill_s"] > 0 and figures["decode_s"] > 0
    assert plain.metrics() == {"cuda_graph": 0.0}
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert a.finish_reasons == b.finish_reasons
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampled_logprobs_match_teacher_forcing(model, tok, device):
    fast, _ = engines(model, tok, device)
    p = prompts(tok, 4)
    out = fast.generate(p, SamplingSpec(n=3, temperature=0.7, top_p=0.9, max_tokens=10, seed=3))
    assert out.num_sequences == 12 and fast.last_mode == ("graph" if device == "cuda" else "eager")
    for row in range(out.num_sequences):
        length = int(out.response_mask[row].sum())
        resp = out.response_ids[row, :length].tolist()
        want = teacher_forced_logprobs(model, p[int(out.prompt_index[row])], resp, 0.7)
        torch.testing.assert_close(out.logprobs[row, :length].double(), want, atol=1e-4, rtol=0)
        assert (out.logprobs[row, length:] == 0).all()


def reference_probs(logits, temperature, top_k, top_p):
    """The distribution generate samples from (temperature, top-k, top-p warpers), in float64."""
    s = logits.double() / temperature
    if top_k > 0:
        kth = sorted(s.tolist(), reverse=True)[top_k - 1]
        s = torch.where(s < kth, torch.tensor(-math.inf, dtype=torch.float64), s)
    if top_p < 1:
        order = torch.argsort(s)  # ascending
        probs = torch.softmax(s[order], 0)
        cum = 0.0
        for i, idx in enumerate(order.tolist()):
            cum += float(probs[i])
            if cum <= 1 - top_p and i < len(order) - 1:
                s[idx] = -math.inf
    return torch.softmax(s, 0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9)])
def test_sampler_distribution(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    draws = 40000
    token, logp = hf_decode.sample(logits.expand(draws, -1).clone(), temperature, top_k, top_p)
    freq = torch.bincount(token, minlength=12).double() / draws
    want = reference_probs(logits, temperature, top_k, top_p)
    assert (freq[want == 0] == 0).all(), "a filtered token was drawn"
    assert (freq - want).abs().max() < 0.015, (freq, want)  # ~6 standard errors at p = 0.5
    full = torch.log_softmax(logits.double() / temperature, 0)  # reported from the unfiltered scores
    torch.testing.assert_close(logp.double(), full[token], atol=1e-5, rtol=0)


def test_stop_token_ids_end_rows_like_generate(model, tok):
    fast, plain = engines(model, tok)
    p = prompts(tok, 3)
    greedy = plain.generate(p, SamplingSpec(temperature=0.0, max_tokens=10))
    stop = int(greedy.response_ids[0, 2])  # row 0 stops at its third token
    spec = SamplingSpec(temperature=0.0, max_tokens=10, stop_token_ids=(stop,))
    a, b = fast.generate(p, spec), plain.generate(p, spec)
    assert a.finish_reasons[0] == "stop" and int(a.response_mask[0].sum()) <= 3
    assert torch.equal(a.response_ids, b.response_ids) and a.finish_reasons == b.finish_reasons


def test_unsupported_models_and_fallback(tok, tmp_path):
    path = save_tiny_model(tmp_path / "m", family="qwen2")
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    assert "eager" in hf_decode.unsupported(eager)
    sdpa = AutoModelForCausalLM.from_pretrained(path)
    assert hf_decode.unsupported(sdpa) is None
    sdpa.generation_config.repetition_penalty = 1.2
    assert "repetition_penalty" in hf_decode.unsupported(sdpa)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = HFGenerateEngine(eager, tokenizer, fast_decode="on")
    assert engine._fast_reason(SamplingSpec()) is not None
    out = engine.generate(prompts(tokenizer, 2), SamplingSpec(n=2, max_tokens=4, seed=0))  # through generate
    assert out.num_sequences == 4
    assert HFGenerateEngine(sdpa, tokenizer)._fast_reason(SamplingSpec()).startswith("fast_decode=auto on cpu")
    with pytest.raises(ValueError, match="fast_decode"):
        HFGenerateEngine(sdpa, tokenizer, fast_decode="yes")


def _fsdp2_rank(rank, port, path, out):
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    p = prompts(tokenizer, 3)
    engine = HFGenerateEngine(model, tokenizer, fast_decode="on")
    out_fast = engine.generate(p, SamplingSpec(temperature=0.0, max_tokens=8))
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    dist.destroy_process_group()
    if rank == 0:
        torch.save({"ids": out_fast.response_ids, "lp": out_fast.logprobs, "hooks": hooks,
                    "mode": engine.last_mode}, out)


def test_fsdp2_sharded_actor_decodes_like_the_whole_model(tmp_path):
    """Two gloo ranks, FSDP2 per layer and at the root: the loop runs on the unsharded parameters
    with the FSDP hooks set aside, and restores them."""
    import socket

    import torch.multiprocessing as mp

    path = save_tiny_model(tmp_path / "m", family="qwen2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp2_rank, args=(port, str(path), str(tmp_path / "out.pt")), nprocs=2)
    got = torch.load(tmp_path / "out.pt")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    want = HFGenerateEngine(model, tokenizer, fast_decode="off").generate(prompts(tokenizer, 3),
                                                                          SamplingSpec(temperature=0.0, max_tokens=8))
    assert got["mode"] == "eager"
    assert torch.equal(got["ids"], want.response_ids)
    torch.testing.assert_close(got["lp"], want.logprobs, atol=1e-5, rtol=0)
    assert got["hooks"] >= 3  # FSDP's pre-forward hooks are back on the root and the two layers


def test_capture_failure_decodes_eagerly_and_loop_failure_falls_back(model, tok, monkeypatch, caplog):
    fast, plain = engines(model, tok)
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=6)
    want = plain.generate(prompts(tok, 3), spec)

    def no_capture(self, decoder):
        decoder.step()  # the warm-up step runs, then capture fails
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(hf_decode.GraphPool, "capture", no_capture)
    original = hf_decode.decode
    monkeypatch.setattr(hf_decode, "decode", lambda *a, **k: original(*a, **{**k, "use_graph": True}))
    with caplog.at_level("WARNING"):
        got = fast.generate(prompts(tok, 3), spec)
    assert "decoding eagerly" in caplog.text and fast.last_mode == "eager"
    assert torch.equal(got.response_ids, want.response_ids)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(hf_decode, "decode", broken)
    got = fast.generate(prompts(tok, 3), spec)
    assert fast.last_mode == "generate" and "boom" in fast.fast_failed
    assert torch.equal(got.response_ids, want.response_ids)
    assert "boom" in fast._fast_reason(spec)  # later calls go straight to generate


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_autocast_runs_the_loop(model, tok, device):
    """The trainer's setting (fp32 weights, bf16 autocast): keys leave the rotary product in fp32,
    values the projection in bf16; the loop keeps both. bf16 rounding differs between attention
    shapes, so near-ties may break differently from generate: each greedy token must be the argmax
    of a teacher-forced float32 forward within a bf16 margin, and its log-prob agree with it."""
    model.to(device)
    fast = HFGenerateEngine(model, tok, fast_decode="on", autocast_dtype=torch.bfloat16)
    p = prompts(tok)
    out = fast.generate(p, SamplingSpec(temperature=0.0, max_tokens=8))
    assert fast.last_mode == ("graph" if device == "cuda" else "eager")
    assert_greedy_within_bf16(model, p, out)


def assert_greedy_within_bf16(model, prompts, out):
    """Each greedy token of a bf16 decode is the argmax of a teacher-forced float32 forward over its
    own prefix within a bf16 margin, and its log-prob agrees with that forward's: rounding differs
    between kernels (attention shapes, fused or not), so near-ties may break either way and a row
    then continues differently, which a position-by-position token comparison would count against it."""
    device = next(model.parameters()).device
    for row in range(out.num_sequences):
        prompt = list(prompts[int(out.prompt_index[row])])
        length = int(out.response_mask[row].sum())
        ids = torch.tensor([prompt + out.response_ids[row, :length].tolist()], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double().cpu()
        chosen = logits.gather(-1, out.response_ids[row, :length, None]).squeeze(-1)
        assert (logits.max(-1).values - chosen).max() < 0.1, row
        want = torch.log_softmax(logits, -1).gather(-1, out.response_ids[row, :length, None]).squeeze(-1)
        torch.testing.assert_close(out.logprobs[row, :length].double(), want, atol=5e-2, rtol=0)


@pytest.mark.gpu
def test_graph_memory_is_reused_across_rollouts(model, tok):
    """A rollout leaves the caching allocator as it found it: after the first calls, a rollout of the
    same shape asks the driver for no memory and gives none back -- neither its graph's pool nor the
    cache the trainer's update left (torch.cuda.graph would empty it) -- and still decodes right."""
    fast, plain = engines(model, tok, "cuda")
    spec = SamplingSpec(n=4, temperature=0.0, max_tokens=24)
    want = plain.generate(prompts(tok), spec)
    for _ in range(2):  # the first calls may still grow the allocator (cuBLAS workspaces, the pool itself)
        fast.generate(prompts(tok), spec)
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # freed at once: a cached segment, as an update leaves
    before = torch.cuda.memory_stats()
    got = fast.generate(prompts(tok), spec)
    after = torch.cuda.memory_stats()
    assert fast.last_mode == "graph"
    assert after["num_device_alloc"] == before["num_device_alloc"]
    assert after["num_device_free"] == before["num_device_free"]
    assert torch.equal(got.response_ids, want.response_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    sampled = fast.generate(prompts(tok), SamplingSpec(n=2, temperature=1.0, max_tokens=24))  # another shape
    assert fast.last_mode == "graph" and sampled.num_sequences == 10


@pytest.mark.parametrize("q_len", [1, 3])
def test_grouped_attention_matches_per_head_reference(q_len):
    torch.manual_seed(0)
    b, heads, kv_heads, length, d = 3, 6, 2, 11, 8
    query = torch.randn(b, q_len, heads, d).transpose(1, 2)  # [b, heads, q, d], not contiguous, as models pass it
    key, value = torch.randn(b, kv_heads, length, d), torch.randn(b, kv_heads, length, d)
    mask = torch.rand(b, 1, q_len, length) > 0.4
    mask[..., 0] = True
    out, _ = static_kv.grouped_attention(None, query, key, value, mask, scaling=0.3)
    want = torch.empty(b, q_len, heads, d, dtype=torch.float64)
    for i in range(b):
        for h in range(heads):
            kh = h // (heads // kv_heads)  # query head h shares KV head h // group
            for t in range(q_len):
                s = (key[i, kh].double() @ query[i, h, t].double()) * 0.3
                s[~mask[i, 0, t]] = -math.inf
                want[i, t, h] = torch.softmax(s, 0) @ value[i, kh].double()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    with pytest.raises(NotImplementedError, match="softcap"):
        static_kv.grouped_attention(None, query, key, value, mask, softcap=30.0)


def test_compiled_decode_steps_match_eager(tok):
    """``compile_decode``: the decode steps' forward compiled (Inductor; here its CPU code) gives the
    eager loop's greedy tokens and log-probs, compiles once for a batch shape (prompt widths rounded
    up), and under autocast runs on refreshed low-precision copies of the linear weights while the
    model keeps its own parameters."""
    import torch._dynamo

    torch._dynamo.reset()
    m = build_model("qwen2", vocab_size=len(tok), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, tie_word_embeddings=True)
    m.generation_config.eos_token_id = tok.eos_token_id
    eager = HFGenerateEngine(m, tok, fast_decode="on")
    compiled = HFGenerateEngine(m, tok, fast_decode="on", compile_decode=True)
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=10)
    want, got = eager.generate(prompts(tok), spec), compiled.generate(prompts(tok), spec)
    assert torch.equal(got.response_ids, want.response_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled.fast_failed is None and compiled.last_mode == "eager" and frames >= 1  # the loop ran, compiled
    assert {k.rsplit(".", 2)[-2] for k in compiled._compiled.merged.copies} == {"self_attn", "mlp"}  # products merged
    assert not any("forward" in sub.__dict__ or "merged_weight" in sub._parameters for sub in m.modules())  # undone
    compiled.generate([p[1:] or p for p in prompts(tok)], spec)  # narrower, the same rounded width: no new compile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    for width in (70, 140, 200):  # other rounded widths: one compile with symbolic lengths serves them all
        batch = [p * (width // len(p) + 1) for p in prompts(tok, 2)]
        longer = compiled.generate(batch, spec)
        assert compiled.last_mode == "eager"
        assert torch.equal(longer.response_ids, eager.generate(batch, spec).response_ids)
    # (fewer rows too: the forward once more with lengths and rows symbolic, the sampling with its rows)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames + 2

    params = {name: p for name, p in m.named_parameters()}
    bf16 = HFGenerateEngine(m, tok, fast_decode="on", compile_decode=True, autocast_dtype=torch.bfloat16)
    for _ in range(2):  # the second time after a weight change: the copies follow the parameters
        a = bf16.generate(prompts(tok), spec)
        assert bf16.fast_failed is None and bf16.last_mode == "eager"
        assert_greedy_within_bf16(m, prompts(tok), a)
        assert {name: p for name, p in m.named_parameters()} == params  # its own fp32 Parameters again
        assert all(p.dtype == torch.float32 for p in m.parameters())
        with torch.no_grad():
            m.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    assert {k.rsplit(".", 1)[0] for k in bf16._compiled.copies} >= {"lm_head", "model.layers.0.mlp.down_proj"}
    assert m.model.embed_tokens.weight.dtype == torch.float32 and m.lm_head.weight is m.model.embed_tokens.weight


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [False, True], ids=["matmul_attention", "kernel_attention"])
def test_compiled_decode_steps_in_the_cuda_graph(model, tok, kernel, monkeypatch):
    """The compiled forward captured in the decode graph: the eager graph's greedy tokens (fp32), and
    under the trainer's bf16 autocast greedy tokens within a bf16 margin of a float32 forward's; the
    attention in its matmul form or through the Triton kernel (``static_kv.KERNEL``)."""
    monkeypatch.setattr(static_kv, "KERNEL", kernel)
    model.to("cuda")
    spec = SamplingSpec(n=4, temperature=0.0, max_tokens=24)
    for autocast in (None, torch.bfloat16):
        ref = HFGenerateEngine(model, tok, fast_decode="on", autocast_dtype=autocast)
        compiled = HFGenerateEngine(model, tok, fast_decode="on", autocast_dtype=autocast, compile_decode=True)
        want, got = ref.generate(prompts(tok), spec), compiled.generate(prompts(tok), spec)
        assert compiled.last_mode == "graph" and compiled.fast_failed is None
        if autocast is None:
            assert torch.equal(got.response_ids, want.response_ids)
        else:  # (in the first GPU run 0.825 of the tokens matched the eager graph's position by position)
            assert_greedy_within_bf16(model, prompts(tok), got)
        again = compiled.generate(prompts(tok), spec)  # a second capture of the compiled step
        assert torch.equal(again.response_ids, got.response_ids)


def test_bytes_per_prompt_counts_each_samples_cache_and_sampling_and_one_prefill(tok):
    m = build_model("qwen2", vocab_size=len(tok), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    cfg = m.config
    width, new = 64, 16
    kv = 2 * 2 * 2 * (64 // 4) * 4 * (width + new)  # layers x (k, v) x kv heads x head_dim x 4 B x columns
    prefill = decode_memory.PREFILL_BYTES * width * (64 + cfg.intermediate_size) + width * width
    for samples in (1, 3):
        assert decode_memory.bytes_per_prompt(cfg, width, new, samples) == samples * (kv + 6 * 4 * len(tok)) + prefill


def test_the_prefill_runs_each_prompt_once_for_all_its_samples(model, tok):
    """``rows``: the prompts' forward sees each distinct prompt once, its KV cache goes to every row that
    decodes it, and the decode is the one of the prompts given row by row (same seed: same tokens and
    log-probs); the engine passes each distinct prompt of a call once."""
    p = prompts(tok, 3)
    width = max(map(len, p))
    ids = torch.tensor([[0] * (width - len(x)) + x for x in p])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in p])
    rows = torch.tensor([0, 0, 2, 1, 2, 2, 0])
    batches = []
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, args, out: batches.append(tuple(args[0].shape)))
    try:
        for temperature in (0.0, 1.0):
            batches.clear()
            torch.manual_seed(5)
            once = hf_decode.decode(model, ids, mask, 9, temperature, 0, 1.0, [-1], 0, use_graph=False, rows=rows)
            assert batches[0] == (3, width) and set(batches[1:]) == {(7, 1)}  # a prefill of 3 rows, steps of 7
            torch.manual_seed(5)
            each = hf_decode.decode(model, ids[rows], mask[rows], 9, temperature, 0, 1.0, [-1], 0, use_graph=False)
            assert torch.equal(once[0], each[0])
            torch.testing.assert_close(once[1], each[1], atol=1e-5, rtol=0)
        batches.clear()
        engine = HFGenerateEngine(model, tok, fast_decode="on")
        out = engine.generate([p[0], p[1], p[0]], SamplingSpec(n=2, temperature=1.0, max_tokens=5, seed=0))
        assert batches[0] == (2, max(len(p[0]), len(p[1]))) and set(batches[1:]) == {(6, 1)} and out.num_sequences == 6
    finally:
        hook.remove()
    cache = static_kv.StaticKV(1, 4, rows=torch.tensor([1, 0, 1]))
    cache.cols = torch.arange(3)
    key, value = torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2)
    k, v = cache.update(key, value, 0)  # the prefill: two prompts, attending to their own keys
    assert k is key and v is value
    assert torch.equal(cache.keys[0][:, :, :3], key[[1, 0, 1]])
    assert torch.equal(cache.values[0][:, :, :3], value[[1, 0, 1]])
    assert not cache.keys[0][:, :, 3].any()


def test_a_group_larger_than_the_room_decodes_in_calls_that_fit(model, tok, monkeypatch):
    """Where the GPU's room holds fewer prompts than a group has, the loop takes them in calls of what
    fits (here: the room of two prompts' rows, the CPU standing in): greedy tokens as one call's."""
    fast, _ = engines(model, tok)
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=8)
    whole = fast.generate(prompts(tok), spec)
    per_prompt = decode_memory.bytes_per_prompt(model.config, hf_decode.CompiledForward.WIDTH, spec.max_tokens, 1)
    calls = []
    run = fast._generate
    monkeypatch.setattr(fast, "_room_bytes", lambda: 2.5 * per_prompt)  # greedy: one row a prompt
    monkeypatch.setattr(fast, "_generate", lambda ps, s, v=None, **kw: calls.append(len(ps)) or run(ps, s, v, **kw))
    cut = fast.generate(prompts(tok), spec)
    assert calls == [2, 2, 1]
    assert torch.equal(cut.response_ids, whole.response_ids) and cut.finish_reasons == whole.finish_reasons
    torch.testing.assert_close(cut.logprobs, whole.logprobs, atol=1e-5, rtol=0)
    assert HFGenerateEngine(model, tok, fast_decode="on")._room_bytes() is None  # off a GPU: no limit


def test_requests_of_other_sample_counts_and_limits_decode_in_one_call(model, tok):
    """A partial rollout's round asks for fresh prompts' n samples beside carried samples (n = 1) with the
    tokens each has left: the static-cache loop takes them in one call to the longest limit, each row cut to
    its own. Greedy rows are those of one call per request; sampled rows end at their limits, by "length"
    only there; log-probs are the model's of the tokens kept; generate (the loop off) serves the same."""
    ps = prompts(tok, 4)
    specs = [SamplingSpec(n=3, temperature=0.0, max_tokens=10), SamplingSpec(n=1, temperature=0.0, max_tokens=4),
             SamplingSpec(n=2, temperature=0.0, max_tokens=7, seed=3), SamplingSpec(n=1, temperature=0.0, max_tokens=10)]
    fast, plain = engines(model, tok)
    mixed = fast.generate(ps, specs)
    assert fast.metrics()["decode_calls"] == 1.0
    for out in (mixed, plain.generate(ps, specs)):
        assert out.prompt_index.tolist() == [0, 0, 0, 1, 2, 2, 3]
        for r, p in enumerate(out.prompt_index.tolist()):
            alone = fast.generate([ps[p]], replace(specs[p], n=1))
            width = int(out.response_mask[r].sum())
            assert width == int(alone.response_mask[0].sum()) <= specs[p].max_tokens
            assert torch.equal(out.response_ids[r, :width], alone.response_ids[0, :width])
            assert out.finish_reasons[r] == alone.finish_reasons[0]
            torch.testing.assert_close(out.logprobs[r, :width], alone.logprobs[0, :width], atol=1e-5, rtol=0)
    sampled = [replace(s, temperature=1.0, seed=7) for s in specs]
    fast.metrics()  # (the figures of the calls above handed over)
    out = fast.generate(ps, sampled)
    assert fast.metrics()["decode_calls"] == 1.0 and out.num_sequences == 7
    for r, p in enumerate(out.prompt_index.tolist()):
        width = int(out.response_mask[r].sum())
        assert width <= sampled[p].max_tokens
        assert (out.finish_reasons[r] == "length") == (width == sampled[p].max_tokens
                                                        and out.response_ids[r, width - 1] != tok.eos_token_id)
        want = teacher_forced_logprobs(model, ps[p], out.response_ids[r, :width].tolist(), 1.0)
        torch.testing.assert_close(out.logprobs[r, :width].double(), want, atol=1e-4, rtol=0)
