"""Environments under a time limit, in the trainer's process or in a worker process of their own.

``GuardedEnvironment`` wraps one trajectory's environment (``rollout.multi_turn.environment``):

- ``reset`` and ``step`` run on a daemon thread (``isolation: thread``, the default; threads reused) or in a worker
  process (``isolation: process``: ``agents/isolation.py``, a fork per trajectory that builds the
  environment there, killed with its process group when the trajectory ends), and are waited on for
  ``timeout_s`` at most. A ``step`` that does not return in time ends its trajectory (counted in
  ``env_timeouts``); the thread left running is a daemon and never holds the trainer's exit, the
  worker is killed. A ``reset`` that does not return in time stops the run, naming the environment.
- what they return is checked (``checked_reset`` / ``checked_step``): a wrong type is one line
  naming the environment, the method and what was wrong. From a worker, what crosses is JSON
  bytes (``MAX_ANSWER_BYTES`` at most), never a pickled object.
- an environment whose worker dies ends its trajectory (``env_crashes``).
- at the trajectory's end, ``close`` kills the worker, or calls the environment's own ``close`` where it
  has one (an OpenEnv session, a verifiers rollout the limits cut short).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional

from verl_fast.agents.environments import Environment, Message, StepResult, checked_reset, checked_step
from verl_fast.agents.isolation import Worker, WorkerGone, as_text, next_request
from verl_fast.data import PromptRow

ISOLATIONS = ("thread", "process")
MAX_ANSWER_BYTES = 16 << 20  # an answer from an environment's worker
logger = logging.getLogger(__name__)


class EnvironmentTimeout(RuntimeError):
    """A reset that did not return within the limit (the message names the environment)."""


class _DaemonThreads:
    """Daemon threads kept from call to call: a call starts a thread only when none is idle. A thread
    stuck in a call past its time stays a daemon, never waited for, and is simply not reused; a thread
    idle for ``idle_s`` ends. ``_idle`` counts the threads waiting for a task that no call has been
    promised yet (a call that finds one takes it, under the lock)."""

    def __init__(self, idle_s: float = 60.0) -> None:
        self.idle_s = idle_s
        self._reset()

    def _reset(self) -> None:
        self._tasks: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
        future: "Future[Any]" = Future()
        with self._lock:
            spawn = self._idle == 0
            self._idle -= 0 if spawn else 1  # an idle thread is promised to this call
        self._tasks.put((future, fn, args))
        if spawn:
            threading.Thread(target=self._work, daemon=True, name="verl_fast environment").start()
        return future

    def _work(self) -> None:
        while True:
            try:
                future, fn, args = self._tasks.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # more idle threads than calls promised them: this one ends
                        self._idle -= 1
                        return
                continue  # promised to a call whose task is on its way
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which raises it
                result, error = None, e
            with self._lock:  # idle before the caller hears back, so that its next call finds this thread
                self._idle += 1
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


_THREADS = _DaemonThreads()
os.register_at_fork(after_in_child=lambda: _THREADS._reset())  # a forked child has none of the parent's threads


def _serve(conn: Any, parent: int, make: Callable[[], Environment], name: str) -> None:
    """An environment's worker: builds it, then answers pickled ``(method, argument)`` requests from
    the trainer with JSON ``{"value": ...}`` or ``{"error": one line}``."""
    env = make()
    while True:
        request = next_request(conn, parent)
        if request is None:
            return
        method, arg = pickle.loads(request)  # from the trainer: its own objects
        try:
            if method == "reset":
                value: Any = checked_reset(env.reset(arg), name)
            elif method == "step":
                r = checked_step(env.step(arg), name)
                value = {"messages": r.messages, "reward": r.reward, "done": r.done}
            else:
                value = {str(k): float(v) for k, v in env.metrics().items()}
            answer = {"value": value}
        except ValueError as e:  # a wrong return type: the one line the trainer raises
            answer = {"error": str(e)}
        conn.send_bytes(json.dumps(answer, default=str).encode("utf-8", "surrogatepass"))


class GuardedEnvironment(Environment):
    """One trajectory's environment, built by ``make`` and named ``name`` (see the module docstring)."""

    def __init__(self, make: Callable[[], Environment], name: str, timeout_s: float, isolation: str = "thread"):
        if isolation not in ISOLATIONS:
            raise ValueError(f"environment isolation must be one of {list(ISOLATIONS)}, got {isolation!r}")
        self.name, self.timeout_s = name, timeout_s
        self.counts = {"env_timeouts": 0.0, "env_crashes": 0.0}
        self._env: Optional[Environment] = None
        self._worker: Optional[Worker] = None
        if isolation == "process":
            parent = os.getpid()
            self._worker = Worker(lambda conn: _serve(conn, parent, make, name), "verl_fast environment")
        else:
            self._env = make()
        self._broken = False  # timed out or crashed: no further calls

    # ------------------------------------------------------------------ the calls

    def _in_thread(self, method: str, arg: Any) -> Any:
        fn = getattr(self._env, method)
        future = _THREADS.submit(fn, *(() if arg is None else (arg,)))
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            return _TIMEOUT

    def _in_worker(self, method: str, arg: Any) -> Any:
        try:
            data = self._worker.request(pickle.dumps((method, arg)), self.timeout_s, MAX_ANSWER_BYTES)
        except WorkerGone as gone:
            return _Crash(f"its process exited with code {gone.code}")
        if data is None:
            self._worker.kill()
            return _TIMEOUT
        try:
            answer = json.loads(as_text(data))
        except (ValueError, RecursionError):
            answer = None
        if not isinstance(answer, dict) or not ("value" in answer or isinstance(answer.get("error"), str)):
            self._worker.kill()
            return _Crash("its process sent an answer that cannot be read")
        if "error" in answer:
            raise ValueError(answer["error"])
        value = answer["value"]
        if method == "step":  # checked again here: the worker's answer is data from outside
            value = StepResult(value.get("messages"), value.get("reward"), value.get("done")) \
                if isinstance(value, dict) else value
        return value

    def _call(self, method: str, arg: Any = None) -> Any:
        return self._in_worker(method, arg) if self._worker is not None else self._in_thread(method, arg)

    # ------------------------------------------------------------------ Environment

    def reset(self, row: PromptRow) -> List[Message]:
        value = self._call("reset", row)
        if value is _TIMEOUT:
            raise EnvironmentTimeout(f"environment {self.name}: reset did not return within {self.timeout_s:g} s "
                                     "(rollout.multi_turn.env_timeout_s)")
        if isinstance(value, _Crash):
            raise EnvironmentTimeout(f"environment {self.name}: reset failed: {value.why}")
        return checked_reset(value, self.name)

    def step(self, message: Message) -> StepResult:
        if self._broken:
            return StepResult(done=True)
        value = self._call("step", message)
        if value is _TIMEOUT or isinstance(value, _Crash):
            self._broken = True
            self.counts["env_timeouts" if value is _TIMEOUT else "env_crashes"] += 1
            return StepResult(done=True)
        return checked_step(value, self.name)

    def metrics(self) -> Dict[str, float]:
        out = dict(self.counts)
        if not self._broken:
            value = self._call("metrics")
            if isinstance(value, dict):
                out.update({k: float(v) for k, v in value.items() if isinstance(v, (int, float))})
        return out

    def close(self) -> None:
        """Kills the environment's worker, if it has one, else calls the environment's own ``close``
        where it has one (under the time limit; not after a call timed out, which may still run)."""
        if self._worker is not None:
            self._worker.kill()
        elif not self._broken and callable(getattr(self._env, "close", None)):
            try:
                self._in_thread("close", None)
            except Exception as e:  # the trajectory is complete: its environment's clean-up failing is reported
                logger.warning("environment %s: close failed: %s: %s", self.name, type(e).__name__, e)


class _Crash:
    def __init__(self, why: str):
        self.why = why


_TIMEOUT = object()

