"""Agent programs through the OpenAI-compatible endpoint on the HF engine (a tiny model): every call
recorded exactly as the engine sampled it (ids, and log-probs against the model's own log-softmax),
the calls of a run as one trajectory with the tool messages as holes, concurrent agents batched into
few generate calls, the refusals (no call, a crash, a hang, the token budget), the `openai` client,
and a training step through RLTrainer(agent=...)."""

import json
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as config_mod
from verl_fast.agents.agent_rollout import AgentRolloutOperator
from verl_fast.agents.chat import ChatRenderer
from verl_fast.agents.server_settings import ServerConfig
from verl_fast.data import PromptRow
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.trainer.rl_trainer import RLTrainer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def operator(tiny, agent, max_tokens=40, **settings):
    _, model, tok = tiny
    engine = HFGenerateEngine(model, tok)
    default = SamplingSpec(n=1, temperature=1.0, max_tokens=max_tokens, seed=3)
    return AgentRolloutOperator(engine, default, tok, agent, ServerConfig(**settings))


def rows(tok, n):
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"What is {i} + {i + 1}?"}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) else list(ids)
        out.append(PromptRow(prompt_ids=list(ids), prompt_text="", ground_truth=str(2 * i + 1),
                             columns={"prompt": messages}))
    return out


def teacher_forced(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


SEEN = {}


def two_turn_agent(row, base_url):
    """A plain urllib agent: asks, sends a tool result back, asks again; keeps what it was sent."""
    messages = list(row["messages"])
    first = post(f"{base_url}/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 6,
                                                  "logprobs": True})[1]
    reply = first["choices"][0]["message"]
    messages += [{"role": "assistant", "content": reply["content"]}, {"role": "tool", "content": "42"}]
    status, second = post(f"{base_url}/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 5})
    assert status == 200, second
    SEEN[row["ground_truth"]] = (first, second)
    return {"reward": 0.5}


def test_an_agents_calls_become_one_trajectory_with_the_engines_exact_tokens(tiny):
    _, model, tok = tiny
    op = operator(tiny, two_turn_agent)
    try:
        batch = rows(tok, 3)
        out = op.rollout(batch)
    finally:
        op.close()
    metrics = op.metrics()
    assert metrics["agent/calls"] == 6 and metrics["agent/failed"] == 0 and metrics["agent/calls_dropped"] == 0
    renderer = ChatRenderer(tok, TOOLS)
    for r in range(out.num_sequences):
        row = batch[int(out.prompt_index[r])]
        first, second = SEEN[row.ground_truth]
        assert first["continued"] is False and second["continued"] is True
        a, b = first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]
        stop = a[-1] if first["choices"][0]["finish_reason"] == "stop" else None
        obs = renderer.observation_ids([{"role": "tool", "content": "42"}], stop)
        n = int(out.attention_mask[r].sum())
        response = out.response_ids[r, :n].tolist()
        assert response == a + obs + b  # never re-tokenised
        assert out.response_mask[r, :n].tolist() == [1] * len(a) + [0] * len(obs) + [1] * len(b)
        assert out.prompt_ids[r] == renderer.prompt_ids(row.columns["prompt"])
        assert out.turn_ends[r] == [len(a) - 1, n - 1]
        # the log-probs recorded are the model's own at the sampled tokens (temperature 1)
        ref = teacher_forced(model, out.prompt_ids[r] + response)[len(out.prompt_ids[r]) - 1:]
        mask = out.response_mask[r, :n].bool()
        assert torch.allclose(out.logprobs[r, :n][mask].double(), ref[mask], atol=1e-4)
        lp = [x["logprob"] for x in first["choices"][0]["logprobs"]["content"]]
        assert lp == pytest.approx(out.logprobs[r, :len(a)].tolist(), abs=1e-6)
        assert [x["token"] for x in first["choices"][0]["logprobs"]["content"]] == [tok.decode([t]) for t in a]
        assert out.token_rewards[r, n - 1] == 0.5 and out.token_rewards[r].sum() == 0.5
        assert out.texts[r] == second["choices"][0]["message"]["content"]


def mixed_agent(row, base_url):
    """Two calls of the row's kind: chat with tools / without / tool_choice none / n=2 first / an edited
    history second, a text completion continued by the next, a token-id completion."""
    kind, log, messages = row["kind"], [], list(row["messages"])
    for turn in range(2):
        if kind in ("text", "ids"):
            prompt = [3, 4, 5 + turn] if kind == "ids" else (
                log[-1]["prompt"] + log[-1]["reply"]["choices"][0]["text"] + " d" if log else "a b c")
            reply = post(f"{base_url}/completions", {"prompt": prompt, "max_tokens": 3})[1]
            log.append({"prompt": prompt, "reply": reply})
            continue
        body = {"messages": list(messages), "max_tokens": 3, "n": 2 if kind == "n2" and turn == 0 else 1}
        if kind != "plain":
            body["tools"] = TOOLS
        if kind == "none":
            body["tool_choice"] = "none"
        status, reply = post(f"{base_url}/chat/completions", body)
        assert status == 200, reply
        log.append({"messages": body["messages"], "reply": reply})
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user" if kind == "plain" else "tool", "content": "42"}]
        if kind == "edited":
            messages[0] = {"role": "user", "content": messages[0]["content"] + " (edited)"}
    SEEN[kind] = (base_url.split("/t/")[1].split("/")[0], log)


def test_a_batch_of_mixed_calls_gets_each_calls_prompt_ids_made_alone(tiny):
    """Agents whose calls meet in one batch a turn (chat with and without tools, tool_choice none, n=2, an
    edited history, text and token-id completions): each call's prompt ids are those of rendering and
    tokenising it alone (a continued call: the previous prompt and samples kept, the new messages rendered
    after them), and each batch's texts are tokenised in one tokenizer call."""
    _, _, tok = tiny
    kinds = ["tools", "plain", "none", "n2", "edited", "text", "ids"]
    batch = rows(tok, len(kinds))
    for row, kind in zip(batch, kinds):
        row.columns["kind"] = kind
    op = operator(tiny, mixed_agent, batch_window_s=30.0, concurrency=len(kinds))
    recorders, batches, encoded = {}, [], []
    pop, run, encode = op.endpoint.pop, op.batcher._run, type(tok).__call__
    op.endpoint.pop = lambda tid: recorders.setdefault(tid, pop(tid))
    op.batcher._run = lambda requests: (batches.append(len(requests)), run(requests))

    def counted(self, *args, **kwargs):
        encoded.append(args[0])
        return encode(self, *args, **kwargs)

    type(tok).__call__ = counted
    try:
        op.rollout(batch)
    finally:
        type(tok).__call__ = encode
        op.close()
    assert batches == [len(kinds)] * 2 and len(encoded) == 2  # one tokenizer call a batch
    for kind in kinds:
        tid, log = SEEN[kind]
        calls = recorders[tid].calls
        first, second = calls[0], calls[-1]
        assert len(calls) == (3 if kind == "n2" else 2)
        if kind == "ids":
            assert [c.prompt_ids for c in calls] == [[3, 4, 5], [3, 4, 6]]
        elif kind == "text":
            before, prompt = first.prompt_text + tok.decode(first.ids, skip_special_tokens=False), log[1]["prompt"]
            want = (first.prompt_ids + first.ids + tok.encode(prompt[len(before):], add_special_tokens=False)
                    if prompt.startswith(before) else tok.encode(prompt, add_special_tokens=False))
            assert first.prompt_ids == tok.encode("a b c", add_special_tokens=False) and second.prompt_ids == want
        else:
            renderer = ChatRenderer(tok, [] if kind in ("plain", "none") else TOOLS)
            assert first.prompt_ids == renderer.prompt_ids(log[0]["messages"])
            assert log[1]["reply"]["continued"] is (kind != "edited")
            stop = first.ids[-1] if first.finish == "stop" else None
            continued = first.prompt_ids + first.ids + renderer.observation_ids(log[1]["messages"][-1:], stop)
            assert second.prompt_ids == (renderer.prompt_ids(log[1]["messages"]) if kind == "edited" else continued)


def test_concurrent_agents_are_batched_into_few_generate_calls(tiny):
    _, _, tok = tiny

    def one_call(row, base_url):
        time.sleep(0.05)
        post(f"{base_url}/chat/completions", {"messages": row["messages"], "max_tokens": 4})

    op = operator(tiny, one_call, batch_window_s=0.3, concurrency=16)
    try:
        out = op.rollout(rows(tok, 8))
    finally:
        op.close()
    assert out.num_sequences == 8 and op.metrics()["agent/calls"] == 8
    assert op.metrics()["agent/engine_calls"] <= 3


def test_refusals_score_the_sample_as_failed_and_the_rollout_goes_on(tiny, caplog):
    _, _, tok = tiny
    statuses = []

    def agent(row, base_url):
        kind = row["kind"]
        if kind == "silent":
            return None
        if kind == "crash":
            post(f"{base_url}/chat/completions", {"messages": row["messages"], "max_tokens": 2})
            raise RuntimeError("tool exploded")
        if kind == "greedy":  # calls until the budget (12 tokens sampled) is spent
            for _ in range(4):
                statuses.append(post(f"{base_url}/completions", {"prompt": "a b c", "max_tokens": 8})[0])
            tail = post(f"{base_url}/chat/completions", {"messages": row["messages"], "tool_choice": "required"})
            assert tail[0] == 400 and "tool_choice 'required' is not supported" in tail[1]["error"]["message"]
            return 1.0
        post(f"{base_url}/chat/completions", {"messages": row["messages"], "max_tokens": 3})
        return None

    batch = rows(tok, 4)
    for row, kind in zip(batch, ["silent", "crash", "greedy", "fine"]):
        row.columns["kind"] = kind
    op = operator(tiny, agent, max_tokens=12, timeout_s=300.0)
    try:
        with caplog.at_level("WARNING"):
            out = op.rollout(batch)
    finally:
        op.close()
    m = op.metrics()
    assert (m["agent/failed"], m["agent/no_calls"], m["agent/crashed"], m["agent/timeouts"]) == (2, 1, 1, 0)
    assert statuses[:2] == [200, 200] and statuses[-1] == 400 and m["agent/refused_calls"] >= 1
    by_kind = {batch[int(p)].columns["kind"]: r for r, p in enumerate(out.prompt_index.tolist())}
    for kind in ("silent", "crash"):
        assert out.response_mask[by_kind[kind]].sum() == 0  # nothing of a failed sample trains
    assert 0 < out.response_mask[by_kind["greedy"]].sum() <= 12
    assert out.response_mask[by_kind["fine"]].sum() > 0
    assert "RuntimeError: tool exploded; scored as failed" in caplog.text
    assert "it never called the endpoint; scored as failed" in caplog.text


def test_a_hung_agent_is_timed_out_and_its_later_calls_refused(tiny, caplog):
    _, _, tok = tiny
    late = []

    def agent(row, base_url):
        time.sleep(2.0)
        late.append(post(f"{base_url}/chat/completions", {"messages": row["messages"], "max_tokens": 2}))

    op = operator(tiny, agent, timeout_s=0.5)
    start = time.monotonic()
    try:
        with caplog.at_level("WARNING"):
            out = op.rollout(rows(tok, 1))
        assert time.monotonic() - start < 2.0
        m = op.metrics()
        assert m["agent/timeouts"] == 1 and m["agent/failed"] == 1 and out.response_mask.sum() == 0
        assert "timed out after rollout.server.timeout_s=0.5 s" in caplog.text
        deadline = time.monotonic() + 10
        while not late and time.monotonic() < deadline:
            time.sleep(0.05)
        assert late and late[0][0] == 404  # its trajectory is gone: the call is refused, not served
    finally:
        op.close()


def test_completions_with_token_ids_and_n_choices(tiny):
    _, model, tok = tiny
    got = {}

    def agent(row, base_url):
        got["models"] = json.loads(urllib.request.urlopen(f"{base_url}/models").read())
        got["many"] = post(f"{base_url}/chat/completions", {"messages": row["messages"], "n": 3, "max_tokens": 4})[1]
        got["ids"] = post(f"{base_url}/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 0})[1]

    op = operator(tiny, agent)
    try:
        out = op.rollout(rows(tok, 1))
    finally:
        op.close()
    assert got["models"]["data"][0]["id"] == "policy"
    assert len(got["many"]["choices"]) == 3
    choice = got["ids"]["choices"][0]
    ref = teacher_forced(model, [5, 6, 7] + choice["token_ids"])[2:]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref.tolist(), abs=1e-4)
    # the completion call does not continue the chat calls: the trajectory is its chain alone
    assert out.prompt_ids[0] == [5, 6, 7] and op.metrics()["agent/calls_dropped"] == 3


def openai_agent(row, base_url):
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(row["messages"])
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Go on."}]
    return None


def test_the_openai_client_drives_a_trajectory(tiny):
    pytest.importorskip("openai")
    _, _, tok = tiny
    op = operator(tiny, openai_agent)
    try:
        out = op.rollout(rows(tok, 2))
    finally:
        op.close()
    m = op.metrics()
    assert m["agent/calls"] == 4 and m["agent/failed"] == 0 and m["agent/calls_dropped"] == 0
    assert all(len(t) == 2 for t in out.turn_ends)  # two model turns each, the user turn a hole between
    assert (out.response_mask.sum(1) < out.attention_mask.sum(1)).all()


def test_a_training_step_through_the_trainer(tiny, tmp_path):
    path, _, tok = tiny
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 2, "max_new_tokens": 64,
                                              "server": {"concurrency": 4, "timeout_s": 60}},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tr = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, agent=two_turn_agent)
    history = tr.fit([{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "ground_truth": str(a + 1)}
                      for a in range(2)])
    assert history[-1]["agent/calls"] == 8 and history[-1]["agent/failed"] == 0, {k: v for k, v in history[-1].items() if "agent" in k or "response" in k}
    assert "actor/pg_loss" in history[-1]


def test_server_config_is_checked_in_one_line():
    with pytest.raises(ValueError, match=r"unknown key rollout.server.agnet"):
        config_mod.from_dict({"rollout": {"server": {"agnet": "x:y"}}})
    with pytest.raises(ValueError, match=r"rollout.server.agent: tool nowhere.py:run: no file nowhere.py"):
        config_mod.from_dict({"rollout": {"server": {"agent": "nowhere.py:run"}}})
    with pytest.raises(ValueError, match=r"rollout.server is not supported with rollout.multi_turn"):
        config_mod.from_dict({"rollout": {"server": {}, "multi_turn": {"environment": "reasoning_gym"}}})


def test_a_rollouts_worth_of_agents_connecting_at_once_are_all_served(tiny):
    """Every trajectory of a rollout may open its connection in the same instant: none is reset (the
    listen backlog holds them all)."""
    import threading

    from verl_fast.agents.endpoint import EngineBatcher, Endpoint

    _, model, tok = tiny
    endpoint = Endpoint(EngineBatcher(HFGenerateEngine(model, tok)), tok)
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=4)
    urls = [endpoint.open(f"t{i}", spec) for i in range(256)]
    start, answers = threading.Barrier(len(urls)), []

    def call(url):
        start.wait()
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=60) as response:
                answers.append(response.status)
        except OSError as e:
            answers.append(repr(e))

    threads = [threading.Thread(target=call, args=(url,)) for url in urls]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        endpoint.close()
    assert answers == [200] * len(urls), sorted(set(map(str, answers)))


def test_the_batch_goes_as_soon_as_every_running_agent_waits(tiny):
    """With a long window, turns of agents that call back at once still go one generate call a turn, without
    waiting the window out (every running agent's request is in the batch)."""
    _, _, tok = tiny

    def three_calls(row, base_url):
        messages = list(row["messages"])
        for _ in range(3):
            status, reply = post(f"{base_url}/chat/completions", {"messages": messages, "max_tokens": 4})
            assert status == 200, reply
            content = reply["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Again."}]

    op = operator(tiny, three_calls, max_tokens=400, batch_window_s=30.0, concurrency=8)
    try:
        start = time.monotonic()
        out = op.rollout(rows(tok, 8))
        seconds = time.monotonic() - start
    finally:
        op.close()
    assert out.num_sequences == 8 and op.metrics()["agent/calls"] == 24
    assert op.metrics()["agent/engine_calls"] == 3 and seconds < 30.0


def test_a_batch_goes_once_the_last_agent_not_waiting_ends(tiny):
    """An agent that ends without calling leaves the others waiting in the batch: it goes then, not at the
    end of the window."""
    _, _, tok = tiny

    def agent(row, base_url):
        if row["ground_truth"] == "1":
            time.sleep(0.5)
            return None
        post(f"{base_url}/chat/completions", {"messages": row["messages"], "max_tokens": 2})
        return None

    op = operator(tiny, agent, batch_window_s=30.0, concurrency=4)
    try:
        start = time.monotonic()
        op.rollout(rows(tok, 4))
        seconds = time.monotonic() - start
    finally:
        op.close()
    assert op.metrics()["agent/engine_calls"] == 1 and op.metrics()["agent/calls"] == 3 and seconds < 15.0


def test_later_connections_are_served_by_the_threads_of_closed_ones(tiny):
    """A client opening a connection per call (urllib) is served by the endpoint's threads whose connections
    closed, not by a thread started per connection; closing the endpoint ends them."""
    import threading

    from verl_fast.agents.endpoint import EngineBatcher, Endpoint

    _, model, tok = tiny
    endpoint = Endpoint(EngineBatcher(HFGenerateEngine(model, tok)), tok)
    url = endpoint.open("t", SamplingSpec(n=1, temperature=1.0, max_tokens=4))
    served, route = [], endpoint._route
    endpoint._route = lambda path, body: (served.append(threading.current_thread()), route(path, body))[1]
    start = threading.Barrier(8)

    def call():
        start.wait()
        with urllib.request.urlopen(f"{url}/models", timeout=60) as response:
            assert response.status == 200

    try:
        for _ in range(3):
            clients = [threading.Thread(target=call) for _ in range(8)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            deadline = time.monotonic() + 10  # every handler back waiting for a connection

            def busy():
                return sum(t.is_alive() for t in set(served)) - getattr(endpoint.server, "_idle", 0)

            while busy() > 0 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        endpoint.close()
    threads = list({id(t): t for t in served}.values())
    assert len(served) == 24 and len(threads) <= 8  # at most one thread per connection open at once
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
