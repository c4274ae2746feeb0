"""The rollout workers' decoding loop: the sampling filter against a float64 reference, greedy
tokens and behaviour log-probs against a teacher-forced forward, and tokens tagged with the version
that sampled them when weights change mid-generation (a partial rollout)."""

import copy

import pytest
import torch

from tiny_models import tiny_model
from verl_fast.async_rl.decode import decode, filter_logits
from verl_fast.records.generation import SamplingSpec


def reference_filter(logits, top_k, top_p):
    x = logits.double()
    out = x.clone()
    for b in range(x.shape[0]):
        order = sorted(range(x.shape[1]), key=lambda j: -float(x[b, j]))
        keep = set(order[:top_k]) if top_k > 0 else set(order)
        probs = torch.softmax(torch.tensor([float(x[b, j]) if j in keep else float("-inf") for j in order],
                                           dtype=torch.float64), 0)
        mass, kept = 0.0, set()
        for j, p in zip(order, probs.tolist()):
            if j in keep and (mass < top_p or not kept):
                kept.add(j)
            mass += p
        for j in range(x.shape[1]):
            if j not in kept:
                out[b, j] = float("-inf")
    return out


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (7, 0.5), (0, 0.01), (1, 0.9)])
def test_filter_keeps_the_top_k_and_the_top_p_mass(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 10 + int(top_p * 100))
    logits = torch.randn(3, 37, generator=g)
    got = filter_logits(logits, top_k, top_p)
    want = reference_filter(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("qwen2").eval()


def full_logprobs(model, prompt, tokens, temperature=1.0):
    """float64 log-probs of ``tokens`` after ``prompt``, teacher-forced in one forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(tokens)]


def test_greedy_matches_generate_and_log_probs_match_a_teacher_forced_pass(model):
    prompts = [[5, 9, 13, 2], [7, 3]]  # different lengths: left padding
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=8)
    out = decode(model, prompts, spec, torch.Generator().manual_seed(0), stop_ids=[], pad_id=0,
                 between_tokens=lambda: 0)
    for prompt, (sample,) in zip(prompts, out):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert sample.tokens == want and sample.finish_reason == "length"
        assert sample.logprobs == pytest.approx(full_logprobs(model, prompt, sample.tokens), abs=1e-4)
        assert sample.versions == [0] * 8


def test_sampled_log_probs_are_the_temperature_scaled_ones_and_stop_tokens_end_a_row(model):
    prompts = [[5, 9, 13, 2], [7, 3], [11]]
    spec = SamplingSpec(n=3, temperature=0.7, max_tokens=10)
    first = decode(model, prompts, spec, torch.Generator().manual_seed(3), [], 0, lambda: 0)
    stop = first[0][0].tokens[2]
    again = decode(model, prompts, spec, torch.Generator().manual_seed(3), [stop], 0, lambda: 0)
    for prompt, samples in zip(prompts, first):
        for s in samples:
            assert s.logprobs == pytest.approx(full_logprobs(model, prompt, s.tokens, 0.7), abs=1e-4)
    cut = again[0][0]
    assert cut.tokens == first[0][0].tokens[:3] and cut.finish_reason == "stop"


def test_weights_changed_mid_generation_reach_the_rows_in_flight_each_token_tagged(model):
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    live = copy.deepcopy(model)
    calls = []

    def between_tokens():  # version 1 arrives before the fourth token
        calls.append(len(calls))
        if len(calls) == 4:
            live.load_state_dict(other.state_dict())
        return 0 if len(calls) < 4 else 1

    prompts = [[5, 9, 13, 2]]
    spec = SamplingSpec(n=2, temperature=0.0, max_tokens=8)
    mixed = decode(live, prompts, spec, torch.Generator(), [], 0, between_tokens)[0]
    before = decode(model, prompts, spec, torch.Generator(), [], 0, lambda: 0)[0]
    for s, b in zip(mixed, before):
        assert s.versions == [0, 0, 0, 1, 1, 1, 1, 1]
        assert s.tokens[:3] == b.tokens[:3]  # sampled before the push: version 0's
    assert mixed[0].tokens[3:] != before[0].tokens[3:]
