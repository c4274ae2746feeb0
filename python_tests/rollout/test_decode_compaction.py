"""Finished rows leaving the static-cache decode (``hf_decode.decode``'s compaction): rows of very
different lengths give ``generate``'s greedy tokens and the uncompacted call's log-probs, and sampled
rows keep the model's exact distribution (a chi-square test on a model whose next token depends on the
current token only). The CUDA-graph path (one graph per batch size): gpu-marked."""

import pytest
import torch

from tiny_models import build_model, build_tokenizer
from verl_fast.rollout import decode_memory, hf_decode

VOCAB = 256
CAP = 40


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return build_model(request.param, vocab_size=VOCAB, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                       eos_token_id=0, pad_token_id=0)


def ragged_prompts(count=12, width=9, seed=1):
    """``count`` random left-padded prompts of 3..``width`` tokens: ids and mask [count, width]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (count,), generator=g)
    ids = torch.randint(1, VOCAB, (count, width), generator=g)
    mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def spread_stop_ids(tokens: torch.Tensor, rounds: int = 8):
    """Stop tokens that end the rows of these greedy continuations at many different steps, most of
    them early: each round adds the token that most raises the count of distinct end steps plus rows
    ended before the cap (a row without a stop token runs to the cap)."""
    def ends(stop):
        hit = torch.isin(tokens, torch.tensor(sorted(stop) or [-1]))
        return [int(row.nonzero()[0]) if row.any() else tokens.shape[1] for row in hit]

    def score(stop):
        e = ends(stop)
        return len(set(e)) + sum(x < tokens.shape[1] for x in e)

    stop = set()
    for _ in range(rounds):
        best = max(range(1, VOCAB), key=lambda v: score(stop | {v}))
        if score(stop | {best}) <= score(stop):
            break
        stop.add(best)
    return sorted(stop), ends(stop)


def device_of(model):
    return next(model.parameters()).device


def generate_greedy(model, ids, mask, stop):
    """HF ``generate``'s greedy tokens [P, CAP] (pad 0 after a stop) and their log-probs."""
    width = ids.shape[1]
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=CAP, do_sample=False, eos_token_id=stop,
                         pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    new = torch.nn.functional.pad(out.sequences[:, width:], (0, CAP - out.sequences.shape[1] + width)).cpu()
    logits = torch.stack(out.logits, 1).float().cpu()
    logp = torch.log_softmax(logits, -1).gather(-1, new[:, : logits.shape[1], None]).squeeze(-1)
    return new, logp


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_rows_of_ragged_lengths_equal_generate_with_and_without_compaction(model, device):
    model.to(device)
    ids, mask = (t.to(device) for t in ragged_prompts())
    free, _ = generate_greedy(model, ids, mask, None)
    stop, ends = spread_stop_ids(free)
    assert len(set(ends)) >= 6 and sorted(ends)[len(ends) // 2] < CAP // 2, ends  # ragged: most end early
    want, want_logp = generate_greedy(model, ids, mask, stop)
    runs = {}
    for name, min_rows in (("compacted", 1), ("whole", None)):
        log = []
        runs[name] = hf_decode.decode(model, ids, mask, CAP, 0.0, 0, 1.0, stop, 0, use_graph=device == "cuda",
                                      check_every=2, min_rows=min_rows, log=log)
        runs[name + "_log"] = log
    sizes = [rows for _, rows in runs["compacted_log"]]
    assert sizes[0] == 12 and len(sizes) > 3 and sizes[-2] < 6 and sizes == sorted(sizes, reverse=True), sizes
    assert [rows for _, rows in runs["whole_log"][:-1]] == [12]
    for name in ("compacted", "whole"):
        tokens, logp, mode = runs[name]
        assert mode == ("graph" if device == "cuda" else "eager")
        assert torch.equal(tokens, want), name
        for row, end in enumerate(ends):  # through the stop token; zeros after
            n = min(end + 1, CAP)
            torch.testing.assert_close(logp[row, :n], want_logp[row, :n], atol=1e-5, rtol=0)
            assert (logp[row, n:] == 0).all()
    torch.testing.assert_close(runs["compacted"][1], runs["whole"][1], atol=1e-5, rtol=0)  # float32 noise


def test_bucket_rows():
    assert [hf_decode.bucket_rows(n, 8) for n in (1, 8, 9, 12, 13, 17, 33, 50, 65, 96, 97, 128)] == \
        [8, 8, 12, 12, 16, 24, 48, 64, 96, 96, 128, 128]
    assert [hf_decode.bucket_rows(n, 1) for n in (1, 2, 3, 4, 5, 7, 9)] == [1, 2, 3, 4, 6, 8, 12]


def markov_model(vocab=12, seed=0):
    """A Qwen2 model whose attention and MLP outputs are zero: the hidden state is the current token's
    embedding, so the next token's distribution depends on the current token only (a Markov chain
    whose transition matrix one forward per token gives; here from 0.6% to 39% a transition). Token 0
    ends a row: its logit 0 (5-9% a step), so that rows end after a few to a few tens of tokens."""
    m = build_model("qwen2", vocab_size=vocab, seed=seed, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    eos_token_id=0, pad_token_id=0)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight[0] = 0
    return m


def transition_logits(m, vocab):
    with torch.no_grad():
        return m(input_ids=torch.arange(vocab, device=device_of(m))[:, None]).logits[:, 0].double().cpu()


@pytest.mark.parametrize("temperature,top_k,top_p,compiled,device,fused", [
    (1.0, 0, 1.0, False, "cpu", False), (0.8, 6, 0.95, False, "cpu", False), (0.9, 0, 0.9, True, "cpu", False),
    (0.7, 0, 1.0, False, "cpu", True),
    pytest.param(0.9, 0, 0.9, True, "cuda", False, marks=pytest.mark.gpu),
    pytest.param(0.9, 0, 1.0, True, "cuda", True, marks=pytest.mark.gpu)])
def test_sampled_rows_keep_the_exact_distribution_through_compaction(temperature, top_k, top_p, compiled, device,
                                                                     fused):
    """Transitions sampled from 400 rows (160 for the fused kernels on the CPU) of one prompt, compacted as they finish (checked every step,
    down to a few rows): their counts against the exact transition matrix (temperature, top-k, top-p applied in
    float64) by a chi-square test, and every recorded log-prob equal to the matrix's unfiltered one; also
    with the step's forward, sampling and bookkeeping compiled (Inductor's own random stream), and on a
    GPU replayed from each batch size's CUDA graph (each replay must draw fresh noise); and with the fused
    sampling kernel (``fused``: Triton's Philox, keyed per step; on CPU tensors under TRITON_INTERPRET)."""
    if fused and hf_decode.decode_sampling is None:
        pytest.skip("the fused sampling kernel needs Triton")
    from test_hf_decode import reference_probs

    vocab = 12
    m = markov_model(vocab).to(device)
    logits = transition_logits(m, vocab)
    probs = torch.stack([reference_probs(logits[x], temperature, top_k, top_p) for x in range(vocab)])
    logp_full = torch.log_softmax(logits / temperature, -1)
    ids, mask = torch.tensor([[3, 5, 7]], device=device), torch.ones(1, 3, dtype=torch.long, device=device)
    torch.manual_seed(0)
    # (the fused kernels interpreted on the CPU cost ~50 ms a row and step: fewer rows there; the kernel's own
    # distribution is held to the float64 reference over many more draws in test_decode_sampling.py)
    rows, log = 160 if fused and device == "cpu" else 400, []
    tokens, logp, mode = hf_decode.decode(m, ids, mask, 64, temperature, top_k, top_p, [0], 0,
                                          use_graph=device == "cuda", check_every=1 if device == "cpu" else 4,
                                          min_rows=8 if compiled else 1,  # (fewer compiles)
                                          rows=torch.zeros(rows, dtype=torch.long, device=device), log=log,
                                          compiled=hf_decode.CompiledForward() if compiled else None, fused=fused)
    assert mode == ("graph" if device == "cuda" else "eager")
    assert len(log) > 6 and log[-2][1] <= 96, log  # compacted many times
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    source = torch.cat([torch.full((rows, 1), 7), tokens[:, :-1]], 1)  # each token's previous one
    live = torch.cat([torch.ones(rows, 1, dtype=torch.bool), (tokens[:, :-1] != 0).cumprod(1).bool()], 1)
    counts.index_put_((source[live], tokens[live]), torch.ones(int(live.sum()), dtype=torch.float64), accumulate=True)
    expected = counts.sum(1, keepdim=True) * probs
    assert (counts[expected == 0] == 0).all(), "a filtered token was drawn"
    cells = expected >= 5
    chi2 = float(((counts - expected)[cells] ** 2 / expected[cells]).sum())
    dof = int(cells.sum()) - int((cells.sum(1) > 0).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)))  # chi-square survival
    assert p_value > 1e-3, (chi2, dof)
    torch.testing.assert_close(logp[live].double(), logp_full[source[live], tokens[live]], atol=1e-5, rtol=0)
    assert (logp[~live] == 0).all() and (tokens[~live] == 0).all()


@pytest.mark.gpu
def test_compacted_graphs_match_the_eager_loop_and_the_whole_batch():
    """On a GPU: one captured graph per batch size, the greedy tokens of the compacted graph replays
    equal to the eager loop's and to the uncompacted graph's (fp32), sampled log-probs to a
    teacher-forced forward's; a second call (new graphs over the kept pool) decodes the same."""
    m = build_model("qwen2", vocab_size=VOCAB, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    eos_token_id=0, pad_token_id=0).cuda()
    ids, mask = (t.cuda() for t in ragged_prompts(count=40, seed=2))
    free, _ = generate_greedy(m, ids, mask, None)
    stop, ends = spread_stop_ids(free, rounds=12)
    pool = hf_decode.GraphPool()
    got = {}
    for name, graph, min_rows in (("graph", True, 8), ("eager", False, 8), ("whole", True, None), ("again", True, 8)):
        log = []
        got[name] = hf_decode.decode(m, ids, mask, CAP, 0.0, 0, 1.0, stop, 0, use_graph=graph, graphs=pool,
                                     check_every=4, min_rows=min_rows, log=log)
        if min_rows is not None:
            assert len(log) > 2, log
    for name in ("eager", "whole", "again"):
        assert torch.equal(got[name][0], got["graph"][0]), name
        torch.testing.assert_close(got[name][1], got["graph"][1], atol=1e-5, rtol=0)
    assert got["graph"][2] == "graph" and got["eager"][2] == "eager"


@pytest.mark.parametrize("rows", [None, [0, 0, 2, 1, 2, 3, 3, 0]])
def test_a_prompt_prefilled_in_chunks_decodes_as_prefilled_at_once(model, monkeypatch, rows):
    """Prompts longer than ``PREFILL_CHUNK`` run their prefill in chunks (here 4 columns: 9-column prompts
    in three), each attending to the cache's earlier columns: the same greedy tokens and log-probs as
    one forward over the whole prompt, with each prompt's cache copied to the rows that decode it."""
    ids, mask = ragged_prompts(count=4)
    rows = None if rows is None else torch.tensor(rows)
    whole = hf_decode.decode(model, ids, mask, 12, 0.0, 0, 1.0, [-1], 0, use_graph=False, rows=rows)
    widths = []
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    monkeypatch.setattr(decode_memory, "PREFILL_CHUNK", 4)
    try:
        chunked = hf_decode.decode(model, ids, mask, 12, 0.0, 0, 1.0, [-1], 0, use_graph=False, rows=rows)
    finally:
        hook.remove()
    assert widths[:3] == [4, 4, 1] and set(widths[3:]) == {1}
    assert torch.equal(chunked[0], whole[0])
    torch.testing.assert_close(chunked[1], whole[1], atol=1e-5, rtol=0)


def countdown_model(vocab=64):
    """A Qwen2 model whose greedy next token is the current one minus one (its attention and MLP outputs
    zero, the embedding one-hot, the head shifted by one): a row whose first new token is k ends with the
    stop token 0 at new-token column k, k + 1 tokens, whatever the batch it decodes in."""
    m = build_model("qwen2", vocab_size=vocab, num_layers=2, hidden_size=vocab, num_heads=4, num_kv_heads=2,
                    eos_token_id=0, pad_token_id=0)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.model.embed_tokens.weight.copy_(torch.eye(vocab))
        m.lm_head.weight.zero_()
        m.lm_head.weight[:-1] = torch.eye(vocab)[1:] / 2  # logit w: half the hidden state at w + 1
    return m


@pytest.mark.parametrize("check_every", [1, 5])
@pytest.mark.parametrize("min_rows", [None, 1, 8])
@pytest.mark.parametrize("samples", [1, 2])
def test_the_decode_stops_within_check_every_steps_of_its_longest_row(check_every, min_rows, samples):
    """Rows of forced lengths (a long tail: the last rows live alone, fewer than ``MIN_ROWS``): the steps
    run -- the forwards counted, and the count ``log`` reports -- are the first check at or after the
    longest row's end, compacted or not, and each output row, in the caller's order, holds its own
    countdown through the stop token and pads after it."""
    m = countdown_model()
    lengths = torch.tensor([3, 45, 1, 7, 12, 2, 30, 5, 9, 4, 16, 2, 6, 33, 8, 3, 11, 1, 20, 5])
    width = 6
    ids = torch.randint(1, 64, (len(lengths), width), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = lengths  # the first new token: length - 1
    ids[::3, :2] = 0  # some prompts left-padded
    mask = (ids != 0).long()
    mask[:, -1] = 1
    rows = torch.arange(len(lengths)).repeat_interleave(samples)
    forwards, log = [], []
    hook = m.model.embed_tokens.register_forward_hook(lambda mod, args, out: forwards.append(args[0].shape[1]))
    try:
        tokens, logp, _ = hf_decode.decode(m, ids, mask, CAP + 20, 0.0, 0, 1.0, [0], 0, use_graph=False,
                                           check_every=check_every, min_rows=min_rows, rows=rows, log=log)
    finally:
        hook.remove()
    longest = int(lengths.max())
    steps = -(-longest // check_every) * check_every  # the first check at or after the longest row's end
    assert len(forwards) == steps == log[-1][0], (len(forwards), steps, log)
    assert steps <= longest + check_every
    if min_rows is not None:  # compacted down to the smallest batch
        assert log[-2][1] == hf_decode.bucket_rows(samples, min_rows) and len(log) > 3, log
    for row, length in enumerate(lengths.repeat_interleave(samples).tolist()):
        want = torch.cat([torch.arange(length - 1, -1, -1), torch.zeros(CAP + 20 - length, dtype=torch.long)])
        assert torch.equal(tokens[row], want), (row, length, tokens[row])
        assert (logp[row, length:] == 0).all() and (logp[row, :length] < 0).all()


def test_the_engine_compacts_as_rollout_hf_compact_rows_says(monkeypatch):
    """``rollout.hf_compact_rows`` through the HF engine to ``decode``'s ``min_rows``: auto compacts off a
    GPU and steps the whole batch on one; a bad value is named in one line, by the engine and the config."""
    from verl_fast import config
    from verl_fast.rollout.base import SamplingSpec
    from verl_fast.rollout.hf_engine import HFGenerateEngine

    tok = build_tokenizer()
    m = build_model("qwen2", vocab_size=len(tok), num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    seen = []
    real = hf_decode.decode
    monkeypatch.setattr(hf_decode, "decode", lambda *a, **k: seen.append(k["min_rows"]) or real(*a, **k))
    for setting, want in (("auto", hf_decode.MIN_ROWS), ("on", hf_decode.MIN_ROWS), ("off", None)):
        engine = HFGenerateEngine(m, tok, fast_decode="on", compact_rows=setting)
        engine.generate([[5, 6, 7]], SamplingSpec(n=2, max_tokens=3, seed=0))
        assert seen[-1] == want, setting
        assert engine.settings()["compact_rows"] == setting
    cuda = torch.device("cuda")
    assert HFGenerateEngine(m, tok, compact_rows="auto")._min_rows(cuda) is None
    assert HFGenerateEngine(m, tok, compact_rows="on")._min_rows(cuda) == hf_decode.MIN_ROWS
    with pytest.raises(ValueError, match="compact_rows must be one of"):
        HFGenerateEngine(m, tok, compact_rows="yes")
    assert config.from_dict({"rollout": {"hf_compact_rows": "off"}}).rollout.hf_compact_rows == "off"
    with pytest.raises(ValueError, match=r"rollout.hf_compact_rows must be one of \['auto', 'on', 'off'\]"):
        config.from_dict({"rollout": {"hf_compact_rows": "sometimes"}})
