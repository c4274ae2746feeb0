"""Tools in worker processes: a tool that hangs, raises, crashes its worker, returns 1 GB, or is
called forever cannot hang, crash or flood the run."""

import os
import time

import pytest

from verl_fast.agents.environments import ToolEnvironment
from verl_fast.agents.tools import ToolExecutor, load_tool, resolve_tools, tool_schema


def echo(text: str) -> str:
    """Returns its input.

    Args:
        text: Any text.
    """
    return text


def hang(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def fail(x: int) -> int:
    """Raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"bad {x}")


def crash(code: int) -> str:
    """Kills its own process.

    Args:
        code: The exit code.
    """
    os._exit(code)


def huge(gib: int) -> str:
    """Returns a very long string.

    Args:
        gib: Its size in GiB.
    """
    return "x" * (gib << 30)


TOOLS = {f.__name__: f for f in (echo, hang, fail, crash, huge)}


@pytest.fixture
def executor():
    ex = ToolExecutor(TOOLS, workers=2, timeout_s=1.0, max_result_bytes=200)
    yield ex
    ex.close()


def test_results_errors_and_unknown_tools(executor):
    assert (executor.call("echo", {"text": "hi"}).content, executor.call("echo", {"text": "hi"}).status) == ("hi", "ok")
    r = executor.call("fail", {"x": 3})
    assert r.status == "error" and r.content == "RuntimeError: bad 3"
    r = executor.call("echo", {"wrong": 1})
    assert r.status == "error" and "TypeError" in r.content
    r = executor.call("nope", {})
    assert r.status == "error" and "unknown tool 'nope'" in r.content


def test_a_hanging_tool_is_killed_and_its_worker_replaced(executor):
    start = time.perf_counter()
    r = executor.call("hang", {"seconds": 60})
    assert r.status == "timeout" and "timed out after 1 s" in r.content
    assert time.perf_counter() - start < 5
    assert executor.replaced == 1
    assert executor.call("echo", {"text": "still here"}).content == "still here"


def test_a_crashing_tool_costs_one_worker_and_nothing_else(executor):
    r = executor.call("crash", {"code": 7})
    assert r.status == "crash" and "code 7" in r.content
    assert executor.replaced == 1 and executor.call("echo", {"text": "ok"}).status == "ok"


def test_a_huge_result_is_cut_in_the_worker(executor):
    executor.timeout_s = 30.0
    r = executor.call("huge", {"gib": 1})
    assert r.status == "ok" and len(r.content.encode()) <= 200
    assert r.content.startswith("x" * 100) and r.content.endswith(f"[truncated: {1 << 30} bytes, limit 200]")


def test_calls_run_concurrently_up_to_the_worker_count():
    import concurrent.futures

    with ToolExecutor(TOOLS, workers=2, timeout_s=5.0) as ex, concurrent.futures.ThreadPoolExecutor(4) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda _: ex.call("hang", {"seconds": 0.5}), range(4)))
        took = time.perf_counter() - start
    assert [r.content for r in results] == ["woke"] * 4
    assert 0.95 < took < 1.9  # two at a time: two rounds of 0.5 s


def test_a_tool_called_forever_is_capped_per_trajectory(executor):
    env = ToolEnvironment(executor, "hermes", max_tool_calls=3)
    call = '<tool_call>{"name": "echo", "arguments": {"text": "again"}}</tool_call>'
    results = [env.step({"role": "assistant", "content": call}) for _ in range(3)]
    assert [r.done for r in results] == [False, False, False]
    last = env.step({"role": "assistant", "content": call + call})
    assert last.done and "tool call limit reached (3 per trajectory)" in last.messages[0]["content"]
    assert env.metrics()["tool_calls"] == 3 and env.metrics()["tool_calls_refused"] == 2
    assert env.step({"role": "assistant", "content": "The answer is 4."}).done


def test_loading_tools_by_name_and_their_schemas(tmp_path):
    f = tmp_path / "mytools.py"
    f.write_text('def double(x: int) -> int:\n    """Doubles.\n\n    Args:\n        x: A number.\n    """\n'
                 '    return 2 * x\n\n\ndef untyped(x):\n    return x\n')
    double = load_tool(f"{f}:double")
    assert tool_schema(double)["function"]["parameters"]["properties"]["x"]["type"] == "integer"
    assert resolve_tools(["verl_fast.agents.tools:load_tool"])["load_tool"] is load_tool
    with pytest.raises(ValueError, match="tool 'untyped': no JSON schema"):
        tool_schema(load_tool(f"{f}:untyped"))
    with pytest.raises(ValueError, match="has no function missing"):
        load_tool(f"{f}:missing")
    with pytest.raises(FileNotFoundError, match="no file"):
        load_tool(f"{tmp_path}/none.py:x")
    with pytest.raises(ValueError, match="module:function"):
        load_tool("no_colon")
    with pytest.raises(ValueError, match="two tools are named 'double'"):
        resolve_tools([double, double])


def test_workers_exit_when_the_trainer_is_killed(tmp_path):
    import signal
    import subprocess
    import sys

    script = ("import os, sys, time\nfrom verl_fast.agents.tools import ToolExecutor\n"
              "ex = ToolExecutor({'len': len}, workers=2)\n"
              "print(' '.join(str(w.pid) for w in ex._all), flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    alive = pids
    while alive and time.time() < deadline:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]
        time.sleep(0.2)
    assert not alive, f"tool workers {alive} outlived the killed trainer"


def _state(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:
        return "zombie"
