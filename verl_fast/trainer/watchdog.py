"""The phase watchdog (``guardrails.watchdog``): a daemon thread that watches the step's phases
(generation, reward, the updates, the weight sync, the checkpoint) and, when one runs past its expected
time, prints which phase, which rank and the Python stack of the thread running it, once per phase run.
A hung collective or a stuck reward otherwise prints nothing.

A phase's expected time is ``factor`` times its longest earlier run, at least ``min_s``; ``first_s`` at
its first run (compiles and loads happen there). With ``action="stop"`` the watchdog then sends the
process SIGTERM (the trainer finishes the step, checkpoints and exits, as on Ctrl-C) and, if the phase
has still not returned after as long again, exits with status 124 without writing anything: the last
complete checkpoint stays intact (checkpoints are renamed into place; a partial one is cleared at resume).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, TextIO

EXIT_STATUS = 124  # what timeout(1) exits with


@dataclass
class _Open:
    name: str
    thread: int
    start: float
    limit: float
    reported: float = 0.0  # when the overrun was printed (0: not yet)


class Watchdog:
    """``with watchdog.phase("generation"): ...`` inside ``with watchdog:`` (the thread runs there)."""

    def __init__(self, action: str, factor: float, min_s: float, first_s: float, rank: int = 0,
                 poll_s: float = 1.0, out: Optional[TextIO] = None,
                 stop: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM),
                 exit: Callable[[int], None] = os._exit):
        if action not in ("off", "warn", "stop"):
            raise ValueError(f"guardrails.watchdog must be off, warn or stop, got {action!r}")
        self.action, self.factor, self.min_s, self.first_s, self.rank = action, factor, min_s, first_s, rank
        self.poll_s, self._out, self._stop, self._exit = poll_s, out, stop, exit
        self._longest: Dict[str, float] = {}
        self._open: Dict[int, _Open] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._next = 0

    def expected(self, name: str) -> float:
        longest = self._longest.get(name)
        return self.first_s if longest is None else max(self.min_s, self.factor * longest)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.action == "off":
            yield
            return
        start = time.monotonic()
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._open[key] = _Open(name, threading.get_ident(), start, self.expected(name))
        try:
            yield
        finally:
            with self._lock:
                self._open.pop(key, None)
                self._longest[name] = max(self._longest.get(name, 0.0), time.monotonic() - start)

    def __enter__(self) -> "Watchdog":
        if self.action != "off":
            self._done.clear()
            self._thread = threading.Thread(target=self._watch, name="verl_fast watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Reports each open phase past its limit (once), and under ``stop`` ends the run."""
        with self._lock:
            late = [p for p in self._open.values() if now - p.start > p.limit]
        for p in late:
            if not p.reported:
                p.reported = now
                self._report(p, now)
                if self.action == "stop":
                    self._stop()
            elif self.action == "stop" and now - p.reported > p.limit:
                self._print(f"verl-fast watchdog: phase {p.name} on rank {self.rank} still running {now - p.start:.0f} s "
                            f"after the stop request; exiting {EXIT_STATUS} (the last complete checkpoint is intact)")
                self._exit(EXIT_STATUS)

    def _report(self, p: _Open, now: float) -> None:
        frame = sys._current_frames().get(p.thread)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (the thread has ended)\n"
        then = ("; stopping the run (SIGTERM: the step finishes and checkpoints)" if self.action == "stop" else
                "; guardrails.watchdog=stop would end the run")
        self._print(f"verl-fast watchdog: phase {p.name} on rank {self.rank} has run {now - p.start:.0f} s, past its "
                    f"expected {p.limit:.0f} s{then}; its Python stack:\n{stack.rstrip()}")

    def _print(self, text: str) -> None:
        out = self._out or sys.stderr
        print(text, file=out, flush=True)
