"""The length mechanism in a random-weight model's weights (verl_fast/bench/lengths.py): the EOS probability
of every step is the rate its prompt's digits set (untied and tied Qwen2, a float64 reference of the rate),
responses sampled by HF generate follow the predicted heavy-tailed distribution, the calibration hits its
median, and the figures of measured lengths are right."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from ragged import ragged_config
from tiny_models import build_tokenizer
from verl_fast.bench import lengths


def chat(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


QUESTIONS = ["What is 12 + 7?", "What is 3 + 99 + 45?", "What is 80 + 6 + 1 + 52?", "Say hello.", "What is 5 + 5?"]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("hidden,heads,kv", [(64, 2, 1), (128, 4, 2)])
def test_eos_probability_is_the_prompts_rate_at_every_step(tied, hidden, heads, kv):
    tokenizer = build_tokenizer()
    spec = lengths.LengthSpec(bias=2.5, spread=0.8, seed=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ragged_config(tokenizer, tied, hidden_size=hidden, num_heads=heads,
                                                           num_kv_heads=kv, intermediate_size=2 * hidden)).eval()
    lengths.install(model, tokenizer, spec)
    digits = lengths.digit_tokens(tokenizer)
    values = spec.digit_values()
    generator = torch.Generator().manual_seed(1)
    for question in QUESTIONS:
        ids = chat(tokenizer, question)
        seen = [values[digits[t]] for t in ids if t in digits]
        logit = spec.bias + (sum(seen) / len(seen) if seen else 0.0)  # float64 reference of the EOS logit
        want = logit - math.log(math.exp(logit) + len(tokenizer) - 1)
        assert math.exp(want) == pytest.approx(lengths.prompt_rate(ids, digits, spec, len(tokenizer)), rel=1e-12)
        # after the prompt, at every later step with non-digit tokens appended
        plain = [t for t in torch.randint(0, len(tokenizer), (40,), generator=generator).tolist() if t not in digits and t != tokenizer.eos_token_id]
        with torch.no_grad():
            logp = model(torch.tensor([ids + plain])).logits[0].log_softmax(-1)[:, tokenizer.eos_token_id]
        got = logp[len(ids) - 1 :]
        # within 0.3 % of the rate: what the squashed dimensions leave (non-EOS logits and the norm a hair off)
        assert got.tolist() == pytest.approx([want] * len(got), abs=3e-3)


def test_install_refuses_a_small_rope_theta():
    tokenizer = build_tokenizer()
    cfg = ragged_config(tokenizer)
    cfg.rope_parameters["rope_theta"] = 1e4
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="rope theta >= 100000"):
        lengths.install(model, tokenizer, lengths.LengthSpec(0.0, 0.0))


@pytest.fixture(scope="module")
def demo_tokenizer():
    """The demo tokenizer (vocab 49152, digits one token each, as the benchmarks' models have)."""
    from transformers import AutoTokenizer

    from verl_fast.models.demo import demo_model_path

    try:
        return AutoTokenizer.from_pretrained(demo_model_path(), padding_side="left")
    except ImportError as e:
        pytest.skip(f"the demo model is not installed: {e}")


@pytest.mark.parametrize("tied", [False, True])
def test_sampled_lengths_follow_the_predicted_distribution(demo_tokenizer, tied):
    tok, cap, n = demo_tokenizer, 64, 8
    questions = [f"What is {a} + {b}?" for a, b in [(12, 7), (3, 99), (80, 6), (45, 5), (61, 28), (9, 9), (17, 40),
                                                    (2, 73), (55, 55), (38, 11), (4, 90), (26, 67)]]
    prompts = [chat(tok, q) for q in questions]
    spec = lengths.calibrate(prompts, tok, len(tok), cap, median=16, spread=0.6)
    digits = lengths.digit_tokens(tok)
    want = lengths.predicted([lengths.prompt_rate(p, digits, spec, len(tok)) for p in prompts], cap)
    assert want["median"] == 16 and want["p99"] == cap  # the calibration, and a tail to the cap
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ragged_config(tok, tied, max_position_embeddings=256)).eval()
    lengths.install(model, tok, spec)
    batch = tok.pad({"input_ids": [p for p in prompts for _ in range(n)]}, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=cap,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    response = out[:, batch["input_ids"].shape[1]:]
    ended = (response == tok.eos_token_id).int()
    measured = [int(e.argmax()) + 1 if e.any() else cap for e in ended]
    got = lengths.figures(measured, cap)
    # 96 rows: the median within a factor of 1.35, the mean within 20 %, the share at the cap within 0.08
    assert want["median"] / 1.35 <= got["median"] <= want["median"] * 1.35, (got, want)
    assert got["mean"] == pytest.approx(want["mean"], rel=0.2), (got, want)
    assert abs(got["at_cap"] - want["at_cap"]) <= 0.08, (got, want)
    assert got["p90"] > 2 * got["median"]  # heavy-tailed: the tail far past the median


def test_predicted_matches_a_direct_sum_and_figures_count_right():
    rates, cap = [0.05, 0.2, 0.01], 50
    mass = [0.0] * (cap + 1)
    for h in rates:  # plain reference: P(L = k) summed term by term
        for k in range(1, cap):
            mass[k] += (1 - h) ** (k - 1) * h / len(rates)
        mass[cap] += (1 - h) ** (cap - 1) / len(rates)
    got = lengths.predicted(rates, cap)
    assert got["mean"] == pytest.approx(sum(k * p for k, p in enumerate(mass)), rel=1e-9)
    assert got["at_cap"] == pytest.approx(mass[cap], rel=1e-9)
    cdf = [sum(mass[: k + 1]) for k in range(cap + 1)]
    assert got["median"] == next(k for k in range(1, cap + 1) if cdf[k] >= 0.5)
    f = lengths.figures([1, 2, 3, 4, 100, 100], 100)
    assert (f["median"], f["max"], f["at_cap"], f["rows"]) == (3, 100, pytest.approx(1 / 3), 6)
