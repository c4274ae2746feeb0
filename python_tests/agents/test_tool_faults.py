"""Tools that hang, fork, flood, return hostile objects or lone surrogates (the harness in
python_tests/support/agent_faults.py) against the executor: every call ends, what a tool started
ends with it, nothing but text reaches the trainer, and the run's exit never waits on a worker."""

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import agent_faults
from agent_faults import TOOLS, alive, pids_in_groups, wait_gone
from verl_fast.agents.tools import ToolExecutor

SUPPORT = Path(agent_faults.__file__).parent


@pytest.fixture
def executor():
    ex = ToolExecutor(TOOLS, workers=2, timeout_s=1.0, max_result_bytes=200, max_output_bytes=100)
    yield ex
    ex.close()


def _script(tmp_path, body):
    """A trainer-like process: the harness importable, ``body`` run after the imports."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(SUPPORT)!r})\n" + textwrap.dedent(body)]


def test_a_run_whose_tool_timed_out_exits_on_its_own(tmp_path):
    """The trainer's SIGTERM handler (as StopSignals installs) must not reach the replaced worker:
    exit (which stops the workers) then hung for ever."""
    body = """
        import signal
        from agent_faults import TOOLS
        from verl_fast.agents.tools import ToolExecutor
        signal.signal(signal.SIGTERM, lambda *a: None)
        ex = ToolExecutor(TOOLS, workers=1, timeout_s=0.5)
        print(ex.call("stall", {"seconds": 30}).status, flush=True)
    """
    run = subprocess.run(_script(tmp_path, body), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "timeout", run.stderr


def test_exit_without_close_leaves_no_worker(tmp_path):
    body = """
        from agent_faults import TOOLS
        from verl_fast.agents.tools import ToolExecutor
        ex = ToolExecutor(TOOLS, workers=2, timeout_s=5.0)
        print(ex.call("spawn_sleepers", {"count": 2}).content, *(w.pid for w in ex._all), flush=True)
    """
    run = subprocess.run(_script(tmp_path, body), capture_output=True, text=True, timeout=60)
    pids = [int(p) for p in run.stdout.split()]
    assert run.returncode == 0 and len(pids) == 4, run.stderr
    assert not wait_gone(pids), f"processes {alive(pids)} outlived the run"


def test_processes_a_tool_starts_end_at_close(executor):
    children = [int(p) for p in executor.call("spawn_sleepers", {"count": 3}).content.split()]
    groups = {w.pid for w in executor._all}
    assert len(alive(children)) == 3 and set(pids_in_groups(groups)) >= set(children)
    executor.close()
    assert not wait_gone(children, 2.0) and not pids_in_groups(groups)


def test_a_timed_out_call_takes_its_processes_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_FAST_FAULTS_PIDS", str(tmp_path / "pids"))  # before the workers fork
    with ToolExecutor(TOOLS, workers=1, timeout_s=1.0) as executor:
        before = {w.pid for w in executor._all}
        r = executor.call("spawn_and_stall", {"count": 3})
        assert r.status == "timeout"
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert not wait_gone(pids, 2.0), f"{alive(pids)} outlived the timed-out call"
        assert not pids_in_groups(before - {w.pid for w in executor._all})


def test_kill_9_of_the_trainer_during_a_call_takes_the_workers_and_their_children(tmp_path):
    pids_file = tmp_path / "pids"
    body = """
        from agent_faults import TOOLS
        from verl_fast.agents.tools import ToolExecutor
        ex = ToolExecutor(TOOLS, workers=2, timeout_s=60.0)
        print(*(w.pid for w in ex._all), flush=True)
        ex.call("spawn_and_stall", {"count": 3})
    """
    proc = subprocess.Popen(_script(tmp_path, body), stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "VERL_FAST_FAULTS_PIDS": str(pids_file)})
    workers = [int(p) for p in proc.stdout.readline().split()]
    deadline = time.monotonic() + 20
    while not (pids_file.exists() and len(pids_file.read_text().split()) == 4) and time.monotonic() < deadline:
        time.sleep(0.05)
    spawned = [int(p) for p in pids_file.read_text().split()]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = wait_gone(workers + spawned, 5.0)
    assert not left, f"{left} outlived the killed trainer"


def test_a_hostile_result_runs_no_code_in_the_trainer(executor, tmp_path, monkeypatch):
    mark = tmp_path / "ran"
    monkeypatch.setenv("VERL_FAST_FAULTS_MARK", str(mark))
    r = executor.call("hostile", {"text": "looks harmless"})
    assert (r.status, r.content, type(r.content)) == ("ok", "looks harmless", str)
    assert not mark.exists()
    r = executor.call("unprintable", {"x": 1})
    assert r.status == "error" and "could not be made text" in r.content
    assert executor.call("stall", {"seconds": 0}).content == "woke"  # the workers are intact


def test_a_lone_surrogate_reaches_the_trainer_as_valid_text(executor):
    from tiny_models import build_tokenizer

    r = executor.call("surrogate", {"name": "caf"})
    assert r.status == "ok" and r.content.startswith("caf") and "\ufffd" in r.content
    r.content.encode("utf-8")  # strict: no surrogate left
    assert build_tokenizer()(r.content)["input_ids"]


def test_stdout_and_stderr_are_captured_bounded_and_counted(executor, capfd):
    executor.timeout_s = 30.0
    r = executor.call("flood", {"mib": 8})
    assert r.status == "ok" and r.content == "flooded"
    assert r.stdout_bytes >= 8 << 20 and r.stderr_bytes == 8 << 20
    assert len(r.stdout.encode()) <= 100 and r.stdout.startswith("x" * 50)
    out, err = capfd.readouterr()
    assert "xxxx" not in out and "xxxx" not in err and "from-a-child-process" not in out


@pytest.mark.parametrize("bad", [
    {"timeout_s": math.nan}, {"timeout_s": math.inf}, {"timeout_s": 0}, {"timeout_s": "1"}, {"workers": 0},
    {"workers": 100_000}, {"workers": 2.0}, {"max_result_bytes": 10}, {"max_output_bytes": -1}])
def test_executor_limits_are_refused_at_construction(bad):
    from verl_fast.agents.tools import MAX_WORKERS  # the bound: 100,000 workers would fork 100,000 processes

    with pytest.raises(ValueError, match=f"ToolExecutor: {next(iter(bad))} must be"):
        ToolExecutor(TOOLS, **{"workers": 1, **bad})
    assert MAX_WORKERS < 100_000


def test_call_never_raises(executor):
    r = executor.call("stall", {"seconds": object()})  # arguments that are not JSON
    assert r.status == "error" and "not JSON" in r.content
    executor.close()
    r = executor.call("stall", {"seconds": 0})
    assert r.status == "error" and "closed" in r.content
