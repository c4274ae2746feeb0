"""The verifiers adapter: the example's environment (verifiers 0.3's MultiTurnEnv with its dataset and
Rubric) gives through the adapter the episodes verifiers' own run_rollout gives it (the same
observations, the rubric's reward and metrics on the last turn); in a multi-turn rollout the model's
sampled ids are kept exactly; tools of a ToolEnv are called; an environment that raises scores 0; a
trajectory cut short is counted unscored and its rollout cancelled; bad arguments are one line."""

import asyncio
import concurrent.futures
import signal
import threading
from pathlib import Path

import pytest

pytest.importorskip("verifiers.legacy.envs.environment")

import verifiers as vf  # noqa: E402
from datasets import Dataset  # noqa: E402
from verifiers.legacy.clients.client import Client  # noqa: E402
from verifiers.legacy.types import Response, ResponseMessage  # noqa: E402

from tiny_models import build_tokenizer  # noqa: E402
from verl_fast import extras  # noqa: E402
from verl_fast.agents import verifiers_env  # noqa: E402
from verl_fast.agents.environments import checked_reset, checked_step  # noqa: E402
from verl_fast.agents.guarded import GuardedEnvironment  # noqa: E402
from verl_fast.agents.rollout import MultiTurnRolloutOperator  # noqa: E402
from verl_fast.agents.settings import VERIFIERS_ADAPTER, MultiTurnConfig  # noqa: E402
from verl_fast.agents.verifiers_env import VerifiersEnvironment, build_environment  # noqa: E402
from verl_fast.data import RLDataProcessor, load_rows  # noqa: E402
from verl_fast.records.generation import SamplingSpec, pad_completions  # noqa: E402
from verl_fast.records.prompts import PromptRow  # noqa: E402
from verl_fast.rollout.base import RolloutEngine  # noqa: E402

ENV_FILE = Path(__file__).resolve().parents[2] / "examples" / "verifiers_env" / "env.py"
SPEC = f"{ENV_FILE}:load_environment"
KWARGS = {"num_examples": 6, "seed": 1}


def rows():
    return load_rows(f"verifiers:{SPEC}", **KWARGS)


def prompt_row(r):
    return PromptRow(prompt_ids=[1], prompt_text="", ground_truth=r["answer"], columns=dict(r), extra_info={})


class Scripted(Client):
    """verifiers' model client answering from a script (the reference run, verifiers' own loop)."""

    def __init__(self, answers):
        super().__init__(None)
        self.answers = list(answers)

    def setup_client(self, config):
        raise AssertionError("not built from a config")

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        return self.answers.pop(0)

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, text):
        return Response(id="x", created=0, model="m",
                        message=ResponseMessage(content=text, finish_reason="stop", is_truncated=False))

    async def close(self):
        return None


def by_verifiers(row, answers):
    """verifiers' own run_rollout of the example's environment: (completion messages, reward, metrics)."""
    env = build_environment(SPEC, KWARGS)
    inp = {"prompt": row["prompt"], "answer": row["answer"], "example_id": row["example_id"]}
    out = asyncio.run(env.run_rollout(inp, Scripted(answers), "m", {}))
    completion = [{"role": m["role"], "content": m["content"]} for m in out["completion"]]
    return completion, out["reward"], out["metrics"]


def through_adapter(row, answers):
    """The adapter's episode: (the messages after the prompt, the rewards per turn, its metrics)."""
    env = VerifiersEnvironment(env=SPEC, env_kwargs=KWARGS)
    first = checked_reset(env.reset(prompt_row(row)), "sum")
    assert first == row["prompt"]  # the system prompt of the environment's dataset, then the question
    completion, rewards = [], []
    for text in answers:
        completion.append({"role": "assistant", "content": text})
        result = checked_step(env.step({"role": "assistant", "content": text}), "sum")
        rewards.append(result.reward)
        completion += [{"role": m["role"], "content": m["content"]} for m in result.messages]
        if result.done:
            return completion, rewards, env.metrics()
    raise AssertionError("the episode did not end")


@pytest.mark.parametrize("answers, turns, reward", [
    (["7", "It is {}"], 2, 1.0),         # wrong, told to try again, right: correct_answer only
    (["{}"], 1, 1.5),                    # right at once: correct_answer + 0.5 first_try
    (["1", "2", "no idea"], 3, 0.0),     # the environment's max_turns (3) ends it
])
def test_the_adapter_gives_verifiers_own_episodes(answers, turns, reward):
    row = rows()[2]
    answers = [a.format(row["answer"]) for a in answers]
    completion, rewards, metrics = through_adapter(row, answers)
    ref_completion, ref_reward, ref_metrics = by_verifiers(row, answers)
    assert completion == ref_completion and len(rewards) == turns
    assert rewards == [None] * (turns - 1) + [reward] and ref_reward == reward
    assert metrics["verifiers_reward"] == reward and metrics["verifiers_unscored"] == 0.0
    assert {k: metrics[f"verifiers_{k}"] for k in ref_metrics} == ref_metrics
    assert ref_metrics["num_turns"] == turns


def test_the_dataset_rows_are_the_environments():
    got = rows()
    env = build_environment(SPEC, KWARGS)
    assert len(got) == 6 and [r["answer"] for r in got] == list(env.get_dataset()["answer"])
    assert got[0]["prompt"] == [{"role": "system", "content": "Answer with just the number."},
                                {"role": "user", "content": env.get_dataset()[0]["question"]}]
    a, b = (int(x) for x in got[0]["prompt"][1]["content"][len("What is "):-1].split(" + "))
    assert got[0]["answer"] == str(a + b)
    proc = RLDataProcessor(build_tokenizer(), 256, 64)
    encoded = proc.encode_all(got)
    assert len(encoded) == 6 and encoded[1].ground_truth == got[1]["answer"]


class Answers(RolloutEngine):
    """Samples ``first`` for a first prompt and ``then`` for any continuation (fixed token ids)."""

    def __init__(self, tok, first_len, first, then):
        self.first_len, self.first, self.then = first_len, first, then
        self.pad_token_id = tok.pad_token_id

    def generate(self, prompts, sampling):
        out = [list(self.then if len(p) > self.first_len else self.first) for p in prompts]
        return pad_completions(out, None, list(range(len(prompts))), self.pad_token_id, ["" for _ in out],
                               ["stop"] * len(out))


def test_a_multi_turn_rollout_keeps_the_sampled_ids_and_puts_the_reward_on_the_last_turn():
    tok = build_tokenizer()
    proc = RLDataProcessor(tok, 256, 64)
    row = proc.encode_all(rows()[:1])[0]
    eos = tok.eos_token_id
    wrong = tok(f"It is {int(row.ground_truth) + 1}")["input_ids"] + [eos]
    right = tok(f"It is {row.ground_truth}")["input_ids"] + [eos]
    mt = MultiTurnConfig(environment=VERIFIERS_ADAPTER, environment_kwargs={"env": SPEC, "env_kwargs": KWARGS},
                         max_turns=3)
    from verl_fast.agents.chat import ChatRenderer

    first_len = len(ChatRenderer(tok, []).prompt_ids(row.columns["prompt"]))
    op = MultiTurnRolloutOperator(Answers(tok, first_len, wrong, right), SamplingSpec(n=2, max_tokens=64,
                                                                                      logprobs=False), tok, mt, {})
    try:
        out = op.rollout([row])
        for i in range(2):
            mask = out.response_mask[i].bool()
            assert out.response_ids[i][mask].tolist() == wrong + right  # the model's ids, exactly as sampled
            ends = out.turn_ends[i]
            assert len(ends) == 2 and out.token_rewards[i, ends].tolist() == [0.0, 1.0]
            assert out.token_rewards[i].sum() == 1.0
            observed = tok.decode(out.response_ids[i][~mask][: int(out.attention_mask[i].sum()) - mask.sum()])
            assert "Not quite. Try again" in observed
        metrics = op.metrics()
        assert metrics["multi_turn/verifiers_reward"] == 2.0 and metrics["multi_turn/verifiers_unscored"] == 0.0
        assert metrics["multi_turn/verifiers_correct_answer"] == 2.0 and metrics["multi_turn/verifiers_errors"] == 0.0
    finally:
        op.close()


def test_a_trajectory_the_limits_cut_is_unscored_and_its_rollout_cancelled():
    guarded = GuardedEnvironment(lambda: VerifiersEnvironment(env=SPEC, env_kwargs=KWARGS), "sum", 60.0)
    guarded.reset(prompt_row(rows()[0]))
    assert guarded.step({"role": "assistant", "content": "no idea"}).done is False  # the trainer ends it here
    assert guarded.metrics()["verifiers_unscored"] == 1.0 and guarded.metrics()["verifiers_reward"] == 0.0
    episode = guarded._env._episode
    guarded.close()  # as the rollout closes every trajectory's environment: the adapter's own close
    with pytest.raises(concurrent.futures.CancelledError):
        episode.result(timeout=10)


class Raises(vf.MultiTurnEnv):
    """An environment whose env_response raises (``how``: a plain exception, or verifiers' own error)."""

    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how = how

    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the game broke") if self.how == "plain" else vf.Error("the game broke")


def raising_environment(how="plain"):
    data = Dataset.from_list([{"question": "What is 1 + 1?", "answer": "2"}])
    return Raises(how, dataset=data, rubric=vf.Rubric(funcs=[lambda completion: 1.0]), max_turns=3)


@pytest.mark.parametrize("how", ["plain", "verifiers"])
def test_an_environment_that_raises_is_scored_as_failed(how, tmp_path, caplog):
    spec = f"{Path(__file__).resolve()}:raising_environment"
    env = VerifiersEnvironment(env=spec, env_kwargs={"how": how})
    row = load_rows(f"verifiers:{spec}", how=how)[0]
    env.reset(prompt_row(row))
    result = env.step({"role": "assistant", "content": "3"})
    assert (result.messages, result.reward, result.done) == ([], 0.0, True)
    assert env.metrics()["verifiers_errors"] == 1.0 and env.metrics()["verifiers_reward"] == 0.0
    assert "the game broke" in caplog.text


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def tool_environment():
    data = Dataset.from_list([{"question": "What is 2 + 3? Use the tool.", "answer": "5"}])
    rubric = vf.Rubric(funcs=[lambda completion, answer: float(completion[-1].content == answer)])
    return vf.ToolEnv(tools=[add], dataset=data, rubric=rubric, max_turns=3)


def test_a_tool_environment_runs_the_models_calls():
    spec = f"{Path(__file__).resolve()}:tool_environment"
    schemas = VerifiersEnvironment.tool_schemas(env=spec)
    assert schemas[0]["function"]["name"] == "add"
    assert schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    env = VerifiersEnvironment(env=spec)
    env.reset(prompt_row(load_rows(f"verifiers:{spec}")[0]))
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    result = checked_step(env.step({"role": "assistant", "content": call}), "tools")
    assert result.messages == [{"role": "tool", "content": "5", "tool_call_id": "call00000"}]
    assert result.done is False and result.reward is None
    result = env.step({"role": "assistant", "content": "5"})  # no call: ToolEnv's no_tools_called ends it
    assert (result.reward, result.done) == (1.0, True) and env.metrics()["verifiers_total_tool_calls"] == 1.0


def test_built_off_the_main_thread_the_trainers_signal_handlers_stay():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    built = []
    thread = threading.Thread(target=lambda: built.append(build_environment(SPEC, {"num_examples": 2, "seed": 9})))
    thread.start()
    thread.join(60)
    assert built and (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert build_environment(SPEC, {"seed": 9, "num_examples": 2}) is built[0]  # once per process


def grouped_environment():
    data = Dataset.from_list([{"question": "q", "answer": "a"}])
    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[lambda completions: [1.0] * len(completions)]))


@pytest.mark.parametrize("kwargs, message", [
    ({}, "needs environment_kwargs.env"),
    ({"env": SPEC, "env_kwargs": [1]}, "environment_kwargs.env_kwargs must be a mapping"),
    ({"env": SPEC, "env_kwargs": {"rounds": 2}}, r"environment_kwargs.env=.*unexpected keyword argument 'rounds'"),
    ({"env": f"{ENV_FILE}:last_number", "env_kwargs": {"text": "1"}}, "must give a verifiers Environment"),
    ({"env": f"{Path(__file__).resolve()}:grouped_environment"}, "its rubric has group reward functions"),
    ({"env": SPEC, "tool_format": "json"}, "environment_kwargs.tool_format must be one of"),
])
def test_bad_arguments_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        VerifiersEnvironment(**kwargs)
    assert "\n" not in str(e.value)


def test_a_bad_dataset_source_names_it():
    with pytest.raises(ValueError, match=r"^dataset verifiers:.*unexpected keyword argument 'size' \(dataset_kwargs\)"):
        load_rows(f"verifiers:{SPEC}", size=8)
    with pytest.raises(ValueError, match="^dataset verifiers:: names no verifiers environment"):
        load_rows("verifiers:")


def test_a_missing_verifiers_is_named_with_its_install(monkeypatch):
    from verl_fast import config

    cfg = config.from_dict({"rollout": {"multi_turn": {"environment": VERIFIERS_ADAPTER}}})
    monkeypatch.setattr(extras, "installed", lambda m: m != "verifiers")
    assert extras.missing(cfg, modules=("verifiers",)) == [
        f"rollout.multi_turn.environment={VERIFIERS_ADAPTER}, which needs the verifiers package: pip install "
        "--no-deps verifiers==0.3.1 and pip install 'verl_fast[verifiers]' (what it imports)"]
    cfg = config.from_dict({"trainer": {"dataset": f"verifiers:{SPEC}"}})
    assert extras.missing(cfg, modules=("verifiers",))[0].startswith(f"trainer.dataset=verifiers:{SPEC}, which")
    assert verifiers_env.RELEASE == "verifiers==0.3.1"
