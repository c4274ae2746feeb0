"""The static-cache decode with its fused Triton kernels (``hf_decode.decode(fused=True)``: the merged
attention's rotary + cache write in one kernel, the sampling tail in one; on CPU tensors under
TRITON_INTERPRET) against the same decode's torch step: greedy tokens exactly and log-probs to float32
noise over ragged rows, compacted or not; sampled log-probs against a teacher-forced float64 forward;
the kernels really ran; the engine's switch (``rollout.hf_fused_kernels``). The sampled distribution
through compaction: ``test_decode_compaction``'s chi-square test, fused case. The CUDA-graph path:
gpu-marked."""

import contextlib
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1", allow_module_level=True)

from test_decode_compaction import CAP, generate_greedy, ragged_prompts, spread_stop_ids  # noqa: E402
from tiny_models import build_model, build_tokenizer  # noqa: E402
from verl_fast.kernels import decode_sampling, rope_cache  # noqa: E402
from verl_fast.records.generation import SamplingSpec  # noqa: E402
from verl_fast.rollout import hf_decode, merged_projections  # noqa: E402
from verl_fast.rollout.hf_engine import HFGenerateEngine  # noqa: E402

VOCAB = 256


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return build_model(request.param, vocab_size=VOCAB, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                       eos_token_id=0, pad_token_id=0)


@contextlib.contextmanager
def merged(model):
    """The merged q/k/v and gate/up forwards installed, as the compiled decode runs them."""
    done = []
    merged_projections.Merged().install(model, None, done)
    try:
        yield
    finally:
        merged_projections.Merged.remove(done)


@pytest.fixture
def calls(monkeypatch):
    """How often each fused kernel's launcher ran."""
    count = {"rope": 0, "sample": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            count[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(rope_cache, "rope_cache_write", spy("rope", rope_cache.rope_cache_write))
    monkeypatch.setattr(decode_sampling, "sample_step", spy("sample", decode_sampling.sample_step))
    return count


# on a machine with a GPU the kernels take CPU tensors only under the interpreter
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("min_rows", [None, 1])
def test_fused_greedy_equals_generate_and_the_torch_step(model, device, min_rows, calls):
    model.to(device)
    ids, mask = (t.to(device) for t in ragged_prompts())
    free, _ = generate_greedy(model, ids, mask, None)
    stop, ends = spread_stop_ids(free)
    want, want_logp = generate_greedy(model, ids, mask, stop)
    runs, logs = {}, {}
    with merged(model):
        for fused in (False, True):
            logs[fused] = []
            runs[fused] = hf_decode.decode(model, ids, mask, CAP, 0.0, 0, 1.0, stop, 0, use_graph=device == "cuda",
                                           check_every=2, min_rows=min_rows, log=logs[fused], fused=fused)
    steps = logs[True][-1][0]
    layers = model.config.num_hidden_layers
    # every step the Python ran called both kernels: each step on the CPU; on a GPU the steps before the
    # graph's capture, its warm-up and capture (the replays call no Python)
    assert calls["sample"] >= (steps - 1 if device == "cpu" else 1), (calls, steps)
    assert calls["rope"] == layers * calls["sample"], (calls, steps)
    assert logs[True] == logs[False]  # the same steps and batch sizes
    tokens, logp, _ = runs[True]
    assert torch.equal(tokens, want) and torch.equal(tokens, runs[False][0])
    torch.testing.assert_close(logp, runs[False][1], atol=1e-5, rtol=0)
    for row, end in enumerate(ends):
        n = min(end + 1, CAP)
        torch.testing.assert_close(logp[row, :n], want_logp[row, :n], atol=1e-5, rtol=0)


def test_fused_sampled_log_probs_match_a_teacher_forced_forward(model, calls):
    ids, mask = ragged_prompts(count=4)
    rows = torch.arange(4).repeat_interleave(3)
    torch.manual_seed(0)
    with merged(model):
        tokens, logp, _ = hf_decode.decode(model, ids, mask, 10, 0.7, -1, 1.0, [0], 0, use_graph=False, rows=rows,
                                           fused=True)
    assert calls["sample"] == 9 and calls["rope"] == 9 * model.config.num_hidden_layers
    assert len({tuple(r) for r in tokens.tolist()}) > 6  # samples of one prompt draw apart
    for row in range(12):
        prompt = ids[rows[row]][mask[rows[row]].bool()].tolist()
        live = (torch.cumsum((tokens[row] == 0).long(), 0) - (tokens[row] == 0).long()) == 0  # through the stop
        response = tokens[row][live].tolist()
        with torch.no_grad():
            full = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1].double()
        want = torch.log_softmax(full / 0.7, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        torch.testing.assert_close(logp[row][live].double(), want, atol=1e-4, rtol=0)
        assert (logp[row][~live] == 0).all()


def test_top_k_and_top_p_keep_the_torch_sampling(model, calls):
    ids, mask = ragged_prompts(count=2)
    with merged(model):
        hf_decode.decode(model, ids, mask, 6, 0.7, 5, 0.9, [0], 0, use_graph=False, fused=True)
    assert calls["sample"] == 0 and calls["rope"] == 5 * model.config.num_hidden_layers


@pytest.mark.parametrize("setting,device,want", [("on", "cpu", True), ("off", "cpu", False), ("auto", "cpu", False),
                                                 pytest.param("auto", "cuda", True, marks=pytest.mark.gpu)])
def test_the_engine_fuses_as_rollout_hf_fused_kernels_says(setting, device, want, monkeypatch):
    tok = build_tokenizer()
    m = build_model("qwen2", vocab_size=len(tok), num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id).to(device)
    seen = []
    real = hf_decode.decode
    monkeypatch.setattr(hf_decode, "decode", lambda *a, **kw: seen.append(kw["fused"]) or real(*a, **kw))
    engine = HFGenerateEngine(m, tok, fast_decode="on", fused_kernels=setting)
    out = engine.generate([tok("the answer is")["input_ids"]], SamplingSpec(n=2, temperature=1.0, max_tokens=4))
    assert seen == [want] and out.num_sequences == 2
    assert engine.settings()["fused_kernels"] == setting


def test_the_engine_refuses_a_bad_setting():
    tok = build_tokenizer()
    m = build_model("qwen2", vocab_size=len(tok), num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="fused_kernels must be one of"):
        HFGenerateEngine(m, tok, fused_kernels="yes")
