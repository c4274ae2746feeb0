"""Environments that hang or return garbage (python_tests/support/agent_faults.py) in a multi-turn
rollout: a step that never returns ends its trajectory within rollout.multi_turn.env_timeout_s (in a
thread or a worker process of its own, which is then gone), a reset that never returns stops the run
naming the environment, and a wrong return type is one line naming the environment, the method and
what was wrong."""

import time

import pytest

import agent_faults
from agent_faults import GARBAGE, wait_gone
from tiny_models import build_tokenizer
from verl_fast.agents.rollout import MultiTurnRolloutOperator
from verl_fast.agents.settings import MultiTurnConfig
from verl_fast.data import RLDataProcessor
from verl_fast.records.generation import SamplingSpec, pad_completions
from verl_fast.rollout.base import RolloutEngine

HARNESS = agent_faults.__file__


class Fixed(RolloutEngine):
    """Answers every prompt with the same short turn."""

    def __init__(self, tok):
        self.tok, self.pad_token_id = tok, tok.pad_token_id

    def generate(self, prompts, sampling):
        out = [self.tok("The answer is 4.")["input_ids"] + [self.tok.eos_token_id] for _ in prompts]
        return pad_completions(out, None, list(range(len(prompts))), self.pad_token_id, ["" for _ in out], ["stop"] * len(out))


def rollout(env, isolation="thread", timeout_s=0.5, n=2, **kwargs):
    """One rollout of two prompts x ``n`` samples with environment ``env`` (a class of the harness)."""
    tok = build_tokenizer()
    proc = RLDataProcessor(tok, 256, 128)
    rows = proc.encode_all([{"prompt": "What is 2 + 2?"}, {"prompt": "What is 3 + 3?"}])
    mt = MultiTurnConfig(environment=f"{HARNESS}:{env}", max_turns=3, environment_kwargs=kwargs,
                         env_timeout_s=timeout_s, env_isolation=isolation)
    op = MultiTurnRolloutOperator(Fixed(tok), SamplingSpec(n=n, max_tokens=64, logprobs=False), tok, mt, {})
    try:
        return op.rollout(rows), op.metrics()
    finally:
        op.close()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_step_that_never_returns_ends_its_trajectory(isolation, tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("VERL_FAST_FAULTS_PIDS", str(pid_file))
    start = time.perf_counter()
    out, metrics = rollout("Hang", isolation)
    assert time.perf_counter() - start < 10  # four steps hanging at once: each given up after 0.5 s
    assert metrics["multi_turn/env_timeouts"] == 4 and metrics["multi_turn/turns_max"] == 1
    assert out.response_ids.shape[0] == 4 and all(len(ends) == 1 for ends in out.turn_ends)
    if isolation == "process":  # the step ran in the environment's worker, killed with its trajectory
        worker = int(pid_file.read_text())
        assert not wait_gone([worker], 2.0)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_reset_that_never_returns_stops_the_run_naming_the_environment(isolation):
    with pytest.raises(RuntimeError, match=r"environment .*agent_faults\.py:Hang: reset did not return within 0\.5 s "
                                           r"\(rollout\.multi_turn\.env_timeout_s\)"):
        rollout("Hang", isolation, n=1, where="reset")


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_wrong_return_types_are_one_line_naming_the_environment_and_method(kind):
    method, _, expect = GARBAGE[kind]
    with pytest.raises(ValueError) as e:
        rollout("Garbage", n=1, kind=kind)
    line = str(e.value)
    assert "\n" not in line and f"agent_faults.py:Garbage: {method}" in line and expect in line, line


@pytest.mark.parametrize("kind", ["step_none", "int_content", "reset_string"])
def test_wrong_return_types_from_a_worker_process_too(kind):
    _, _, expect = GARBAGE[kind]
    with pytest.raises(ValueError, match="agent_faults.py:Garbage: ") as e:
        rollout("Garbage", "process", timeout_s=5.0, n=1, kind=kind)
    assert expect in str(e.value)


def test_lone_surrogates_in_an_environments_messages_are_replaced():
    from verl_fast.agents.environments import StepResult, checked_step

    r = checked_step(StepResult([{"role": "user", "content": "caf\udce9"}]), "E")
    assert r.messages[0]["content"].encode("utf-8").startswith(b"caf") and "\ufffd" in r.messages[0]["content"]



def test_environment_calls_reuse_their_threads_and_a_hung_one_is_left_behind(monkeypatch):
    """Calls on the thread isolation reuse idle threads; a call past its time keeps its thread, and the next
    call gets another."""
    import threading

    from verl_fast.agents import guarded

    class Echo:
        def __init__(self):
            self.release = threading.Event()

        def step(self, message):
            if message == "hang":
                self.release.wait(30)
            return threading.current_thread().ident

    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real_start(self))[1])
    monkeypatch.setattr(guarded, "_THREADS", guarded._DaemonThreads())
    echo = Echo()
    env = guarded.GuardedEnvironment(lambda: echo, "echo", timeout_s=0.3)
    try:
        first = {env._call("step", "hi") for _ in range(20)}
        assert len(first) == 1 and started.count("verl_fast environment") == 1
        assert env._call("step", "hang") is guarded._TIMEOUT
        assert env._call("step", "hi") not in first  # the hung thread is not handed the next call
        assert started.count("verl_fast environment") == 2
    finally:
        echo.release.set()


def test_idle_environment_threads_end():
    import threading
    import time

    from verl_fast.agents import guarded

    threads = guarded._DaemonThreads(idle_s=0.2)
    assert [threads.submit(lambda i=i: i).result(timeout=5) for i in range(3)] == [0, 1, 2]
    named = lambda: [t for t in threading.enumerate() if t.name == "verl_fast environment"]  # noqa: E731
    before = len(named())
    assert before >= 1
    deadline = time.monotonic() + 10
    while len(named()) >= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(named()) < before
    assert threads.submit(lambda: "again").result(timeout=5) == "again"  # a new thread for the next call


def test_a_forked_child_starts_its_own_environment_threads():
    """The child of a fork has none of its parent's threads: its first call must not be promised the
    parent's idle one (it would wait for it forever)."""
    import os

    from verl_fast.agents import guarded

    assert guarded._THREADS.submit(lambda: 1).result(timeout=5) == 1  # the parent has an idle thread now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when its call is answered
        try:
            code = 0 if guarded._THREADS.submit(lambda: 7).result(timeout=5) == 7 else 1
        except BaseException:  # noqa: BLE001 - any failure is the child's exit code
            code = 1
        os._exit(code)
    import signal
    import time

    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:  # stuck: the test fails rather than hangs
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's environment call never returned")
    assert os.waitstatus_to_exitcode(done[1]) == 0
