"""Multi-turn KV continuation (rollout/kv_turns.py, hf_decode's ``past``): each turn of a conversation,
continued from its cached keys and values, against the whole conversation prefilled again (the static-cache
loop) and against plain ``generate`` on it; the next turn's sampled tokens against a float64 reference
distribution; the prefill counts."""


import pytest
import torch

from tiny_models import build_model, build_tokenizer
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout import decode_memory, hf_decode, kv_turns
from verl_fast.rollout.hf_engine import HFGenerateEngine


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tok):
    torch.manual_seed(0)
    m = build_model(request.param, vocab_size=len(tok), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    m.generation_config.eos_token_id = tok.eos_token_id
    return m


TEXTS = ["What is 1 + 2?", "the answer is", "compute the sum of 41 and 7 please and then add the total", "x",
         "What is 99 - 3? total"]


def observation(tok, row, turn):
    """A ragged observation: row- and turn-dependent length."""
    return tok(" plus" * (1 + (row + turn) % 4) + " equals")["input_ids"]


def run_turns(engine, tok, turns_of, max_tokens, use_cache, temperature=0.0, seed=None, reserve=0, figures=None,
              hold=False):
    """Conversations of ``TEXTS``, row r running ``turns_of[r]`` turns of at most ``max_tokens[r]`` tokens
    each, an observation after every turn; through ``engine.turn_cache()`` (``use_cache``, its ``reserve`` set,
    the engine's decoding state held over the turns with ``hold``) or ``generate`` on the whole conversation
    (each call's ``engine.metrics()`` appended to ``figures``). Returns per row the turns' (tokens, log-probs,
    reason), and the cache."""
    cache = engine.turn_cache() if use_cache else None
    if reserve:
        cache.reserve(reserve)
    if hold:
        cache.hold()
    convs = {r: tok(TEXTS[r])["input_ids"] for r in range(len(turns_of))}
    out = {r: [] for r in convs}
    turn = 0
    while convs:
        live = sorted(convs)
        specs = [SamplingSpec(temperature=temperature, max_tokens=max_tokens[r], seed=seed) for r in live]
        prompts = [convs[r] for r in live]
        res = cache.generate(live, prompts, specs) if use_cache else engine.generate(prompts, specs)
        if figures is not None:
            figures.append(engine.metrics())
        for b, r in enumerate(live):
            n = int(res.response_mask[b].sum())
            toks = res.response_ids[b, :n].tolist()
            out[r].append((toks, res.logprobs[b, :n], res.finish_reasons[b]))
            if len(out[r]) == turns_of[r]:
                del convs[r]
                if cache is not None:
                    cache.drop(r)
            else:
                convs[r] = convs[r] + toks + observation(tok, r, turn)
        turn += 1
    return out, cache


def assert_same_turns(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for r in a:
        assert [t[0] for t in a[r]] == [t[0] for t in b[r]], f"row {r}"
        assert [t[2] for t in a[r]] == [t[2] for t in b[r]], f"row {r}"
        for (_, la, _), (_, lb, _) in zip(a[r], b[r]):
            torch.testing.assert_close(la, lb, atol=atol, rtol=0)


@pytest.mark.parametrize("fused", ["off", "on"])
def test_greedy_turns_equal_reprefill_and_generate(model, tok, fused):
    """Ragged prompts and observations, rows ending at different turns, per-row token caps in one call;
    with the decode's fused kernels too (their rotary + cache write lands in the continued cache)."""
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off", fused_kernels=fused)
    plain = HFGenerateEngine(model, tok, fast_decode="off")
    turns_of, caps = [4, 2, 3, 1, 4], [5, 7, 4, 6, 3]
    cont, cache = run_turns(fast, tok, turns_of, caps, use_cache=True)
    again, _ = run_turns(fast, tok, turns_of, caps, use_cache=False)
    generated, _ = run_turns(plain, tok, turns_of, caps, use_cache=False)
    assert fast.last_mode == "eager" and plain.last_mode == "generate"
    assert_same_turns(cont, again)
    assert_same_turns(cont, generated)
    assert [len(cont[r]) for r in range(5)] == turns_of
    # the prefill: the prompts once, then per continued row its last sampled token and the observation
    prompts = sum(len(tok(TEXTS[r])["input_ids"]) for r in range(5))
    continued = [(r, k) for r in range(5) for k in range(turns_of[r] - 1)]
    assert [c["rows"] for c in cache.calls] == [5, 4, 3, 2]
    assert [c["restarted"] for c in cache.calls] == [0, 0, 0, 0]  # fewer rows each call: a new decoder each
    assert cache.calls[0] == {"rows": 5, "prefilled": prompts, "reused": 0, "restarted": 0}
    fed = prompts + sum(1 + len(observation(tok, r, k)) for r, k in continued)
    total = sum(len(tok(TEXTS[r])["input_ids"]) + sum(len(t[0]) + len(observation(tok, r, k))
                                                     for k, t in enumerate(cont[r][: j + 1]))
                for r, j in continued)  # each continued turn's whole conversation
    metrics = cache.metrics()
    assert metrics["prefill_tokens"] == fed
    assert metrics["prefill_tokens"] + metrics["prefill_tokens_saved"] == prompts + total
    assert not cache.rows  # every conversation dropped


def test_a_call_in_chunks_never_restarts_in_a_cache_its_later_chunks_hold(model, tok, monkeypatch):
    """Where the device's room cuts a call into chunks, the rows of its later chunks still hold the previous
    turn's cache until their own decode gathers it: the first chunk must not restart in (overwrite) it. The
    turns equal those of a new decoder per turn, with shrinking caps as the agents' turns have."""
    monkeypatch.setattr(decode_memory, "prompts_per_call", lambda *a, **k: 2)  # two rows a call fit
    turns_of, caps = [2] * 4, [[8] * 4, [4, 6, 3, 5]]

    def turns(restart):
        monkeypatch.setattr(kv_turns, "RESTART", restart)
        engine = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
        monkeypatch.setattr(engine, "_room_bytes", lambda: 10 ** 12)
        cache = engine.turn_cache()
        convs = {r: tok(TEXTS[r])["input_ids"] for r in range(4)}
        out = []
        for turn in range(2):
            res = cache.generate(list(range(4)), [convs[r] for r in range(4)],
                                 [SamplingSpec(temperature=0.0, max_tokens=caps[turn][r]) for r in range(4)])
            for r in range(4):
                n = int(res.response_mask[r].sum())
                out.append((res.response_ids[r, :n].tolist(), res.logprobs[r, :n]))
                convs[r] = convs[r] + out[-1][0] + observation(tok, r, turn)
        return out, cache

    got, cache = turns(True)
    want, _ = turns(False)
    assert len(cache.calls) == 4  # two chunks a call
    for (a, la), (b, lb) in zip(got, want):
        assert a == b
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)


def test_a_restart_drops_the_graph_when_the_weights_moved(model, tok, monkeypatch):
    """A captured step replays the addresses it was captured with: a turn that restarts in the previous
    decoder keeps its graph only while every weight the step reads is where it was (an FSDP gather or an
    FP8 copy made again moves them); the graph is stood in for by a marker (no CUDA here)."""
    marker, seen = object(), []
    run_steps = hf_decode._run_steps

    def spy(dec, *args, **kwargs):
        seen.append(dec.graph is marker)
        return run_steps(dec, *args, **kwargs)

    monkeypatch.setattr(hf_decode, "_run_steps", spy)
    engine = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    cache = engine.turn_cache()
    cache.reserve(200)
    convs = {r: tok(TEXTS[r])["input_ids"] for r in range(3)}
    weight = next(model.parameters())
    for turn in range(3):
        if cache.decoder is not None:
            cache.decoder.graph = marker
        if turn == 2:
            weight.data = weight.data.clone()  # the same numbers elsewhere
        res = cache.generate(list(range(3)), [convs[r] for r in range(3)], SamplingSpec(temperature=0.0, max_tokens=4))
        for r in range(3):
            convs[r] = convs[r] + res.response_ids[r, : int(res.response_mask[r].sum())].tolist() + \
                observation(tok, r, turn)
    assert [c["restarted"] for c in cache.calls] == [0, 1, 1]
    assert seen == [False, True, False]


@pytest.mark.parametrize("fused", ["off", "on"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lockstep_turns_restart_one_decoder(model, tok, monkeypatch, fused, temperature):
    """Every conversation in every call (a lockstep rollout), the first cache reserved for the longest
    conversation: each later turn restarts in the first turn's decoder, and its turns are those of a new
    decoder per turn -- the same draws (the same noise, consumed in the same order), log-probs to float
    rounding of the wider cache -- and, greedy, those of re-prefilling and of ``generate``."""
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off", fused_kernels=fused)
    turns_of, caps = [4] * 5, [6] * 5
    longest = max(len(tok(t)["input_ids"]) for t in TEXTS) + 4 * 6 + 4 * len(observation(tok, 2, 1))
    kept, cache = run_turns(fast, tok, turns_of, caps, use_cache=True, temperature=temperature, seed=3,
                            reserve=longest)
    assert [c["restarted"] for c in cache.calls] == [0, 1, 1, 1]
    monkeypatch.setattr(kv_turns, "RESTART", False)
    fresh, again = run_turns(fast, tok, turns_of, caps, use_cache=True, temperature=temperature, seed=3,
                             reserve=longest)
    assert [c["restarted"] for c in again.calls] == [0, 0, 0, 0]
    assert_same_turns(kept, fresh)
    if temperature == 0.0:
        whole, _ = run_turns(fast, tok, turns_of, caps, use_cache=False)
        assert_same_turns(kept, whole)
    else:  # sampled: the turns differ from turn to turn (the draws are not all one token)
        assert len({tuple(t[0]) for r in kept for t in kept[r]}) > 5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_turns_prefill_their_new_tokens_unpadded(tok, temperature, monkeypatch):
    """The compiled loop pads a first turn's prompts to a multiple of ``CompiledForward.WIDTH`` columns, not a
    later turn's new tokens (its cache is as wide as the turns need whatever they are): each later turn's prefill
    as wide as its past and its longest new part, run by the compiled forward (a restart's prefill: its new tokens
    in one call of it). Its turns are, greedy, the eager loop's; sampled (the same seed), those of a compiled
    decoder per turn, whose prefill is eager (the compiled steps draw their noise otherwise than eager ones)."""
    torch.manual_seed(0)
    m = build_model("qwen2", vocab_size=len(tok), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    m.generation_config.eos_token_id = tok.eos_token_id
    compiled = HFGenerateEngine(m, tok, fast_decode="on", compact_rows="off", compile_decode=True)
    eager = HFGenerateEngine(m, tok, fast_decode="on", compact_rows="off")
    widths, forward = [], compiled._compiled.fn

    def counted(module, ids, *args, **kwargs):
        widths.append(ids.shape[1])
        return forward(module, ids, *args, **kwargs)

    compiled._compiled.fn = counted
    turns_of, caps = [3, 3, 3], [5, 5, 5]
    got, cache = run_turns(compiled, tok, turns_of, caps, use_cache=True, reserve=80, temperature=temperature,
                           seed=11, hold=True)
    if temperature == 0.0:
        want, _ = run_turns(eager, tok, turns_of, caps, use_cache=True, reserve=80)
    else:
        monkeypatch.setattr(kv_turns, "RESTART", False)
        compiled._compiled.fn = forward
        want, _ = run_turns(compiled, tok, turns_of, caps, use_cache=True, reserve=80, temperature=temperature,
                            seed=11, hold=True)
    assert compiled.fast_failed is None
    assert_same_turns(got, want)
    assert [c["restarted"] for c in cache.calls] == [0, 1, 1]
    new_widths = [1 + max(len(observation(tok, r, turn)) for r in range(3)) for turn in (0, 1)]
    assert [w for w in widths if w > 1] == new_widths  # the two restarts' prefills; the steps feed one column
    new = [1 + len(observation(tok, r, 1)) for r in range(3)]  # the last turn's: its first token, the observation
    past = max(len(tok(TEXTS[r])["input_ids"]) + 5 + len(observation(tok, r, 0)) + 4 for r in range(3))
    assert cache.decoder.prefilled == past + max(new)
    # the compiles are bounded: once a conversation has run down to one row (the rows' and the new widths'
    # 1 / many specialisations seen), conversations of other lengths and row counts compile nothing more, and
    # the forward's compiles stay below dynamo's recompile limit (past it the steps would run eager)
    graphs = [torch._dynamo.utils.counters["stats"]["unique_graphs"]]
    for turns_of, caps in (([2, 4], [7, 3]), ([4, 1, 2], [3, 6, 4]), ([3, 2], [4, 5])):
        run_turns(compiled, tok, turns_of, caps, use_cache=True, reserve=80, temperature=temperature, seed=5, hold=True)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[2] == graphs[3], graphs
    code = forward._torchdynamo_orig_callable.__code__  # this engine's own (``hf_decode.own_code``)
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) < torch._dynamo.config.recompile_limit


def test_the_reserve_gives_way_where_the_room_does_not_hold_it(model, tok, monkeypatch):
    """The first turn's cache is made as wide as ``reserve`` asks where the device's room holds the whole call
    at that width; where it holds the call only at its own width, the call is not cut into pieces for the
    reserve: one call, its cache as wide as it needs."""
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    prompts = [tok(TEXTS[r])["input_ids"] for r in range(3)]
    spec, reserve = SamplingSpec(temperature=0.0, max_tokens=4), 200
    width = max(len(p) for p in prompts)
    wide = reserve + 4 + hf_decode.CompiledForward.WIDTH  # the reserve, a turn, the compiled loop's padding

    def need(columns):  # three rows' bytes at a width
        return 3 * decode_memory.bytes_per_prompt(model.config, columns, 4, 1, fast.kv_element_bytes())

    for room, length in ((need(width) + 1, width + 4), (need(wide - 4) + 1, wide)):
        monkeypatch.setattr(fast, "_room_bytes", lambda room=room: room)
        cache = fast.turn_cache()
        cache.reserve(reserve)
        cache.generate([0, 1, 2], prompts, spec)
        assert len(cache.calls) == 1 and cache.decoder.cache.length == length


def test_a_decoder_another_conversation_holds_is_not_restarted(model, tok):
    """Two calls of two conversations each, then the first two again: the last decoder (the second call's)
    still holds conversations 2 and 3, so the third call decodes anew, and 2 and 3 continue as before."""
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    spec = SamplingSpec(temperature=0.0, max_tokens=4)
    prompts = {r: tok(TEXTS[r])["input_ids"] for r in range(4)}
    cache = fast.turn_cache()
    cache.reserve(64)
    for pair in ([0, 1], [2, 3], [0, 1], [2, 3]):
        got = cache.generate(pair, [prompts[r] for r in pair], spec)
        want = fast.generate([prompts[r] for r in pair], spec)
        assert torch.equal(got.response_ids, want.response_ids)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
        for b, r in enumerate(pair):
            prompts[r] = prompts[r] + got.response_ids[b, : int(got.response_mask[b].sum())].tolist() + \
                observation(tok, r, 0)
    assert [c["restarted"] for c in cache.calls] == [0, 0, 0, 0]


def test_new_tokens_prefilled_in_chunks_after_the_past(model, tok, monkeypatch):
    """A prefill chunk of 5 columns: the new tokens run in several chunks, each attending to the past."""
    monkeypatch.setattr(decode_memory, "PREFILL_CHUNK", 5)
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    turns_of, caps = [3, 2, 3], [4, 6, 5]
    cont, _ = run_turns(fast, tok, turns_of, caps, use_cache=True)
    again, _ = run_turns(fast, tok, turns_of, caps, use_cache=False)
    assert_same_turns(cont, again)


def test_changed_tokens_prefill_the_whole_conversation(model, tok):
    """A conversation whose cached tokens no longer begin its prompt (edited) is prefilled whole; the other
    rows of the call still continue their caches."""
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    spec = SamplingSpec(temperature=0.0, max_tokens=4)
    prompts = [tok(TEXTS[r])["input_ids"] for r in range(3)]
    cache = fast.turn_cache()
    first = cache.generate([0, 1, 2], prompts, spec)
    nxt = [p + first.response_ids[r, : int(first.response_mask[r].sum())].tolist() + observation(tok, r, 0)
           for r, p in enumerate(prompts)]
    nxt[1] = tok(TEXTS[4])["input_ids"] + nxt[1][len(prompts[1]):]  # row 1's history rewritten
    got = cache.generate([0, 1, 2], nxt, spec)
    want = fast.generate(nxt, spec)
    assert torch.equal(got.response_ids, want.response_ids)
    obs = [len(observation(tok, r, 0)) for r in range(3)]
    assert cache.calls[1]["prefilled"] == (1 + obs[0]) + len(nxt[1]) + (1 + obs[2])
    assert cache.calls[1]["reused"] == (len(nxt[0]) - 1 - obs[0]) + (len(nxt[2]) - 1 - obs[2])


def test_sampled_next_turn_draws_from_the_conversations_distribution(model, tok):
    """2,000 copies of one conversation: a greedy first turn, then one sampled token from the cached
    context; its histogram against the float64 softmax of the whole conversation's logits (chi-square),
    and each draw's log-prob against the reference's."""
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    R, T, top_k = 2000, 0.8, 8
    prompt = tok(TEXTS[2])["input_ids"]
    cache = fast.turn_cache()
    first = cache.generate(list(range(R)), [prompt] * R, SamplingSpec(temperature=0.0, max_tokens=5))
    conv = prompt + first.response_ids[0, :5].tolist() + observation(tok, 0, 1)
    out = cache.generate(list(range(R)), [conv] * R, SamplingSpec(temperature=T, top_k=top_k, max_tokens=1, seed=5))
    assert cache.calls[1]["prefilled"] == R * (1 + len(observation(tok, 0, 1)))
    with torch.no_grad():
        logits = model.double()(input_ids=torch.tensor([conv])).logits[0, -1] / T
    model.float()
    logp = torch.log_softmax(logits, -1)
    probs = logp.exp()
    if top_k:
        kth = torch.topk(logits, top_k).values[-1]
        probs = torch.where(logits >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    drawn = out.response_ids[:, 0]
    torch.testing.assert_close(out.logprobs[:, 0].double(), logp[drawn], atol=1e-5, rtol=0)
    counts = torch.bincount(drawn, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0  # nothing outside top-k
    expected = probs * R
    big = expected >= 5  # bins with enough mass; the rest pooled into one
    observed_bins = torch.cat([counts[big], counts[~big].sum()[None]])
    expected_bins = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected_bins > 0
    chi2 = (((observed_bins - expected_bins) ** 2) / expected_bins)[keep].sum()
    dof = int(keep.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2).item()
    assert p_value > 1e-3, (chi2.item(), dof)


def test_the_call_refuses_more_than_one_sample_and_mismatched_lengths(model, tok):
    cache = HFGenerateEngine(model, tok, fast_decode="on").turn_cache()
    with pytest.raises(ValueError, match=r"one response per conversation \(n=1\), got n=2"):
        cache.generate([0], [[1, 2]], SamplingSpec(n=2))
    with pytest.raises(ValueError, match="2 keys, 1 prompts, 1 specs"):
        cache.generate([0, 1], [[1, 2]], [SamplingSpec()])


def test_the_engine_metrics_are_each_rollouts_own(model, tok):
    """A multi-turn rollout's turns decode through the loop one call each: ``metrics()`` reports that
    rollout's calls and times, not the sum over every rollout so far."""
    fast = HFGenerateEngine(model, tok, fast_decode="on")
    turns_of, caps = [3, 2, 3, 1, 2], [6] * 5
    for _ in range(2):
        run_turns(fast, tok, turns_of, caps, use_cache=True)
        figures = fast.metrics()
        assert figures["decode_calls"] == max(turns_of) and figures["prefill_s"] > 0, figures
    assert fast.metrics() == {"cuda_graph": 0.0}  # read: nothing decoded since


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_held_turns_are_the_turns_entered_per_call(model, tok, temperature):
    """The engine's decoding state held over a rollout's turns (``TurnCache.hold``): the same tokens, log-probs
    and reasons as entering it at every call, greedy and sampled (the same seed), under autocast too; each call's
    phases figured (``launch_s``, ``return_s``); ``close`` lets the state go (the actor's train mode back)."""
    model.train()
    for autocast in (None, torch.bfloat16):
        engine = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off", autocast_dtype=autocast)
        turns_of, caps = [3, 2, 3, 1, 2], [5, 6, 4, 6, 5]
        per_call, _ = run_turns(engine, tok, turns_of, caps, use_cache=True, temperature=temperature, seed=7)
        assert model.training
        held, cache = run_turns(engine, tok, turns_of, caps, use_cache=True, temperature=temperature, seed=7,
                                hold=True)
        assert not model.training  # held: eval mode between the calls
        figures = cache.call_metrics()
        assert figures["launch_s"] > 0 and figures["return_s"] > 0, figures
        assert cache.call_metrics() == {}  # read: handed over
        cache.close()
        assert model.training
        assert_same_turns(held, per_call, atol=0)


def test_holding_keeps_decoding_entered_on_its_own_thread_only(model, tok):
    """Inside ``holding``, a decode call's ``decoding`` enters nothing more on that thread (its exit leaves eval
    mode on); on another thread ``decoding`` is entered as ever."""
    import threading

    engine = HFGenerateEngine(model, tok, fast_decode="on")
    model.train()
    with engine.holding(model):
        with engine.decoding(model):
            pass
        assert not model.training
        other = []
        thread = threading.Thread(target=lambda: other.append(engine._held.__dict__.get("module")))
        thread.start()
        thread.join()
        assert other == [None]
    assert model.training


def test_compiled_weights_entered_again_inside_themselves_swap_once(model):
    """``CompiledForward.weights`` inside itself (a held rollout's decode calls): the swapped weights stay until
    the outer exit, which puts the parameters back."""
    compiled = hf_decode.CompiledForward()
    lm_head, attention = model.lm_head, model.model.layers[0].self_attn
    before = lm_head.weight
    with torch.autocast("cpu", dtype=torch.bfloat16), compiled.weights(model):
        swapped, merged = lm_head.weight, attention._parameters["merged_weight"]
        assert swapped is not before and swapped.dtype == torch.bfloat16
        with compiled.weights(model):
            assert lm_head.weight is swapped
        assert lm_head.weight is swapped and attention._parameters.get("merged_weight") is merged
    assert lm_head.weight is before and "merged_weight" not in attention._parameters and compiled.inside is None


def test_a_held_cache_lets_the_state_go_for_generate(model, tok):
    """A call the static-cache loop cannot serve (stop strings) goes to the engine's ``generate``: the held state
    is released first, and the turn is generate's."""
    engine = HFGenerateEngine(model, tok, fast_decode="on")
    cache = engine.turn_cache()
    cache.hold()
    prompt = tok(TEXTS[0])["input_ids"]
    spec = SamplingSpec(temperature=0.0, max_tokens=4, stop=("zzz",))
    out = cache.generate([0], [prompt], spec)
    assert cache._held is None
    plain = engine.generate([prompt], spec)
    assert out.response_ids.tolist() == plain.response_ids.tolist()
    cache.close()


def test_a_held_rollout_reads_the_model_once(model, tok, monkeypatch):
    """Held (``TurnCache.hold``), what each call would read off the model -- the weights' addresses a restart
    checks, whether the model is sharded, whether the loop serves it -- is read once, at the hold, for all of the
    rollout's calls; a call outside a hold reads it again (its weights may have moved since the last)."""
    from verl_fast.rollout import hf_engine

    counts = {"addresses": 0, "sharded": 0, "unsupported": 0}

    def counted(name, fn):
        def inner(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return inner

    monkeypatch.setattr(hf_decode, "_addresses", counted("addresses", hf_decode._addresses))
    monkeypatch.setattr(hf_engine, "is_sharded", counted("sharded", hf_engine.is_sharded))
    monkeypatch.setattr(hf_decode, "unsupported", counted("unsupported", hf_decode.unsupported))
    engine = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")

    def three_turns(hold):
        cache = engine.turn_cache()
        cache.reserve(200)
        if hold:
            cache.hold()
        convs = [tok(TEXTS[r])["input_ids"] for r in range(3)]
        start = dict(counts)
        for turn in range(3):
            res = cache.generate(list(range(3)), convs, SamplingSpec(temperature=0.0, max_tokens=4))
            convs = [c + res.response_ids[r, : int(res.response_mask[r].sum())].tolist() + observation(tok, r, turn)
                     for r, c in enumerate(convs)]
        cache.close()
        return cache, {k: counts[k] - start[k] for k in counts}

    cache, held = three_turns(hold=True)
    assert [c["restarted"] for c in cache.calls] == [0, 1, 1]
    assert held == {"addresses": 0, "sharded": 0, "unsupported": 0}, held  # (the hold read each once)
    _, per_call = three_turns(hold=False)
    assert per_call["addresses"] == 3 and per_call["sharded"] >= 3 and per_call["unsupported"] >= 3, per_call


def test_a_call_decodes_no_texts(model, tok, monkeypatch):
    """The callers of ``TurnCache.generate`` keep tokens: a call decodes none of its rows to text."""
    cache = HFGenerateEngine(model, tok, fast_decode="on").turn_cache()
    decoded = []
    monkeypatch.setattr(tok, "decode", lambda *args, **kwargs: decoded.append(args) or "")
    out = cache.generate([0, 1], [tok(TEXTS[0])["input_ids"], tok(TEXTS[1])["input_ids"]],
                         SamplingSpec(temperature=0.0, max_tokens=3))
    assert out.response_ids.shape[0] == 2 and out.texts == [] and decoded == []


def test_cut_ends_each_row_at_its_first_stop_within_its_limit():
    """``cut`` against a row-by-row scan: the first stop token within the row's limit, inclusive; else the limit."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 9, (40, 11), generator=gen)
    limits = torch.randint(1, 12, (40,), generator=gen).tolist()
    stops = {2, 7}
    n, reasons = kv_turns.cut(tokens, limits, stops)
    for row, limit, got, why in zip(tokens.tolist(), limits, n.tolist(), reasons):
        hits = [i for i, t in enumerate(row[:limit]) if t in stops]
        assert (got, why) == ((hits[0] + 1, "stop") if hits else (limit, "length"))
    assert {"stop", "length"} <= set(reasons)
    n, reasons = kv_turns.cut(tokens, limits, set())  # no stop ids
    assert n.tolist() == limits and set(reasons) == {"length"}


def test_left_pad_and_padded_lay_out_rows_as_the_row_by_row_forms():
    """``left_pad``: each row right-aligned behind pad tokens, mask 1 on its tokens; ``padded``: the parts' rows in
    the call's order as ``pad_completions`` lays out the same rows (log-probs 0 for a part without them)."""
    from verl_fast.records.generation import pad_completions

    rows = [[5, 6, 7], [], [8], [1, 2, 3, 4, 9]]
    ids, mask = kv_turns.left_pad(rows, pad=0)
    assert ids.tolist() == [[0, 0, 5, 6, 7], [0, 0, 0, 0, 0], [0, 0, 0, 0, 8], [1, 2, 3, 4, 9]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0] * 5, [0, 0, 0, 0, 1], [1] * 5] and mask.dtype == torch.long
    gen = torch.Generator().manual_seed(1)
    first = ([3, 0, 4], torch.randint(10, 20, (3, 6), generator=gen), torch.tensor([6, 1, 4]),
             torch.randn(3, 6, generator=gen), ["length", "stop", "stop"])
    second = ([1, 2], torch.randint(10, 20, (2, 3), generator=gen), torch.tensor([2, 3]), None, ["stop", "length"])
    out = kv_turns.padded([first, second], 5, pad=99)
    turns = {}
    for members, tokens, n, lps, why in (first, second):
        for k, i in enumerate(members):
            m = int(n[k])
            turns[i] = (tokens[k, :m].tolist(), lps[k, :m].tolist() if lps is not None else [0.0] * m, why[k])
    want = pad_completions([turns[i][0] for i in range(5)], [turns[i][1] for i in range(5)], list(range(5)), 99,
                           finish_reasons=[turns[i][2] for i in range(5)])
    for name in ("prompt_index", "response_ids", "response_mask", "logprobs"):
        assert torch.equal(getattr(out, name), getattr(want, name)), name
    assert out.finish_reasons == want.finish_reasons and out.texts == []


def test_pack_right_aligns_each_rows_kept_columns_from_its_decode():
    """``pack`` against a row-by-row gather: rows of two decodes, in mixed order, and a row without a cache; each
    row's kept columns (in order) right-aligned in the longest row's count and valid there only, the others
    zeros; each row's position its count."""
    gen = torch.Generator().manual_seed(2)
    layers, heads, dim = 3, 2, 4

    def store(rows, length, counts):
        kept = torch.zeros((rows, length), dtype=torch.bool)
        for r, k in enumerate(counts):
            kept[r, torch.randperm(length, generator=gen)[:k]] = True
        return kv_turns._Store([torch.randn(rows, heads, length, dim, generator=gen) for _ in range(layers)],
                               [torch.randn(rows, heads, length, dim, generator=gen) for _ in range(layers)], kept)

    a, b = store(3, 9, [4, 9, 2]), store(2, 12, [7, 11])
    cached = [kv_turns._Cached([0] * 9, a, 1), None, kv_turns._Cached([0] * 7, b, 0),
              kv_turns._Cached([0] * 2, a, 2), kv_turns._Cached([0] * 11, b, 1)]
    past = kv_turns.pack(cached, torch.device("cpu"))
    C = 11
    assert past.columns == C and past.position.tolist() == [9, 0, 7, 2, 11]
    for r, c in enumerate(cached):
        count = 0 if c is None else len(c.tokens)
        assert past.valid[r].tolist() == [False] * (C - count) + [True] * count
        cols = torch.zeros(C, dtype=torch.long)
        if c is not None:
            cols[C - count:] = c.store.kept[c.row].nonzero().squeeze(1)
        for layer in range(layers):
            for got, held in ((past.keys, "keys"), (past.values, "values")):
                want = getattr(c.store, held)[layer][c.row][:, cols] if c is not None else None
                if want is not None:
                    assert torch.equal(got[layer][r], want), (r, layer, held)
                else:
                    assert torch.equal(got[layer][r], torch.zeros(heads, C, dim)), (r, layer, held)


def test_no_cache_where_the_loop_does_not_decode(model, tok):
    assert HFGenerateEngine(model, tok, fast_decode="off").turn_cache() is None


@pytest.mark.gpu
def test_graph_decode_continues_turns_on_cuda(model, tok):
    model.to("cuda")
    try:
        fast = HFGenerateEngine(model, tok, fast_decode="on")
        turns_of, caps = [3, 2, 3, 1, 2], [20, 20, 20, 20, 20]
        cont, _ = run_turns(fast, tok, turns_of, caps, use_cache=True)
        assert fast.last_mode == "graph"
        again, _ = run_turns(fast, tok, turns_of, caps, use_cache=False)
        assert_same_turns(cont, again, atol=1e-4)
    finally:
        model.to("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("compiled,fused", [(False, "off"), (True, "on")])
def test_lockstep_turns_capture_one_graph_on_cuda(model, tok, monkeypatch, compiled, fused):
    """A 4-turn lockstep rollout on the GPU captures the decode step's graph once (the first turn) and replays
    it for the later turns, with the tokens and log-probs of a new decoder and graph per turn (eager, and
    compiled with the fused kernels: their rotary + cache write and sampling in the replayed graph)."""
    model.to("cuda")
    try:
        fast = HFGenerateEngine(model, tok, fast_decode="on", compile_decode=compiled, fused_kernels=fused)
        turns_of, caps = [4] * 5, [20] * 5
        longest = max(len(tok(t)["input_ids"]) for t in TEXTS) + 4 * 20 + 4 * len(observation(tok, 2, 1))
        kept_figures, fresh_figures = [], []
        kept, cache = run_turns(fast, tok, turns_of, caps, use_cache=True, reserve=longest, figures=kept_figures)
        assert fast.last_mode == "graph"
        assert [c["restarted"] for c in cache.calls] == [0, 1, 1, 1]
        assert [f["graph_captures"] for f in kept_figures] == [1, 0, 0, 0]
        monkeypatch.setattr(kv_turns, "RESTART", False)
        fresh, _ = run_turns(fast, tok, turns_of, caps, use_cache=True, reserve=longest, figures=fresh_figures)
        assert [f["graph_captures"] for f in fresh_figures] == [1, 1, 1, 1]
        assert_same_turns(kept, fresh, atol=1e-4)
        whole, _ = run_turns(fast, tok, turns_of, caps, use_cache=False)
        assert_same_turns(kept, whole, atol=1e-4)
    finally:
        model.to("cpu")
