"""What an engine returns, built on the host (records/generation.py): ``pad_completions`` against a row-by-row
reference, ``texts_of`` against the tokenizer's own ``decode``, and ``SamplingSpec.detokenize`` (no texts
decoded where a caller reads the tokens only: a partial rollout's rounds) through the HF engine."""

import random

import pytest
import torch

from tiny_models import build_model, build_tokenizer
from verl_fast.records.generation import SamplingSpec, pad_completions, texts_of
from verl_fast.rollout.hf_engine import HFGenerateEngine


@pytest.mark.parametrize("seed", range(6))
def test_pad_completions_matches_the_row_by_row_reference(seed):
    rng = random.Random(seed)
    rows = [[rng.randrange(100) for _ in range(rng.choice([0, 1, rng.randint(2, 40)]))]
            for _ in range(rng.randint(0, 12))]
    logprobs = [[-rng.random() for _ in r] for r in rows]
    if rows and seed % 2:
        rows[0] = torch.tensor(rows[0], dtype=torch.int64)  # a row as a tensor reads as its values
    out = pad_completions(rows, logprobs, list(range(len(rows))), 7, [""] * len(rows), ["stop"] * len(rows))
    width = max([len(r) for r in rows] + [1])
    assert tuple(out.response_ids.shape) == (len(rows), width)
    for i, r in enumerate(rows):
        r = list(r.tolist() if isinstance(r, torch.Tensor) else r)
        assert out.response_ids[i].tolist() == r + [7] * (width - len(r))
        assert out.response_mask[i].tolist() == [1] * len(r) + [0] * (width - len(r))
        assert out.logprobs[i].tolist() == pytest.approx(logprobs[i] + [0.0] * (width - len(r)), abs=1e-7)
    assert pad_completions(rows, None, list(range(len(rows))), 7).logprobs is None
    if rows and any(len(r) for r in rows):
        short = [x[:-1] if len(x) else x for x in logprobs]
        with pytest.raises(ValueError, match="one log-prob per token"):
            pad_completions(rows, short, list(range(len(rows))), 7)


def test_texts_of_is_the_tokenizers_decode():
    tok = build_tokenizer()
    rng = random.Random(0)
    special = tok.convert_tokens_to_ids(tok.eos_token)
    rows = [[rng.randrange(len(tok)) for _ in range(rng.randint(0, 60))] + ([special] if i % 2 else [])
            for i in range(30)]
    assert texts_of(tok, rows) == [tok.decode(r, skip_special_tokens=True) for r in rows]
    assert texts_of(tok, rows, skip_special_tokens=False) == [tok.decode(r) for r in rows]

    class Plain:  # a tokenizer with decode only (vLLM's protocol)
        def decode(self, ids, skip_special_tokens=False):
            return ",".join(map(str, ids)) + ("" if skip_special_tokens else "!")

    assert texts_of(Plain(), [[1, 2], []]) == ["1,2", ""]


def test_an_engine_leaves_the_texts_out_where_the_spec_asks_for_none():
    tok = build_tokenizer()
    model = build_model("qwen2", vocab_size=len(tok), num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    engine = HFGenerateEngine(model, tok, fast_decode="on")
    prompts = [tok("What is 1 + 2?")["input_ids"], tok("the answer is")["input_ids"]]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=6, seed=0)
    full = engine.generate(prompts, [spec, spec])
    mixed = engine.generate(prompts, [spec, SamplingSpec(n=2, temperature=1.0, max_tokens=6, seed=0, detokenize=False)])
    assert torch.equal(mixed.response_ids, full.response_ids)  # one call either way: the same samples
    assert mixed.texts[:2] == full.texts[:2] and mixed.texts[2:] == ["", ""] and all(full.texts)
    responses = [full.response_ids[i, : int(full.response_mask[i].sum())].tolist() for i in range(4)]
    assert full.texts == [tok.decode(r, skip_special_tokens=True) for r in responses]
