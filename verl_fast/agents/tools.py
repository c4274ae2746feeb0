"""Tools: plain Python functions the model may call, run in worker processes that cannot hurt the run.

A tool is a function with type hints and a Google-style docstring (``Args:`` names each parameter);
its JSON schema comes from ``transformers.utils.get_json_schema``, as chat templates take tools.
Named in the config as ``module:function`` or ``path/to/file.py:function``
(``rollout.multi_turn.tools``), or passed as ``RLTrainer(tools=[f, ...])``.

``ToolExecutor`` runs calls in a pool of ``workers`` processes (forked, so a tool needs no import
path of its own): at most ``workers`` calls run at once; a call that runs past ``timeout_s`` has its
worker killed and replaced and returns a timeout error; a tool that raises returns the error's text;
a worker that dies (a segfault, ``os._exit``) is replaced and the call returns an error; a result is
made a string and cut to ``max_result_bytes`` inside the worker, so a 1 GB result never crosses the
pipe. Nothing a tool does reaches the trainer's process except that string.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Union

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
    """The function's JSON schema, as chat templates take tools (``{"type": "function", "function": ...}``)."""
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
    """What one call gave back: the text the model sees, and how it went."""

    content: str
    status: str  # "ok", "error" (the tool raised, or the call was malformed), "timeout", "crash"
    seconds: float


def _truncate(text: str, limit: int) -> str:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    note = f"... [truncated: {len(data)} bytes, limit {limit}]"
    return data[: max(0, limit - len(note))].decode("utf-8", errors="ignore") + note


def _worker(conn: Any, parent_end: Any, parent: int, tools: Dict[str, Callable[..., Any]], limit: int) -> None:
    """A worker's loop: ``(name, arguments)`` in, ``(status, text)`` out, until the pipe closes or the
    trainer's process is gone."""
    parent_end.close()  # the fork's copy of the trainer's end: else the pipe never reports the trainer gone
    while True:
        try:
            while not conn.poll(1.0):
                if os.getppid() != parent:  # the trainer died (killed): nobody will ask again
                    return
            name, arguments = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = tools[name](**arguments)
            status, text = "ok", result if isinstance(result, str) else repr(result)
        except Exception as e:  # noqa: BLE001 - the model reads the error as the tool's answer
            status, text = "error", f"{type(e).__name__}: {e}"
        conn.send((status, _truncate(text, limit)))


class _Worker:
    def __init__(self, ctx: Any, tools: Dict[str, Callable[..., Any]], limit: int):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, self.conn, os.getpid(), tools, limit), daemon=True,
                                   name="verl_fast tool worker")
        self.process.start()
        child.close()

    def stop(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class ToolExecutor:
    """Runs tool calls in ``workers`` forked processes (see the module docstring); thread-safe:
    ``call`` blocks its thread until a worker is free and the call is done."""

    def __init__(self, tools: Dict[str, Callable[..., Any]], workers: int = 4, timeout_s: float = 10.0,
                 max_result_bytes: int = 4096):
        if workers < 1 or timeout_s <= 0 or max_result_bytes < 64:
            raise ValueError(f"ToolExecutor needs workers >= 1, timeout_s > 0 and max_result_bytes >= 64, got "
                             f"{workers}, {timeout_s}, {max_result_bytes}")
        self.tools, self.timeout_s, self.limit = dict(tools), float(timeout_s), int(max_result_bytes)
        self._ctx = multiprocessing.get_context("fork")
        self._idle: "queue.Queue[_Worker]" = queue.Queue()
        self._all: List[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(workers):
            self._add()
        self.replaced = 0  # workers killed (timeout) or dead (crash) and started anew

    def _add(self) -> None:
        w = _Worker(self._ctx, self.tools, self.limit)
        with self._lock:
            self._all.append(w)
        self._idle.put(w)

    def _replace(self, w: _Worker) -> None:
        w.stop()
        with self._lock:
            self._all.remove(w)
            self.replaced += 1
        if not self._closed:
            self._add()

    def call(self, name: str, arguments: Dict[str, Any]) -> ToolResult:
        """Runs ``name(**arguments)`` in a worker; never raises for what the tool does."""
        if self._closed:
            raise RuntimeError("the ToolExecutor is closed")
        if name not in self.tools:
            return ToolResult(f"unknown tool {name!r}; the tools are {sorted(self.tools)}", "error", 0.0)
        w = self._idle.get()
        start = time.perf_counter()
        try:
            w.conn.send((name, arguments))
            if not w.conn.poll(self.timeout_s):
                self._replace(w)
                return ToolResult(f"{name} timed out after {self.timeout_s:g} s", "timeout", time.perf_counter() - start)
            status, text = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(timeout=5)  # it died: its exit code, for the message
            code = w.process.exitcode
            self._replace(w)
            return ToolResult(f"{name} crashed (its process exited with code {code})", "crash",
                              time.perf_counter() - start)
        self._idle.put(w)
        return ToolResult(text, status, time.perf_counter() - start)

    def close(self) -> None:
        """Stops every worker (idempotent)."""
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), []
        for w in workers:
            w.stop()

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
