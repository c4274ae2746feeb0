"""The OpenEnv adapter: the example's environment (openenv-core's interface, a rubric) in-process and
through a real OpenEnv server (create_app under uvicorn) by URL, played by a scripted binary search;
both ways give the same episodes; bad arguments are one line."""

import importlib.util
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("openenv.core")

from ports import free_port  # noqa: E402
from verl_fast.agents.environments import checked_reset, checked_step  # noqa: E402
from verl_fast.agents.openenv_env import OpenEnvEnvironment  # noqa: E402
from verl_fast.records.prompts import PromptRow  # noqa: E402

ENV_FILE = Path(__file__).resolve().parents[2] / "examples" / "openenv_env" / "env.py"
SPEC = f"{ENV_FILE}:GuessEnv"


def _module():
    spec = importlib.util.spec_from_file_location("openenv_example", ENV_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server_url():
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    m = _module()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(m.GuessEnv, m.GuessAction, m.GuessObservation),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def row(seed, prompt="Let's play."):
    return PromptRow(prompt_ids=[1], prompt_text=prompt, columns={"prompt": prompt}, extra_info={"seed": seed})


def play(env, seed):
    """A binary search over 1..20: the episode's observations, rewards and last guess."""
    first = checked_reset(env.reset(row(seed)), "guess")
    low, high, seen, rewards = 1, 20, [first[-1]["content"]], []
    for _ in range(6):
        guess = (low + high) // 2
        result = checked_step(env.step({"role": "assistant", "content": f"My guess: {guess}"}), "guess")
        rewards.append(result.reward)
        if result.done:
            return seen, rewards, guess
        seen.append(result.messages[0]["content"])
        assert result.messages[0]["role"] == "user"
        low, high = (guess + 1, high) if seen[-1] == "Higher." else (low, guess - 1)
    raise AssertionError("the episode did not end")


@pytest.mark.parametrize("seed", [0, 3, 11])
def test_in_process_and_by_url_give_the_same_episodes(server_url, seed):
    import random

    target = random.Random(seed).randint(1, 20)
    local = OpenEnvEnvironment(env=SPEC, env_kwargs={"max_guesses": 5})
    seen, rewards, last = play(local, seed)
    assert seen[0].startswith("Let's play.\n\nI picked a number from 1 to 20")
    # the binary search finds it within 5 guesses: reward 1 on the right turn only
    assert rewards[-1] == 1.0 and all(r == 0.0 for r in rewards[:-1]) and local.metrics()["openenv_reward"] == 1.0
    assert all(s in ("Higher.", "Lower.") for s in seen[1:])
    assert last == target and len(rewards) <= 5
    remote = OpenEnvEnvironment(url=server_url)  # the server's environment: the default 3 guesses
    episode = play(remote, seed)
    assert episode == play(OpenEnvEnvironment(env=SPEC), seed) and len(episode[1]) <= 3


def test_an_episode_that_runs_out_of_guesses_ends_without_reward():
    env = OpenEnvEnvironment(env=SPEC, env_kwargs={"max_guesses": 2}, system_prompt="Be brief.")
    first = env.reset(row(5))
    assert first[0] == {"role": "system", "content": "Be brief."}
    r1 = env.step({"role": "assistant", "content": "no idea"})
    assert (r1.messages[0]["content"], r1.reward, r1.done) == ("That is not a number.", 0.0, False)
    r2 = env.step({"role": "assistant", "content": "no idea"})
    assert (r2.messages, r2.reward, r2.done) == ([], 0.0, True)


def test_observation_field_and_bad_arguments():
    env = OpenEnvEnvironment(env=SPEC, observation_field="feedback")
    assert env.reset(row(1, prompt=""))[-1]["content"].startswith("I picked a number")
    with pytest.raises(ValueError, match="needs one of env"):
        OpenEnvEnvironment()
    with pytest.raises(ValueError, match="needs one of env"):
        OpenEnvEnvironment(env=SPEC, url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="must name an OpenEnv Environment subclass"):
        OpenEnvEnvironment(env=f"{ENV_FILE}:environment_reward_only")
    bad = OpenEnvEnvironment(env=SPEC, observation_field="nope")
    with pytest.raises(ValueError, match="no field 'nope'.*feedback"):
        bad.reset(row(1))
