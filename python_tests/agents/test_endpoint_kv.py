"""The endpoint's batcher continuing a trajectory's KV cache across its calls (the HF decode's static-cache
loop, rollout/kv_turns.py): agents' follow-up calls prefill only their new tokens, with the token ids
(greedy) and log-probs of prefilling every call whole; the tokens saved counted exactly; a call whose
history was edited, and a call of n samples, prefilled whole."""

import json
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.agents.agent_rollout import AgentRolloutOperator
from verl_fast.agents.server_settings import ServerConfig
from verl_fast.data import PromptRow
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.hf_engine import HFGenerateEngine

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def rows(tok, n):
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"What is {i} + {i * 3 + 1}?" + " Think." * i}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) else list(ids)
        out.append(PromptRow(prompt_ids=list(ids), prompt_text="", ground_truth=str(i), columns={"prompt": messages}))
    return out


def make_agent(log, edit_at=None, turns=3, n_at=None):
    """A urllib agent of ``turns`` greedy calls, a tool result after each; at call ``edit_at`` it rewrites the
    first user message (an edited history); at call ``n_at`` it asks for 2 samples. ``log[trajectory id]``: per
    call (prompt tokens, the first choice's token ids, continued)."""
    def agent(row, base_url):
        messages, calls = list(row["messages"]), []
        for turn in range(turns):
            if turn == edit_at:
                messages[0] = {"role": "user", "content": messages[0]["content"] + " (edited)"}
            reply = post(f"{base_url}/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 5,
                                                          "temperature": 0.0, "n": 2 if turn == n_at else 1})
            choice = reply["choices"][0]
            calls.append((reply["usage"]["prompt_tokens"], choice["token_ids"], reply["continued"]))
            messages += [{"role": "assistant", "content": choice["message"]["content"]},
                         {"role": "tool", "content": str(7 * turn + len(row["messages"][0]["content"]))}]
        log[base_url.split("/t/")[1].split("/")[0]] = calls
    return agent


def run(tiny, agent, continuation, n_rows=6, n=1):
    model, tok = tiny
    engine = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    default = SamplingSpec(n=n, temperature=1.0, max_tokens=120, seed=5)
    op = AgentRolloutOperator(engine, default, tok, agent,
                              ServerConfig(kv_continuation=continuation, batch_window_s=0.05, concurrency=16))
    try:
        out = op.rollout(rows(tok, n_rows))
    finally:
        op.close()
    return out, op.metrics()


def saved_of(calls, n_at=None, edit_at=None):
    """The tokens a trajectory's calls found cached: a one-sample call leaves its prompt and sampled
    tokens but the last; a later one-sample call whose prompt extends them (calls continued since) uses
    them. A call of n samples goes to the engine's generate: it neither uses nor leaves a cache."""
    total, cached = 0, None
    for turn, (prompt, ids, continued) in enumerate(calls):
        assert continued == (0 < turn != edit_at)
        if not continued:
            cached = None
        if turn == n_at:
            continue
        total += cached or 0
        cached = prompt + len(ids) - 1
    return total


def same_outputs(a, b):
    assert a.num_sequences == b.num_sequences
    for r in range(a.num_sequences):
        n = int(a.attention_mask[r].sum())
        assert n == int(b.attention_mask[r].sum())
        assert a.response_ids[r, :n].tolist() == b.response_ids[r, :n].tolist()
        assert a.response_mask[r, :n].tolist() == b.response_mask[r, :n].tolist()
        assert torch.allclose(a.logprobs[r, :n], b.logprobs[r, :n], atol=1e-5)


@pytest.mark.parametrize("edit_at,n_at", [(None, None), (2, None), (None, 1)],
                         ids=["continued", "edited-history", "n-samples"])
def test_follow_up_calls_prefill_only_new_tokens_with_the_reprefill_results(tiny, edit_at, n_at):
    log_on, log_off = {}, {}
    on, m_on = run(tiny, make_agent(log_on, edit_at, n_at=n_at), True)
    off, m_off = run(tiny, make_agent(log_off, edit_at, n_at=n_at), False)
    same_outputs(on, off)
    assert m_on["agent/failed"] == 0 and m_on["agent/calls"] == m_off["agent/calls"]
    saved = sum(saved_of(calls, n_at, edit_at) for calls in log_on.values())
    assert saved > 0
    assert m_on["agent/prefill_tokens_saved"] == saved
    assert m_off["agent/prefill_tokens_saved"] == 0
    # distinct prompts (one sample per row): re-prefilling feeds every call's prompt; continuing, all but
    # what it found cached
    assert m_off["agent/prefill_tokens"] == sum(p for calls in log_off.values() for p, _, _ in calls)
    assert m_on["agent/prefill_tokens"] + saved == m_off["agent/prefill_tokens"]
    # the same calls, the same tokens seen by the agents
    assert sorted(map(str, log_on.values())) == sorted(map(str, log_off.values()))
