"""Worker processes that always end: what tools (and environments run with ``isolation: process``) run in.

A worker is a fork of the trainer (so a tool or environment class needs no import path of its own) that

- starts a session of its own (``setsid``): it leads a process group that holds every process it
  starts (unless one starts a session of its own), and ``kill`` sends SIGKILL to the whole group;
- takes the default disposition of SIGTERM and SIGINT (a signal ends it, whatever handler the
  trainer had installed when it forked), reads its stdin from ``/dev/null``, and writes its stdout
  and stderr into pipes of its own (``Capture``), so a tool's prints never reach the trainer's log;
- dies with the trainer: the process's ``Guardian`` (one small process per trainer, in a session
  of its own, started on first use) holds the list of worker groups and kills them all when the
  trainer's process is gone (``kill -9`` included) or asks it to;
- answers each request with bytes only (``request``), read with a length limit: nothing a worker
  sends is unpickled in the trainer.

Killing never waits on a worker for long: a killed worker is reaped within ``REAP_S`` or left to
the system.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, Pipe
from typing import Any, Callable, List, Optional, Tuple

REAP_S = 1.0  # how long kill() waits for a killed worker to be reaped

# The guardian's program (run with ``python -I -S``): ``+pgid`` / ``-pgid`` lines on stdin register and
# drop a group; when the trainer (argv[1]) is gone, or stdin ends, it kills every registered group.
_GUARDIAN = r"""
import os, select, signal, sys
parent, groups, pending = int(sys.argv[1]), set(), b""
def end():
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)
while True:
    if os.getppid() != parent:
        end()
    if select.select([0], [], [], 0.1)[0]:
        data = os.read(0, 4096)
        if not data:
            end()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            (groups.add if line[:1] == b"+" else groups.discard)(int(line[1:]))
"""


class Guardian:
    """The trainer's watchdog process (see the module docstring); ``Guardian.get()`` is this process's."""

    _mine: Optional["Guardian"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARDIAN, str(os.getpid())],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        self.pid = os.getpid()
        self.fd = self.process.stdin.fileno()
        self._write = threading.Lock()

    @classmethod
    def get(cls) -> "Guardian":
        with cls._lock:
            if cls._mine is None or cls._mine.pid != os.getpid() or cls._mine.process.poll() is not None:
                cls._mine = cls()
            return cls._mine

    def _send(self, line: str) -> None:
        with self._write:
            try:
                os.write(self.fd, line.encode())
            except OSError:  # the guardian is gone: the workers' own checks of the trainer remain
                pass

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")


class WorkerGone(Exception):
    """The worker died (or sent what cannot be read); ``code`` is its exit status where known."""

    def __init__(self, code: Optional[int]):
        super().__init__(f"exit code {code}")
        self.code = code


class Worker:
    """One worker process running ``serve(conn)`` (see the module docstring)."""

    def __init__(self, serve: Callable[[Connection], None], name: str):
        self.name = name
        guardian = Guardian.get()
        self.conn, child = Pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            code = 0
            try:
                self.conn.close()
                os.close(guardian.fd)
                _become_worker(name)
                serve(child)
            except BaseException:  # noqa: BLE001 - a worker ends with a status, never back in the trainer's code
                code = 1
                traceback.print_exc()  # the user's code failed here: its traceback, on the worker's stderr
            finally:
                os._exit(code)
        child.close()
        self.pid, self.code, self._guardian = pid, None, guardian
        guardian.watch(pid)

    def request(self, payload: bytes, timeout_s: float, max_bytes: int) -> Optional[bytes]:
        """Sends ``payload`` and returns the answer's bytes (None: none within ``timeout_s``); raises
        ``WorkerGone`` when the worker died or answered more than ``max_bytes``."""
        try:
            self.conn.send_bytes(payload)
            if not self.conn.poll(timeout_s):
                return None
            return self.conn.recv_bytes(max_bytes)
        except (EOFError, OSError):
            self.kill()
            raise WorkerGone(self.code) from None

    def kill(self) -> None:
        """SIGKILL to the worker's whole process group; reaps the worker (waiting ``REAP_S`` at most). Idempotent."""
        if self.code is not None or self.conn.closed:
            return
        for kill, target in ((os.killpg, self.pid), (os.kill, self.pid)):  # the group; the worker, if not yet its leader
            try:
                kill(target, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + REAP_S
        while time.monotonic() < deadline:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.005)
        self._guardian.forget(self.pid)
        self.conn.close()


def _become_worker(name: str) -> None:
    """In the fresh fork: a session of its own, default signals, no stdin."""
    os.setsid()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    try:
        signal.set_wakeup_fd(-1)  # the trainer's event loop's, if it had one
    except ValueError:
        pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    threading.current_thread().name = name


def next_request(conn: Connection, parent: int) -> Optional[bytes]:
    """The worker's next request, or None when the trainer is gone (its pipe closed, or it died)."""
    try:
        while not conn.poll(0.5):
            if os.getppid() != parent:
                return None
        return conn.recv_bytes()
    except (EOFError, OSError):
        return None


class Capture:
    """A worker's stdout and stderr (file descriptors 1 and 2, so its child processes' too), drained
    by a thread: per call, the first ``limit`` bytes of each are kept and every byte is counted."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._fds: List[int] = []
        for target in (1, 2):
            read, write = os.pipe()
            os.dup2(write, target)
            os.close(write)
            os.set_blocking(read, False)
            self._fds.append(read)
        sys.stdout = open(1, "w", closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
        self._kept = [bytearray(), bytearray()]
        self._total = [0, 0]
        threading.Thread(target=self._drain, daemon=True).start()

    def _read(self, i: int) -> None:
        for _ in range(64):  # a bounded sweep: a process that writes for ever cannot hold it
            try:
                data = os.read(self._fds[i], 65536)
            except BlockingIOError:
                return
            if not data:
                return
            self._total[i] += len(data)
            room = self.limit - len(self._kept[i])
            if room > 0:
                self._kept[i] += data[:room]

    def _drain(self) -> None:
        while True:
            ready = select.select(self._fds, [], [])[0]
            with self._lock:
                for fd in ready:
                    self._read(self._fds.index(fd))

    def take(self) -> Tuple[Tuple[bytes, int], Tuple[bytes, int]]:
        """``((stdout kept, stdout bytes written), (stderr kept, stderr bytes written))`` since the last take."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a tool may have replaced or closed them
                pass
        with self._lock:
            out = []
            for i in range(2):
                self._read(i)
                out.append((bytes(self._kept[i]), self._total[i]))
                self._kept[i], self._total[i] = bytearray(), 0
        return out[0], out[1]


def as_text(data: Any) -> str:
    """UTF-8 ``data`` (bytes from a worker) as text, invalid sequences (lone surrogates among them)
    replaced: what reaches a tokenizer is always valid."""
    if isinstance(data, str):
        data = str.encode(data, "utf-8", "surrogatepass")
    return bytes(data).decode("utf-8", errors="replace")
