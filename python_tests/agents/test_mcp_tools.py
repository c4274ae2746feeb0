"""MCP tools (rollout.multi_turn.mcp_servers): listed from a stdio server written here (the SDK's
MCPServer, its FastMCP), called in the tool workers under the Python tools' limits; a hanging tool,
a server that dies, garbage on the wire, a server that cannot start."""

import os
import sys
import textwrap
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("mcp")

from tiny_models import save_tiny_model  # noqa: E402
from verl_fast.agents.environments import ToolEnvironment  # noqa: E402
from verl_fast.agents.mcp_tools import mcp_tools, parse_server  # noqa: E402
from verl_fast.agents.tools import ToolExecutor, resolve_tools, tool_schema  # noqa: E402

SERVER = textwrap.dedent('''
    import os, sys, time
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    with open(os.environ["PIDS"], "a") as f:   # every start of this server, by pid
        f.write(f"{os.getpid()}\\n")
    server = MCPServer("test tools")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        return a + b

    @server.tool()
    def refuse(reason: str) -> str:
        """Always fails (ToolError: the message reaches the client)."""
        raise ToolError(f"refused: {reason}")

    @server.tool()
    def hang() -> str:
        """Never returns."""
        time.sleep(3600)
        return "never"

    @server.tool()
    def die() -> str:
        """Kills its server."""
        os._exit(7)

    @server.tool()
    def garbage() -> str:
        """Writes what is not JSON-RPC on the server's stdout, then kills its server."""
        os.write(1, b"\\xff\\xfe not json {{{\\n")
        os._exit(0)

    @server.tool()
    def big(n: int) -> str:
        """A long answer."""
        print("noise on stderr", file=sys.stderr)
        return "x" * n

    if __name__ == "__main__":
        if len(sys.argv) > 1:  # a port: streamable HTTP
            server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
        else:
            server.run()
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mcp")
    (d / "server.py").write_text(SERVER)
    pids = d / "pids"
    pids.write_text("")
    return {"command": sys.executable, "args": [str(d / "server.py")], "env": {"PIDS": str(pids)}}, pids


@pytest.fixture(scope="module")
def executor(server):
    tools = resolve_tools(mcp_tools([server[0]], start_timeout_s=120))
    with ToolExecutor(tools, workers=2, timeout_s=20, max_result_bytes=256, max_output_bytes=64) as ex:
        yield ex


def _started(pids):
    return [int(p) for p in pids.read_text().split()]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def test_the_servers_tools_and_their_schemas(executor):
    assert sorted(executor.tools) == ["add", "big", "die", "garbage", "hang", "refuse"]
    schema = tool_schema(executor.tools["add"])
    assert schema["type"] == "function" and schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Adds two integers."
    params = schema["function"]["parameters"]
    assert params["required"] == ["a", "b"] and params["properties"]["a"]["type"] == "integer"


def test_calls_results_and_tool_errors(executor):
    for a, b in [(2, 3), (-7, 40), (10 ** 6, 1)]:
        r = executor.call("add", {"a": a, "b": b})
        assert (r.status, r.content) == ("ok", str(a + b))
    r = executor.call("refuse", {"reason": "no"})
    assert r.status == "error" and "refused: no" in r.content and r.content.startswith("McpCallError")
    r = executor.call("add", {"a": "x"})  # the server's own argument check, read by the model
    assert r.status == "error" and "validation" in r.content
    r = executor.call("big", {"n": 5000})  # cut in the worker; the server's stderr is the call's output
    assert r.status == "ok" and r.result_bytes == 5000 and len(r.content.encode()) <= 256
    assert "truncated" in r.content and r.stderr_bytes > 0 and len(r.stderr.encode()) <= 64


def test_a_hanging_tool_times_out_and_takes_its_server_along(server, executor):
    _, pids = server
    slow = ToolExecutor(executor.tools, workers=1, timeout_s=20)
    try:
        assert slow.call("add", {"a": 1, "b": 1}).content == "2"  # this worker's session is open
        ex_pid = _started(pids)[-1]
        slow.timeout_s = 3.0
        r = slow.call("hang", {})
        assert r.status == "timeout" and slow.replaced == 1
        deadline = time.monotonic() + 10
        while _alive(ex_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(ex_pid)  # killed with its worker (the kernel's parent-death signal)
        slow.timeout_s = 60.0
        assert slow.call("add", {"a": 2, "b": 2}).content == "4"  # a new worker, a new server
    finally:
        slow.close()


@pytest.mark.parametrize("tool", ["die", "garbage"])
def test_a_server_that_dies_or_sends_garbage_fails_the_call_and_starts_again(server, executor, tool):
    _, pids = server
    before = len(_started(pids))
    one = ToolExecutor(executor.tools, workers=1, timeout_s=60)
    try:
        assert one.call("add", {"a": 1, "b": 2}).content == "3"
        r = one.call(tool, {})
        assert r.status == "error" and "failed" in r.content and "mcp_servers[0]" in r.content
        assert one.replaced == 0  # the worker lives on; its next call starts the server again
        assert one.call("add", {"a": 3, "b": 4}).content == "7"
        assert len(_started(pids)) == before + 2
    finally:
        one.close()


def test_failed_calls_are_counted_in_the_metrics(executor):
    env = ToolEnvironment(executor, "hermes", max_tool_calls=8)
    msg = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
           '<tool_call>{"name": "refuse", "arguments": {"reason": "x"}}</tool_call>')
    out = env.step({"role": "assistant", "content": msg})
    assert [m["content"][:5] for m in out.messages] == ["3", "McpCa"]
    assert env.metrics()["tool_calls"] == 2 and env.metrics()["tool_errors"] == 1


def test_a_server_that_cannot_start_is_one_line_naming_it(tmp_path):
    with pytest.raises(ValueError) as e:
        mcp_tools([f"{sys.executable} -c 'import sys; sys.exit(\"no config here\")'"], start_timeout_s=60)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rollout.multi_turn.mcp_servers[0] (")
    assert "could not start" in msg and "no config here" in msg
    with pytest.raises(ValueError, match=r"mcp_servers\[0\].*did not answer within .*mcp_start_timeout_s=2$"):
        mcp_tools([{"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"]}], start_timeout_s=2)


@pytest.mark.parametrize("entry, match", [
    (3, "must be a command line"), ({"url": "ftp://x"}, "a URL server"), ({"comand": "x"}, "unknown key 'comand'"),
    ({"command": "x", "args": "a b"}, "args must be a list"),
    ({"command": "no-such-program-here"}, "not an executable"),
    ({"command": "python3", "env": {"A": 1}}, "env must map"), ("", "needs a command"), ("a 'b", "cannot split")])
def test_bad_server_entries_are_named(entry, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_server(entry, "rollout.multi_turn.mcp_servers[3]")
    assert str(e.value).startswith("rollout.multi_turn.mcp_servers[3]")


def test_server_entries():
    s = parse_server("python3 -m my.server --flag 'a b'", "k[0]")
    assert (s.command, s.args, s.url) == ("python3", ("-m", "my.server", "--flag", "a b"), None)
    assert parse_server("https://tools.example/mcp", "k[1]").url == "https://tools.example/mcp"
    s = parse_server({"command": "python3", "args": ["x.py"], "env": {"B": "2", "A": "1"}, "cwd": "/tmp"}, "k[2]")
    assert s.env == (("A", "1"), ("B", "2")) and s.cwd == "/tmp"


def test_a_server_by_url(server, tmp_path):
    import socket
    import subprocess

    from ports import free_port

    entry, _ = server
    port = free_port()
    proc = subprocess.Popen([entry["command"], *entry["args"], str(port)], env={**os.environ, **entry["env"]},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the HTTP server did not start"
                time.sleep(0.2)
        tools = resolve_tools(mcp_tools([f"http://127.0.0.1:{port}/mcp"], start_timeout_s=60))
        assert sorted(tools) == ["add", "big", "die", "garbage", "hang", "refuse"]
        with ToolExecutor(tools, workers=1, timeout_s=60) as ex:
            assert ex.call("add", {"a": 5, "b": 6}).content == "11"
            r = ex.call("refuse", {"reason": "by url"})
            assert r.status == "error" and "refused: by url" in r.content
    finally:
        proc.kill()
        proc.wait()


def test_the_config_key_is_checked_and_the_trainer_lists_the_servers_tools(server, tmp_path):
    from verl_fast import config as config_mod
    from verl_fast.agents.rollout import MultiTurnRolloutOperator
    from verl_fast.trainer.rl_trainer import RLTrainer

    base = {"rollout": {"type": "hf", "n": 2, "multi_turn": {"mcp_servers": [{"commnd": "x"}]}},
            "trainer": {"output_dir": str(tmp_path), "device": "cpu"}}
    with pytest.raises(ValueError, match=r"rollout.multi_turn.mcp_servers\[0\]: unknown key 'commnd'"):
        RLTrainer(actor_model=None, tokenizer=None, config=base)
    path = save_tiny_model(tmp_path / "qwen2", family="qwen2")
    base["rollout"]["multi_turn"] = {"mcp_servers": [server[0]], "mcp_start_timeout_s": 120}
    assert config_mod.from_dict(base)
    tok = AutoTokenizer.from_pretrained(path)
    tr = RLTrainer(actor_model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer=tok,
                   config=base)
    try:
        assert isinstance(tr.rollout, MultiTurnRolloutOperator)
        text = tok.decode(tr.rollout.renderer.prompt_ids([{"role": "user", "content": "What is 2 + 2?"}]))
        assert "add" in text and "Adds two integers." in text
        assert tr.rollout.executor.call("add", {"a": 20, "b": 22}).content == "42"
    finally:
        tr.rollout.close()
