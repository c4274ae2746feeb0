"""The judge on the run's own rollout engine (``reward_fn.judge.engine: rollout``): its verdicts against the
same model's one-at-a-time greedy ``generate`` (the HF judge), the batch in one engine call, the verdicts
read back in the prompts' order, the rollout's own samples, RNG state and weights untouched by the judge's
call (HF engine; vLLM-CPU), and a GRPO step through RLTrainer with the default judge engine."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as config_mod
from verl_fast.records.generation import SamplingSpec, pad_completions
from verl_fast.rewards import RewardInput, bind_judge_engine, build_reward
from verl_fast.rewards.judge import HFJudge, JudgeReward, RolloutJudge, parse
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.trainer.rl_trainer import RLTrainer

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")

RESPONSES = ["4", "The answer is 7, since 3 + 4 = 7.", "", "no idea", "Score: 10"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def samples():
    return [RewardInput(prompt=f"What is {i} + 3?", response=r, ground_truth=str(i + 3)) for i, r in enumerate(RESPONSES)]


class Counting:
    """An engine wrapper counting ``generate`` calls and their prompts."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling))
        return self.engine.generate(prompts, sampling)


def rollout_judge(max_new_tokens=8):
    cfg = parse({"prompt_template": "Q: {prompt}\nA: {response}\nScore?", "max_new_tokens": max_new_tokens})
    assert cfg.engine == "rollout"  # the default without model_name / url
    return JudgeReward.from_config(cfg)


@pytest.mark.parametrize("fast_decode", ["off", "on"])
def test_rollout_judge_matches_greedy_generate_in_one_engine_call(tiny, fast_decode):
    _, model, tok = tiny
    reward = rollout_judge()
    engine = Counting(HFGenerateEngine(model, tok, fast_decode=fast_decode))
    reward.backend.bind(engine, tok)
    scores = reward(samples())
    assert len(engine.calls) == 1 and engine.calls[0][0] == len(RESPONSES)
    spec = engine.calls[0][1]
    assert spec.temperature == 0.0 and spec.max_tokens == 8 and spec.n == 1
    # the reference: the same model's greedy generate, one prompt at a time
    prompts = [reward._prompt(s, i) for i, s in enumerate(samples())]
    ref = HFJudge(model, tok, max_new_tokens=8, batch_size=1).complete(prompts)
    assert reward.last_texts == ref
    read = [reward.read(t) for t in ref]
    assert scores == [0.0 if v is None else v for v in read]
    assert reward.last_extras["parse_failures"] == [float(v is None) for v in read]


class Scripted:
    """An engine whose replies are fixed texts, returned in a shuffled row order (as an engine may)."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.calls = tok, replies, 0

    def generate(self, prompts, sampling):
        self.calls += 1
        order = list(reversed(range(len(prompts))))
        ids = [self.tok(self.replies[i], add_special_tokens=False)["input_ids"] for i in order]
        return pad_completions(ids, [[0.0] * len(t) for t in ids], order, self.tok.pad_token_id or 0)


def test_verdicts_are_read_back_in_the_prompts_order_and_failures_counted(tiny):
    _, _, tok = tiny
    replies = ["Score: 7", "I think... Score: 3", "banana", "Score: 12", "10"]
    reward = rollout_judge()
    engine = Scripted(tok, replies)
    reward.backend.bind(engine, tok)
    assert reward(samples()) == pytest.approx([0.7, 0.3, 0.0, 0.0, 1.0])
    assert engine.calls == 1
    assert reward.last_texts == replies
    assert reward.last_extras["parse_failures"] == [0.0, 0.0, 1.0, 1.0, 0.0]


def test_an_unbound_rollout_judge_says_so_in_one_line():
    reward = rollout_judge()
    with pytest.raises(ValueError, match=r"reward_fn.judge.engine=rollout judges on the trainer's rollout engine, "
                                         r"and none is bound"):
        reward(samples())
    cfg = config_mod.from_dict({"reward_fn": {"type": "judge"}})
    built = build_reward(cfg.reward_fn)
    with pytest.raises(ValueError, match=r"this run has none \(an offline algorithm\)"):
        bind_judge_engine(built, None, None)
    url = build_reward(config_mod.from_dict({"reward_fn": {"type": "judge", "judge": {"url": "http://x"}}}).reward_fn)
    assert bind_judge_engine(url, None, None) is False


def sample_twice(engine, judge=None):
    """A seeded sampled rollout, optionally the judge's call, then a seeded and an unseeded one (the global
    RNG's draws)."""
    prompts = [[5, 9, 13, 2], [7, 7, 1], [3, 30, 11, 4, 8]]
    first = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=6, seed=11))
    if judge is not None:
        judge(samples())
    second = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=6, seed=12))
    third = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=6))
    return first, second, third


def same(a, b):
    assert a.response_ids.tolist() == b.response_ids.tolist()
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_the_rollouts_results_are_untouched_by_the_judges_call(tiny):
    _, model, tok = tiny
    engine = HFGenerateEngine(model, tok, fast_decode="on", compact_rows="off")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    plain = sample_twice(engine)
    reward = rollout_judge()
    reward.backend.bind(engine, tok)
    torch.manual_seed(123)
    judged = sample_twice(engine, reward)
    for a, b in zip(plain, judged):
        same(a, b)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    # and a multi-turn rollout's KV continuation after a judge's call (the engine keeps no other cache)
    cache = engine.turn_cache()
    out1 = cache.generate(["a"], [[5, 9, 13, 2]], SamplingSpec(temperature=0.0, max_tokens=4))
    reward(samples())
    out2 = cache.generate(["a"], [[5, 9, 13, 2] + out1.response_ids[0].tolist() + [8, 8]],
                          SamplingSpec(temperature=0.0, max_tokens=4))
    ref = engine.generate([[5, 9, 13, 2] + out1.response_ids[0].tolist() + [8, 8]],
                          SamplingSpec(temperature=0.0, max_tokens=4))
    same(out2, ref)
    assert cache.metrics()["prefill_tokens_saved"] > 0


def test_a_grpo_step_judged_on_the_rollout_engine(tiny, tmp_path):
    path, _, tok = tiny
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 2, "max_new_tokens": 8},
           "reward_fn": {"type": "judge", "judge": {"max_new_tokens": 4}}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tr = RLTrainer(actor_model=model, tokenizer=tok, config=cfg)
    judge = tr.reward.parts[0][2].inner.backend
    assert isinstance(judge, RolloutJudge) and judge.engine is tr.engine
    events = []
    for name in ("wake_up", "sleep", "generate"):  # the engine's calls, in order
        method = getattr(tr.engine, name)
        setattr(tr.engine, name, lambda *a, _m=method, _n=name, **k: events.append(_n) or _m(*a, **k))
    history = tr.fit([{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "ground_truth": str(a + 1)}
                      for a in range(2)])
    assert judge.calls == 2  # one engine call per step for the step's 4 verdicts
    # each step: the rollout's and the judge's generate calls, then the sleep (wake-ups are idempotent)
    assert events[0] == "wake_up" and [e for e in events if e != "wake_up"] == ["generate", "generate", "sleep"] * 2
    assert "reward/judge/parse_failures" in history[-1] and history[-1]["reward/judge/seconds"] > 0
    assert "actor/pg_loss" in history[-1]


def test_rollout_judge_on_vllm_cpu_leaves_the_rollout_untouched(tiny):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from verl_fast.rollout.vllm_engine import VLLMInferenceEngine
    from verl_fast.rollout.vllm_env import configure_vllm_env

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path, model, tok = tiny
    configure_vllm_env()
    engine = VLLMInferenceEngine(path, dtype="float32", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=1024,
                                 block_size=32, seed=0, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    try:
        plain = sample_twice(engine)
        reward = rollout_judge()
        counting = Counting(engine)
        reward.backend.bind(counting, tok)
        judged = sample_twice(engine, reward)
        for a, b in zip(plain[:2], judged[:2]):  # seeded: the same draws before and after the judge's call
            same(a, b)
        assert len(counting.calls) == 1 and counting.calls[0][0] == len(RESPONSES)
        # the verdicts are the model's greedy continuations of the judge prompts (HF's, to float rounding)
        ref = HFJudge(model, tok, max_new_tokens=8, batch_size=1).complete(
            [reward._prompt(s, i) for i, s in enumerate(samples())])
        assert sum(a == b for a, b in zip(reward.last_texts, ref)) >= len(ref) - 1
    finally:
        engine.close()
