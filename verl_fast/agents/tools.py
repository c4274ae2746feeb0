"""Tools: plain Python functions the model may call, run in worker processes that cannot hurt the run.

A tool is a function with type hints and a Google-style docstring (``Args:`` names each parameter);
its JSON schema comes from ``transformers.utils.get_json_schema``, as chat templates take tools.
Named in the config as ``module:function`` or ``path/to/file.py:function``
(``rollout.multi_turn.tools``), or passed as ``RLTrainer(tools=[f, ...])``.

``ToolExecutor`` runs calls in a pool of ``workers`` worker processes (``agents/isolation.py``: forked,
so a tool needs no import path of its own; each leads a process group, takes the default SIGTERM, and
dies with the trainer, ``kill -9`` included): at most ``workers`` calls run at once; a call that runs
past ``timeout_s`` has its worker's whole process group killed (the processes the tool started too)
and the worker replaced, and returns a timeout error; a tool that raises returns the error's text; a
worker that dies (a segfault, ``os._exit``) is replaced and the call returns an error; ``close`` kills
every group. A result is made text in the worker (a ``str`` as it is, anything else its ``repr``),
encoded as UTF-8 and cut to ``max_result_bytes`` there, so a 1 GB result never crosses the pipe; the
tool's stdout and stderr are captured per call and cut to ``max_output_bytes`` each. What crosses is
bytes only, decoded with invalid sequences replaced: no object a tool returns is unpickled in the
trainer, and no lone surrogate reaches the tokenizer.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import queue
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from verl_fast.agents.isolation import Capture, Worker, WorkerGone, as_text, next_request

ToolLike = Union[str, Callable[..., Any]]


def load_tool(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names: ``package.module:function`` or ``path/to/file.py:function``."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"a tool must be named as module:function or file.py:function, got {spec!r}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"tool {spec}: no file {path} (relative paths are taken from {Path.cwd()})")
        mod_name = f"verl_fast_tools_{path.stem}_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[mod_name] = module
            loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"tool {spec}: cannot import {where} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"tool {spec}: {where} has no function {name}")
    return fn


def tool_schema(fn: Callable[..., Any]) -> Dict[str, Any]:
    """The function's JSON schema, as chat templates take tools (``{"type": "function", "function": ...}``);
    a tool that carries its own (an MCP server's: ``openai_schema``) gives that."""
    own = getattr(fn, "openai_schema", None)
    if isinstance(own, dict):
        return own
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' own message names the missing hint or docstring line
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: no JSON schema ({e}); a tool needs type hints "
                         "and a Google-style docstring with an Args: line per parameter") from None


def resolve_tools(tools: Sequence[ToolLike]) -> Dict[str, Callable[..., Any]]:
    """Name -> function for ``tools`` (functions or ``module:function`` strings); names must be unique."""
    out: Dict[str, Callable[..., Any]] = {}
    for t in tools:
        fn = load_tool(t) if isinstance(t, str) else t
        if not callable(fn):
            raise TypeError(f"a tool must be a function or a 'module:function' string, got {t!r}")
        name = fn.__name__
        if name in out:
            raise ValueError(f"two tools are named {name!r}; tool names must be unique")
        out[name] = fn
    return out


@dataclass
class ToolResult:
    """What one call gave back: the text the model sees, how it went, and what the tool printed
    (each kept to the executor's ``max_output_bytes``; ``*_bytes``: how much was written)."""

    content: str
    status: str  # "ok", "error" (the tool raised, or the call was malformed), "timeout", "crash"
    seconds: float
    result_bytes: int = 0  # the result's size before the cut
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0


MAX_WORKERS = 256  # tool workers per executor (each a process)
_STATUSES = ("ok", "error")
_HEADER = struct.Struct("<BQQQIII")  # status, bytes written (result, stdout, stderr), bytes kept (the same three)


def _truncate(data: bytes, limit: int) -> bytes:
    if len(data) <= limit:
        return data
    note = f"... [truncated: {len(data)} bytes, limit {limit}]".encode()
    return data[: max(0, limit - len(note))] + note


def _result_bytes(result: Any) -> Tuple[int, bytes]:
    """``(status, UTF-8 bytes)`` of what a tool returned: a str as it is (a subclass's methods are not
    called), anything else its ``repr``."""
    try:
        text = result if isinstance(result, str) else repr(result)
        if not isinstance(text, str):
            raise TypeError(f"its repr is a {type(text).__name__}")
        return 0, str.encode(text, "utf-8", "surrogatepass")
    except Exception as e:  # noqa: BLE001 - a result that cannot be made text is the tool's error
        return 1, f"the tool's result could not be made text ({type(e).__name__})".encode()


def _serve(conn: Any, parent: int, tools: Dict[str, Callable[..., Any]], limit: int, output_limit: int) -> None:
    """A worker's loop: a JSON ``[name, arguments]`` in, a ``_HEADER`` and three byte strings out
    (the result cut to ``limit``, stdout and stderr cut to ``output_limit``)."""
    capture = Capture(output_limit)
    while True:
        request = next_request(conn, parent)
        if request is None:
            return
        capture.take()  # what earlier calls' leftover processes wrote since
        try:
            name, arguments = json.loads(request)
            status, data = _result_bytes(tools[name](**arguments))
        except Exception as e:  # noqa: BLE001 - the model reads the error as the tool's answer
            status, data = 1, f"{type(e).__name__}: {e}".encode("utf-8", "surrogatepass")
        (out, out_n), (err, err_n) = capture.take()
        kept = _truncate(data, limit)
        conn.send_bytes(_HEADER.pack(status, len(data), out_n, err_n, len(kept), len(out), len(err)) + kept + out + err)


def _read_answer(data: bytes, limit: int, output_limit: int) -> Optional[Tuple[str, List[int], List[bytes]]]:
    """``(status, bytes written, byte strings)`` of a worker's answer, or None when it is malformed."""
    if len(data) < _HEADER.size:
        return None
    status, *sizes = _HEADER.unpack_from(data)
    written, kept = sizes[:3], sizes[3:]
    if (status >= len(_STATUSES) or _HEADER.size + sum(kept) != len(data) or kept[0] > limit
            or max(kept[1:]) > output_limit):
        return None
    chunks, at = [], _HEADER.size
    for n in kept:
        chunks.append(data[at: at + n])
        at += n
    return _STATUSES[status], written, chunks


def _check_limits(workers: Any, timeout_s: Any, max_result_bytes: Any, max_output_bytes: Any) -> None:
    def whole(value: Any, low: int, high: Optional[int] = None) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)

    if not whole(workers, 1, MAX_WORKERS):
        raise ValueError(f"ToolExecutor: workers must be an int in [1, {MAX_WORKERS}], got {workers!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s <= 0:
        raise ValueError(f"ToolExecutor: timeout_s must be a finite number of seconds above 0, got {timeout_s!r}")
    if not whole(max_result_bytes, 64):
        raise ValueError(f"ToolExecutor: max_result_bytes must be an int >= 64, got {max_result_bytes!r}")
    if not whole(max_output_bytes, 0):
        raise ValueError(f"ToolExecutor: max_output_bytes must be an int >= 0, got {max_output_bytes!r}")


class ToolExecutor:
    """Runs tool calls in ``workers`` worker processes (see the module docstring); thread-safe:
    ``call`` blocks its thread until a worker is free and the call is done, and never raises."""

    def __init__(self, tools: Dict[str, Callable[..., Any]], workers: int = 4, timeout_s: float = 10.0,
                 max_result_bytes: int = 4096, max_output_bytes: int = 4096):
        _check_limits(workers, timeout_s, max_result_bytes, max_output_bytes)
        self.tools, self.timeout_s = dict(tools), float(timeout_s)
        self.limit, self.output_limit = max_result_bytes, max_output_bytes
        self._idle: "queue.Queue[Worker]" = queue.Queue()
        self._all: List[Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.replaced = 0  # workers killed (timeout) or dead (crash) and started anew
        for _ in range(workers):
            self._add()

    def _add(self) -> None:
        w = Worker(functools.partial(_serve, parent=os.getpid(), tools=self.tools, limit=self.limit,
                                     output_limit=self.output_limit), "verl_fast tool worker")
        with self._lock:
            self._all.append(w)
        self._idle.put(w)

    def _replace(self, w: Worker) -> None:
        w.kill()
        with self._lock:
            if w in self._all:
                self._all.remove(w)
            self.replaced += 1
        if not self._closed:
            self._add()

    def _idle_worker(self) -> Optional[Worker]:
        while not self._closed:
            try:
                return self._idle.get(timeout=0.2)
            except queue.Empty:
                continue
        return None

    def call(self, name: str, arguments: Dict[str, Any]) -> ToolResult:
        """Runs ``name(**arguments)`` in a worker; never raises (a closed executor's call is an error result)."""
        if name not in self.tools:
            return ToolResult(f"unknown tool {name!r}; the tools are {sorted(self.tools)}", "error", 0.0)
        try:
            request = json.dumps([name, arguments]).encode()
        except (TypeError, ValueError) as e:
            return ToolResult(f"the arguments of {name} are not JSON ({e})", "error", 0.0)
        w = self._idle_worker()
        if w is None:
            return ToolResult(f"{name} was not run: the tool executor is closed", "error", 0.0)
        start = time.perf_counter()
        try:
            data = w.request(request, self.timeout_s, _HEADER.size + self.limit + 2 * self.output_limit)
        except WorkerGone as gone:
            self._replace(w)
            return ToolResult(f"{name} crashed (its process exited with code {gone.code})", "crash",
                              time.perf_counter() - start)
        seconds = time.perf_counter() - start
        if data is None:
            self._replace(w)
            return ToolResult(f"{name} timed out after {self.timeout_s:g} s", "timeout", seconds)
        answer = _read_answer(data, self.limit, self.output_limit)
        if answer is None:
            self._replace(w)
            return ToolResult(f"{name} crashed (its process sent a malformed answer)", "crash", seconds)
        self._idle.put(w)
        status, (result_n, out_n, err_n), (result, out, err) = answer
        return ToolResult(as_text(result), status, seconds, result_n, as_text(out), as_text(err), out_n, err_n)

    def close(self) -> None:
        """Kills every worker's process group (idempotent); waits on none."""
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), []
        for w in workers:
            w.kill()

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
