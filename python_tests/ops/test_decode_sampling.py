"""The decode step's fused sampling kernel (kernels/decode_sampling.py, Triton; on CPU tensors under
TRITON_INTERPRET) against float64 references written here and against the torch form it replaces
(``hf_decode.record``): greedy tokens (ties to the first index) and log-probs over several row widths
(across the kernel's block), the sampled distribution, finished rows, stop tokens, the bookkeeping,
fresh draws per step, bad input."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1", allow_module_level=True)

from verl_fast.kernels.decode_sampling import BLOCK, sample_step, supports  # noqa: E402
from verl_fast.rollout import hf_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def state(b, t_cols=6, done=None, pad=0, stop=(-1,), t=2, seed=11):
    """The step's buffers: seed, t, done, pad, stop, tokens, logprobs, current, position."""
    done = torch.zeros(b, dtype=torch.bool) if done is None else torch.tensor(done)
    cpu = (torch.tensor([seed]), torch.tensor([t]), done, torch.tensor(pad), torch.tensor(list(stop)),
           torch.full((b, t_cols), -7, dtype=torch.long), torch.full((b, t_cols), 9.0),
           torch.zeros(b, 1, dtype=torch.long), torch.arange(b)[:, None] * 10)
    return [x.to(DEVICE) for x in cpu]


def run(logits, temperature, **kw):
    s = state(logits.shape[0], **kw)
    sample_step(logits.to(DEVICE), temperature, *s)
    return [x.cpu() for x in s]


@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, BLOCK - 1), (4, BLOCK + 1), (2, 3 * BLOCK + 17)])
def test_greedy_matches_the_float64_reference(rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    _, _, done, _, _, tokens, logprobs, current, position = run(logits, 0.0)
    want = logits.double().argmax(-1)
    assert torch.equal(tokens[:, 2], want) and torch.equal(current[:, 0], want)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, want[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs[:, 2].double(), ref, atol=1e-5, rtol=0)
    assert (tokens[:, [0, 1, 3, 4, 5]] == -7).all() and (logprobs[:, [0, 1, 3, 4, 5]] == 9.0).all()  # column t only
    assert torch.equal(position[:, 0], torch.arange(rows) * 10 + 1) and not done.any()


def test_greedy_ties_go_to_the_first_index_as_argmax():
    logits = torch.zeros(3, BLOCK + 40)
    logits[0, [7, BLOCK + 3]] = 5.0  # the first maximum in the first block, another in the second
    logits[1, [BLOCK + 3, BLOCK + 20]] = 5.0
    logits[2, [BLOCK - 1, 5]] = 2.0  # two lanes' positions in one block
    tokens = run(logits, 0.0)[5]
    assert tokens[:, 2].tolist() == [7, BLOCK + 3, 5] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.6])
def test_sampled_distribution_and_log_probs_match_the_float64_reference(temperature):
    torch.manual_seed(0)
    row = torch.randn(12) * 2
    row[3] = -float("inf")  # a token the model can never produce
    draws = 2000  # one row each (the interpreter runs a program at a time)
    _, _, _, _, _, tokens, logprobs, _, _ = run(row.expand(draws, -1).contiguous(), temperature)
    token = tokens[:, 2]
    want = torch.softmax(row.double() / temperature, 0)
    counts = torch.bincount(token, minlength=12).double()
    assert counts[3] == 0
    expected = draws * want
    cells = expected >= 5
    chi2 = float(((counts - expected)[cells] ** 2 / expected[cells]).sum())
    dof = int(cells.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))  # chi-square survival
    assert p_value > 1e-3, (counts, expected)
    full = torch.log_softmax(row.double() / temperature, 0)
    torch.testing.assert_close(logprobs[:, 2].double(), full[token], atol=1e-5, rtol=0)


def test_each_step_and_each_key_draws_afresh_and_a_key_repeats():
    logits = torch.zeros(64, 50)  # uniform: every draw independent
    first = run(logits, 1.0, t=2)[5][:, 2]
    again = run(logits, 1.0, t=2)[5][:, 2]
    next_step = run(logits, 1.0, t=3)[5][:, 3]
    other_key = run(logits, 1.0, t=2, seed=12)[5][:, 2]
    assert torch.equal(first, again)
    assert (first != next_step).float().mean() > 0.8 and (first != other_key).float().mean() > 0.8
    assert len(set(first.tolist())) > 25  # rows of one step draw apart (50 tokens, 64 rows)


def test_finished_rows_get_pad_and_stop_tokens_finish_rows():
    logits = torch.full((4, 30), -5.0)
    logits[:, 4] = 5.0  # greedy: token 4 everywhere
    logits[3, 4], logits[3, 6] = -5.0, 5.0  # row 3: token 6
    _, _, done, _, _, tokens, logprobs, current, position = run(logits, 0.0, done=[False, True, False, False],
                                                                 pad=9, stop=(4, 11))
    assert tokens[:, 2].tolist() == [4, 9, 4, 6] and current[:, 0].tolist() == [4, 9, 4, 6]
    assert logprobs[1, 2] == 0 and (logprobs[[0, 2, 3], 2] < 0).all()
    assert done.tolist() == [True, True, True, False]
    assert position[:, 0].tolist() == [1, 11, 21, 31]  # every row advances, finished or not (as record does)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_matches_the_torch_record(temperature):
    """Greedy: the same tokens and bookkeeping as ``hf_decode.record``; sampled: the same log-prob of
    whatever token was drawn (the draws come from another generator)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 700, generator=g) * 2
    done = [False, False, True, False, False, False]
    stop = (int(logits[0].argmax()), 3)
    ours = run(logits, temperature, done=done, pad=1, stop=stop)
    seed, t, d, pad, stops, tokens, logprobs, current, position = state(6, done=done, pad=1, stop=stop)
    col = torch.tensor([40], device=DEVICE)
    hf_decode.record(logits.to(DEVICE), (temperature, 0, 1.0), d, pad, stops, tokens, logprobs, current, position,
                     col, t)
    theirs = [x.cpu() for x in (d, tokens, logprobs, current, position)]
    if temperature == 0:
        for a, b in zip((ours[2], ours[5], ours[7], ours[8]), (theirs[0], theirs[1], theirs[3], theirs[4])):
            assert torch.equal(a, b)
        torch.testing.assert_close(ours[6], theirs[2], atol=1e-5, rtol=0)
    else:
        full = torch.log_softmax(logits.double() / temperature, -1).gather(-1, ours[5][:, 2:3]).squeeze(-1)
        want = full.masked_fill(torch.tensor(done), 0.0)
        torch.testing.assert_close(ours[6][:, 2].double(), want, atol=1e-5, rtol=0)


def test_supports_temperature_only():
    assert supports(-1, 1.0) and supports(0, 1.0)
    assert not supports(5, 1.0) and not supports(0, 0.9)


@pytest.mark.parametrize("bad,match", [
    ("logits_dtype", "logits must be"), ("logits_strided", "logits must be"), ("done_dtype", "done must be"),
    ("seed_shape", "seed must be"), ("tokens_rows", "tokens must be"), ("temperature", "temperature must be"),
])
def test_bad_input_names_the_argument(bad, match):
    logits = torch.randn(3, 10, device=DEVICE)
    s = state(3)
    temperature = 1.0
    if bad == "logits_dtype":
        logits = logits.double()
    elif bad == "logits_strided":
        logits = torch.randn(10, 3, device=DEVICE).t()
    elif bad == "done_dtype":
        s[2] = s[2].long()
    elif bad == "seed_shape":
        s[0] = torch.tensor([1, 2], device=DEVICE)
    elif bad == "tokens_rows":
        s[5] = s[5][:2]
    else:
        temperature = -1.0
    with pytest.raises(ValueError, match=match):
        sample_step(logits, temperature, *s)
