"""MCP tools: the tools of Model Context Protocol servers (``rollout.multi_turn.mcp_servers``), called
like Python tools, through the official ``mcp`` SDK.

A server is a stdio command (``"python server.py"``, or ``{command, args, env, cwd}``) or a streamable
HTTP URL (``"http://host:port/mcp"``, or ``{url}``). At start-up (``mcp_tools``) each server is started
once in the trainer, its tools listed (``tools/list``) and the server closed; a server that cannot
start, or does not answer within ``start_timeout_s``, stops the run in one line naming it. Each tool
becomes an ``McpTool``: a callable with the server's schema (``openai_schema``, what the chat template
lists next to the Python tools' schemas).

The calls run where Python tools run: in the ``ToolExecutor``'s worker processes, under the same
``tool_timeout_s``, result and output limits. Each worker opens its own session to each server on its
first call to it (``_Sessions``: an event loop on a thread of the worker) and keeps it. A stdio server
is started by the worker through a launcher that has the kernel kill it when its worker dies
(``PR_SET_PDEATHSIG``; the SDK starts servers in a session of their own, out of the worker's process
group), so a call that hangs, killed with its worker at the timeout, takes its server with it. A tool
that reports an error (``isError``), a server that dies or closes the connection, or an answer the SDK
cannot read fails the call: the model reads the error, the call counts in ``tool_errors`` (a hang in
``tool_timeouts``), and the worker's next call starts the server again.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

# Run as ``python -S -c _LAUNCH <parent pid> <command> <args...>``: asks the kernel for SIGKILL when the
# process that started it dies, then becomes the server.
_LAUNCH = ("import ctypes, os, signal, sys\n"
           "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"  # 1: PR_SET_PDEATHSIG
           "if os.getppid() != int(sys.argv[1]):\n    os._exit(1)\n"
           "os.execvp(sys.argv[2], sys.argv[2:])\n")
_STDIO_KEYS = {"command", "args", "env", "cwd"}


@dataclass(frozen=True)
class McpServer:
    """One entry of ``rollout.multi_turn.mcp_servers``: a stdio command or an HTTP URL."""

    label: str  # how messages name it: ``rollout.multi_turn.mcp_servers[i] (what it runs)``
    command: Optional[str] = None
    args: Tuple[str, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()
    cwd: Optional[str] = None
    url: Optional[str] = None


def _is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def parse_server(entry: Any, where: str) -> McpServer:
    """The server ``entry`` describes (a command line, a URL, or a mapping), or a ValueError naming ``where``."""
    if isinstance(entry, str):
        if _is_url(entry):
            return McpServer(f"{where} ({entry})", url=entry)
        try:
            words = shlex.split(entry)
        except ValueError as e:
            raise ValueError(f"{where}: cannot split the command {entry!r} ({e})") from None
        entry = {"command": words[0], "args": words[1:]} if words else {}
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a command line, an http(s) URL, or a mapping {{command, args, env, cwd}} "
                         f"or {{url}}, got {type(entry).__name__} {entry!r:.80}")
    if "url" in entry:
        extra = sorted(set(entry) - {"url"})
        if extra or not isinstance(entry["url"], str) or not _is_url(entry["url"]):
            raise ValueError(f"{where}: a URL server is {{url: http(s)://...}} alone, got {entry!r:.120}")
        return McpServer(f"{where} ({entry['url']})", url=entry["url"])
    unknown = sorted(set(entry) - _STDIO_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; a server has command, args, env, cwd (stdio) or url")
    command, args, env, cwd = entry.get("command"), entry.get("args", []), entry.get("env", {}), entry.get("cwd")
    if not isinstance(command, str) or not command:
        raise ValueError(f"{where}: needs a command (the server's program), got {command!r}")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{where}: args must be a list of strings, got {args!r:.80}")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{where}: env must map names to strings, got {env!r:.80}")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError(f"{where}: cwd must be a path, got {cwd!r}")
    if shutil.which(command) is None:
        raise ValueError(f"{where}: command {command!r} is not an executable on PATH")
    shown = " ".join([command, *args])
    return McpServer(f"{where} ({shown:.80})", command=command, args=tuple(args), env=tuple(sorted(env.items())),
                     cwd=cwd)


def parse_servers(entries: Sequence[Any], key: str = "rollout.multi_turn.mcp_servers") -> List[McpServer]:
    return [parse_server(e, f"{key}[{i}]") for i, e in enumerate(entries)]


# ----------------------------------------------------------------------------- sessions


def _transport(server: McpServer, errlog: Any) -> Any:
    """The SDK's transport context for ``server`` (a stdio server started through ``_LAUNCH``)."""
    if server.url is not None:
        from mcp.client.streamable_http import streamable_http_client

        return streamable_http_client(server.url)
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    launch = ["-S", "-c", _LAUNCH, str(os.getpid()), server.command, *server.args]
    params = StdioServerParameters(command=sys.executable, args=launch, env=dict(server.env) or None, cwd=server.cwd)
    return stdio_client(params, errlog=errlog)


class _Session:
    """One open session to a server, held by a task on the sessions' loop (the SDK's contexts are
    entered and left in one task)."""

    def __init__(self, server: McpServer, errlog: Any):
        self.server, self.errlog = server, errlog
        self.closing = asyncio.Event()
        self.ready: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()
        self.task = asyncio.ensure_future(self._hold())

    async def _hold(self) -> None:
        from mcp import ClientSession

        try:
            async with _transport(self.server, self.errlog) as streams:
                async with ClientSession(streams[0], streams[1]) as session:
                    await session.initialize()
                    self.ready.set_result(session)
                    await self.closing.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting call (the server failed to start or died)
            if not self.ready.done():
                self.ready.set_exception(e)

    async def close(self) -> None:
        self.closing.set()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 2.0)
        except BaseException:  # noqa: BLE001 - a server that does not close is killed with its worker at the latest
            self.task.cancel()


class McpCallError(Exception):
    """A call that failed: the tool reported an error, or its server could not be reached."""


def _result_text(result: Any) -> str:
    """A ``CallToolResult`` as the text the model reads: its text blocks, the others named."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", "?")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {getattr(block, 'mime_type', '?')}]")
        elif kind == "resource_link":
            parts.append(f"[resource: {block.uri}]")
        else:
            parts.append(f"[{kind}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


class _Sessions:
    """This process's sessions, one per server, opened on first use, on an event loop thread of their own."""

    _mine: Optional["_Sessions"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.open: Dict[McpServer, _Session] = {}
        threading.Thread(target=self.loop.run_forever, daemon=True, name="verl_fast mcp").start()

    @classmethod
    def get(cls) -> "_Sessions":
        with cls._lock:
            if cls._mine is None or cls._mine.pid != os.getpid():  # a fork's own (never its parent's loop)
                cls._mine = cls()
            return cls._mine

    async def _call(self, server: McpServer, name: str, arguments: Dict[str, Any]) -> str:
        session = self.open.get(server)
        if session is None:
            session = self.open[server] = _Session(server, sys.stderr)
        try:
            client = await asyncio.shield(session.ready)
            result = await client.call_tool(name, arguments)
        except Exception as e:  # noqa: BLE001 - the server died, hung up or sent what cannot be read
            self.open.pop(server, None)
            await session.close()
            raise McpCallError(f"MCP server {server.label} failed: {type(e).__name__}: {e}") from None
        text = _result_text(result)
        if result.is_error:
            raise McpCallError(text)
        return text

    def call(self, server: McpServer, name: str, arguments: Dict[str, Any]) -> str:
        return asyncio.run_coroutine_threadsafe(self._call(server, name, arguments), self.loop).result()


class McpTool:
    """A tool of an MCP server, called like a Python tool (``tool(**arguments)`` returns its text, or
    raises ``McpCallError``); ``openai_schema`` is what the chat template lists."""

    def __init__(self, server: McpServer, name: str, openai_schema: Dict[str, Any]):
        self.server, self.__name__, self.openai_schema = server, name, openai_schema

    def __call__(self, **arguments: Any) -> str:
        return _Sessions.get().call(self.server, self.__name__, arguments)

    def __repr__(self) -> str:
        return f"McpTool({self.__name__!r} of {self.server.label})"


# ----------------------------------------------------------------------------- start-up


async def _list(server: McpServer, timeout_s: float, errlog: Any) -> List[Any]:
    from mcp import ClientSession

    async def go() -> List[Any]:
        async with _transport(server, errlog) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                return list((await session.list_tools()).tools)

    return await asyncio.wait_for(go(), timeout_s)


def _last_line(errlog: Any) -> str:
    errlog.seek(0)
    lines = [line.strip() for line in errlog.read().decode("utf-8", "replace").splitlines() if line.strip()]
    return f"; its stderr ends: {lines[-1][:200]}" if lines else ""


def list_tools(server: McpServer, timeout_s: float) -> List[McpTool]:
    """``server``'s tools, listed in a session of its own (started and closed here, on a thread of its
    own); a server that cannot start or answer is a ValueError naming it."""
    box: Dict[str, Any] = {}

    def run() -> None:
        with tempfile.TemporaryFile() as errlog:
            try:
                box["tools"] = asyncio.run(_list(server, timeout_s, errlog))
            except asyncio.TimeoutError:
                box["error"] = f"did not answer within rollout.multi_turn.mcp_start_timeout_s={timeout_s:g}"
            except BaseException as e:  # noqa: BLE001 - reported in one line below
                box["error"] = f"could not start: {type(e).__name__}: {e}"
            if "error" in box:
                box["error"] += _last_line(errlog)

    thread = threading.Thread(target=run, name="verl_fast mcp start")
    thread.start()
    thread.join()
    if "error" in box:
        raise ValueError(f"{server.label}: the MCP server {' '.join(box['error'].split())[:500]}")
    out = []
    for tool in box["tools"]:
        function = {"name": tool.name, "description": tool.description or "",
                    "parameters": tool.input_schema or {"type": "object", "properties": {}}}
        out.append(McpTool(server, tool.name, {"type": "function", "function": function}))
    return out


def mcp_tools(entries: Sequence[Any], start_timeout_s: float) -> List[McpTool]:
    """The tools of every server ``entries`` lists (``rollout.multi_turn.mcp_servers``); two servers'
    tools of one name are refused, naming both."""
    out: List[McpTool] = []
    owner: Dict[str, McpServer] = {}
    for server in parse_servers(entries):
        for tool in list_tools(server, start_timeout_s):
            if tool.__name__ in owner:
                raise ValueError(f"{server.label} and {owner[tool.__name__].label} both have a tool named "
                                 f"{tool.__name__!r}; tool names must be unique")
            owner[tool.__name__] = server
            out.append(tool)
    return out
