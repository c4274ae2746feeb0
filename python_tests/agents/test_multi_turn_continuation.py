"""The multi-turn rollout on the HF decode with each trajectory's KV cache continued across turns
(``rollout.multi_turn.kv_continuation``): the same trajectories -- tokens, masks, log-probs, turn ends,
finish reasons -- as re-prefilling the whole conversation every turn and as HF ``generate`` on it, for
greedy rows ending at different turns and at the token budget, and the same draws for sampled rows."""

import pytest
import torch

from tiny_models import build_model, build_tokenizer
from verl_fast.agents import rollout as rollout_mod
from verl_fast.agents.environments import Environment, StepResult, row_messages
from verl_fast.agents.rollout import MultiTurnRolloutOperator
from verl_fast.agents.settings import MultiTurnConfig
from verl_fast.data import PromptRow
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.hf_engine import HFGenerateEngine


class Ragged(Environment):
    """Row ``turns`` turns long, observations of a row- and turn-dependent length, a reward per turn."""

    def reset(self, row):
        self.turn, self.turns, self.words = 0, row.columns["turns"], row.columns["words"]
        return row_messages(row)

    def step(self, message):
        self.turn += 1
        if self.turn >= self.turns:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": " plus" * (self.words + self.turn)}], reward=0.25)


PROMPTS = ["What is 1 + 2?", "the answer is", "compute the sum of 41 and 7 please", "x"]


@pytest.fixture(autouse=True)
def settled(monkeypatch):
    """Every trajectory's observation joins the next call (instant steps: no straggler waves), and float32
    matmuls in full."""
    monkeypatch.setattr(rollout_mod, "GRACE_S", 60.0)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tok):
    torch.manual_seed(1)
    m = build_model(request.param, vocab_size=len(tok), num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    m.generation_config.eos_token_id = tok.eos_token_id
    return m


def rows():
    # ragged prompts; rows end after 4, 2, 3 and 4 turns; the last one's observations grow past the budget
    spec = [(4, 1), (2, 2), (3, 3), (4, 30)]
    return [PromptRow(prompt_ids=[], prompt_text="", columns={"prompt": p, "turns": t, "words": w})
            for p, (t, w) in zip(PROMPTS, spec)]


def rollout(engine, tok, spec, continued, seed=None):
    mt = MultiTurnConfig(environment=f"{__file__}:Ragged", max_turns=4, max_tokens_per_turn=5,
                         kv_continuation=continued)
    op = MultiTurnRolloutOperator(engine, spec, tok, mt, {})
    try:
        return op.rollout(rows(), seed=seed), op.metrics()
    finally:
        op.close()


def assert_same(a, b, atol=1e-5):
    for name in ("prompt_index", "response_ids", "response_mask", "attention_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.turn_ends == b.turn_ends and a.finish_reasons == b.finish_reasons and a.prompt_ids == b.prompt_ids
    assert torch.equal(a.token_rewards, b.token_rewards)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


def test_greedy_continuation_is_the_reprefilled_and_the_generated_conversation(model, tok):
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=100, logprobs=True)
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    cont, cm = rollout(fast, tok, spec, continued=True)
    again, am = rollout(fast, tok, spec, continued=False)
    generated, _ = rollout(HFGenerateEngine(model, tok, fast_decode="off"), tok, spec, continued=True)
    assert_same(cont, again)
    assert_same(cont, generated)
    # rows end at their environment's turn, the last one when its second observation outgrows the budget: cut,
    # and the trajectory ends as truncated
    assert [len(t) for t in cont.turn_ends] == [4, 2, 3, 2]
    assert cont.finish_reasons[3] == "length" and int(cont.attention_mask[3].sum()) == 100
    # masks: the model's tokens only, observations are holes with log-prob 0
    for r in range(4):
        k = int(cont.attention_mask[r].sum())
        held = cont.response_mask[r, :k] == 0
        assert held.any() == (len(cont.turn_ends[r]) > 1)
        assert torch.all(cont.logprobs[r, :k][held] == 0)
    # continuation prefills the prompts once, then only the new tokens; re-prefilling feeds every conversation
    assert cm["multi_turn/generate_calls"] == am["multi_turn/generate_calls"] == 4
    assert cm["multi_turn/prefill_tokens"] + cm["multi_turn/prefill_tokens_saved"] == am["multi_turn/prefill_tokens"]
    assert cm["multi_turn/prefill_tokens_saved"] > cm["multi_turn/prefill_tokens"] / 2


def test_sampled_continuation_draws_what_reprefilling_draws(model, tok):
    """The same seeds give the same noise, row by row and step by step: a sampled row's tokens are the
    re-prefilled conversation's draws (their distribution is the conversation's)."""
    spec = SamplingSpec(n=2, temperature=1.0, top_p=0.95, max_tokens=400, logprobs=True)
    fast = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    cont, _ = rollout(fast, tok, spec, continued=True, seed=7)
    again, _ = rollout(fast, tok, spec, continued=False, seed=7)
    assert_same(cont, again)
    assert not torch.equal(cont.response_ids[0], cont.response_ids[1])  # the samples of a prompt differ


def test_a_trajectorys_text_is_its_final_turn_decoded_once(model, tok, monkeypatch):
    """Only the final model turn's text is read (the output's ``texts``): each trajectory's is decoded once, at the
    end, rather than every turn's as it comes; it is that turn's tokens decoded, special tokens skipped."""
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=100, logprobs=True)
    decode, skipped = tok.decode, []

    def counted(*args, **kwargs):
        if kwargs.get("skip_special_tokens"):
            skipped.append(list(args[0] if args else kwargs["token_ids"]))
        return decode(*args, **kwargs)

    monkeypatch.setattr(tok, "decode", counted)
    out, _ = rollout(HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off"), tok, spec, continued=True)
    assert sum(len(t) for t in out.turn_ends) > len(out.turn_ends)  # more turns than trajectories
    assert len(skipped) == len(out.turn_ends)
    for r, ends in enumerate(out.turn_ends):
        model_tokens = out.response_mask[r].tolist()
        start = ends[-1]
        while start > 0 and model_tokens[start - 1] == 1:  # the final turn: the last run of the model's tokens
            start -= 1
        final = out.response_ids[r, start : ends[-1] + 1].tolist()
        assert final in skipped and out.texts[r] == decode(final, skip_special_tokens=True)


def test_a_calls_turns_reach_their_environments_decoded_in_one_call(model, tok, monkeypatch):
    """The turns of one generate call become their assistant messages' texts in one call of the tokenizer (each
    as its own ``decode`` gives it: the trajectories are those of a turn decoded at a time)."""
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=100, logprobs=True)
    batch_decode, batches = tok.batch_decode, []

    def counted(rows, **kwargs):
        batches.append(len(rows))
        return batch_decode(rows, **kwargs)

    monkeypatch.setattr(tok, "batch_decode", counted)
    out, metrics = rollout(HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off"), tok, spec,
                           continued=True)
    assert len(batches) == metrics["multi_turn/generate_calls"] == 4
    assert sum(batches) == sum(len(t) for t in out.turn_ends)  # every turn went to its environment's step
