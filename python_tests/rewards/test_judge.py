"""The judge reward: its parsers, the HF judge's batched greedy verdicts against one-at-a-time `generate`
on a tiny local model, the URL judge against an OpenAI-compatible stub server on 127.0.0.1, its metrics
(parse failures, judge time) and its config keys."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as config_mod
from verl_fast.rewards import RewardInput, build_reward
from verl_fast.rewards.judge import HFJudge, JudgeConfig, JudgeReward, parse, score_parser, verdict_parser


def test_score_parser_reads_the_last_score_and_refuses_what_is_off_the_scale():
    read = score_parser(10.0)
    assert read("Score: 7") == pytest.approx(0.7)
    assert read("score=3, no wait. **Score:** 8.5") == pytest.approx(0.85)
    assert read("  10 ") == 1.0
    assert read("Score: 11") is None and read("Score: -1") is None
    assert read("I cannot judge this") is None


def test_verdict_parser_takes_the_last_whole_word():
    read = verdict_parser({"correct": 1.0, "incorrect": 0.0, "partial": 0.5})
    assert read("The answer is Incorrect.") == 0.0
    assert read("incorrect at first, but CORRECT") == 1.0
    assert read("partially right") is None  # whole words only
    assert read("Verdict: partial") == 0.5


def tiny_judge(tmp_path, batch_size):
    path = save_tiny_model(tmp_path / "judge", family="qwen2", num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return HFJudge(model, AutoTokenizer.from_pretrained(path), max_new_tokens=6, batch_size=batch_size), model


def test_hf_judge_batches_equal_one_at_a_time_greedy_generate(tmp_path):
    judge, model = tiny_judge(tmp_path, batch_size=3)
    prompts = ["short", "a somewhat longer prompt to grade here", "mid length one", "x", "y z"]
    tok = judge.tokenizer
    side = tok.padding_side
    texts = judge.complete(prompts)
    assert tok.padding_side == side  # the judge pads on the left for its calls only
    for prompt, text in zip(prompts, texts):
        chat = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = tok(chat, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        assert text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_judge_reward_fills_the_template_and_counts_parse_failures(tmp_path):
    class Scripted:
        def __init__(self):
            self.seen = []

        def complete(self, prompts):
            self.seen = list(prompts)
            return ["Score: 9" if "right" in p else "no idea" for p in prompts]

    backend = Scripted()
    settings = JudgeConfig(model_name="unused", prompt_template="Q={prompt} A={response} T={ground_truth} L={level}",
                           failure_score=-1.0)
    reward = JudgeReward(backend, settings)
    samples = [RewardInput(prompt="<chat>q1", response="right", ground_truth=4, columns={"level": 2,
                           "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]}),
               RewardInput(prompt="q2", response="wrong", columns={"level": 5})]
    assert reward(samples) == [pytest.approx(0.9), -1.0]
    assert backend.seen == ["Q=q1 A=right T=4 L=2", "Q=q2 A=wrong T= L=5"]
    assert reward.last_extras["parse_failures"] == [0.0, 1.0]
    assert len(reward.last_extras["seconds"]) == 2
    with pytest.raises(ValueError, match=r"prompt_template names \{level\}, which sample 0 lacks"):
        reward([RewardInput(prompt="q", response="r")])


class _Stub(BaseHTTPRequestHandler):
    requests = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.requests.append((self.path, self.headers.get("Authorization"), body))
        text = body["messages"][0]["content"]
        verdict = "Verdict: yes" if text.endswith(" right") else ("maybe" if text.endswith(" odd") else "Verdict: no")
        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": verdict}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_server():
    _Stub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_url_judge_through_the_config(stub_server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "k-123")
    cfg = config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {
        "url": stub_server, "model": "grader", "api_key_env": "JUDGE_KEY", "parser": "verdict",
        "prompt_template": "Is this right? {response}", "max_new_tokens": 5, "batch_size": 3}}})
    reward = build_reward(cfg.reward_fn)
    samples = [RewardInput(prompt="p", response=r) for r in ["right", "wrong", "odd", "right", "wrong"]]
    assert reward(samples) == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert len(_Stub.requests) == 5
    path, auth, body = _Stub.requests[0]
    assert path == "/v1/chat/completions" and auth == "Bearer k-123"
    assert body["model"] == "grader" and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert sorted(b["messages"][0]["content"] for _, _, b in _Stub.requests)[0] == "Is this right? odd"
    guarded = reward.parts[0][2]
    assert guarded.last_extras["parse_failures"] == pytest.approx(0.2)


def test_judge_config_is_checked_in_one_line():
    with pytest.raises(ValueError, match=r"reward_fn.judge takes one of model_name .* and url .*, got both"):
        config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {"model_name": "a", "url": "http://x"}}})
    with pytest.raises(ValueError, match=r"reward_fn.judge.engine=url needs reward_fn.judge.url$"):
        config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {"engine": "url", "model_name": "a"}}})
    with pytest.raises(ValueError, match=r"reward_fn.judge.engine=rollout judges on the run's rollout engine: "
                                         r"remove reward_fn.judge.model_name"):
        config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {"engine": "rollout", "model_name": "a"}}})
    with pytest.raises(ValueError, match=r"reward_fn.judge.engine must be one of"):
        config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {"engine": "vllm"}}})
    with pytest.raises(ValueError, match=r"reward_fn.judge.parser must be one of \['score', 'verdict'\]"):
        config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {"url": "http://x", "parser": "regex"}}})
    with pytest.raises(ValueError, match=r"unknown key reward_fn.judge.temperature"):
        config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {"url": "http://x", "temperature": 1}}})
    with pytest.raises(ValueError, match=r"reward_fn.judge.prompt_template: placeholders must be plain names"):
        config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {"url": "http://x",
                                                                          "prompt_template": "{columns[0]}"}}})
    with pytest.raises(ValueError, match=r"reward_fn\[0\].judge applies to reward_fn\[0\].type=judge only"):
        config_mod.from_dict({"reward_fn": [{"type": "gsm8k", "judge": {"url": "http://x"}}, {"type": "gsm8k"}]})
    with pytest.raises(ValueError, match=r"reward_fn.judge.verdicts must map words to numbers"):
        parse({"url": "http://x", "verdicts": {"yes": "1"}})
