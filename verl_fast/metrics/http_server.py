"""The HTTP server behind the metrics endpoint: a bounded pool of threads, idle connections closed.

prometheus_client's own server starts a thread for every connection, and a connection that sends
nothing holds its thread for as long as it stays open (500 idle connections: 506 threads). Here one
thread accepts connections and watches every open one in a single selector, reading what they send
without blocking; a connection goes to one of ``workers`` threads only once its request's head (up to
the blank line, at most ``MAX_HEAD`` bytes) has arrived whole, and is closed after answering (wsgiref
serves one request per connection; a scrape has no body). A connection idle for ``idle_s`` is closed,
beyond ``max_open`` open connections the one idle the longest is, and a request not whole within
``request_timeout_s`` of its first byte is closed (a deadline for the whole request, not per read: a
client sending a byte a second never holds a worker, nor its connection past the deadline). The
answer is written under the same limit.
"""

from __future__ import annotations

import io
import selectors
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Tuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer


MAX_HEAD = 16 << 10  # a request line and headers beyond this are refused (the connection closed)


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's handler reading the request from the head the acceptor already received."""

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BytesIO(self.server.heads.pop(self.connection, b""))

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        """No line per scrape on the console (the progress bar's)."""


class _Pending:
    """An open connection: its address, when it opened (or last became idle), what it sent so far
    and when its first byte came."""

    __slots__ = ("address", "since", "head", "began")

    def __init__(self, address: object, since: float) -> None:
        self.address, self.since, self.head, self.began = address, since, bytearray(), None  # type: Optional[float]


class PooledWSGIServer(WSGIServer):
    """wsgiref's WSGI server on a bounded pool of threads (see the module docstring)."""

    def __init__(self, address: Tuple[str, int], workers: int = 4, max_open: int = 64, idle_s: float = 10.0,
                 request_timeout_s: float = 5.0):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _QuietHandler)
        self.max_open, self.idle_s, self.request_timeout_s = max_open, idle_s, request_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="metrics-http")
        self._open: "OrderedDict[socket.socket, _Pending]" = OrderedDict()  # idle the longest first
        self.heads: Dict[socket.socket, bytes] = {}  # complete request heads, for the workers' handlers
        self._stop, self._stopped = threading.Event(), threading.Event()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.socket, selectors.EVENT_READ)
            try:
                while not self._stop.is_set():
                    for key, _ in sel.select(min(poll_interval, self.idle_s, self.request_timeout_s)):
                        if key.fileobj is self.socket:
                            self._accept(sel)
                        else:
                            self._receive(sel, key.fileobj)
                    now = time.monotonic()
                    self._close_idle(sel, now - self.idle_s)
                    self._close_late(sel, now - self.request_timeout_s)
            finally:
                for conn in list(self._open):
                    self._drop(sel, conn)
                self._stopped.set()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn, address = self.socket.accept()
        except OSError:
            return
        if len(self._open) >= self.max_open:
            self._drop(sel, next(iter(self._open)))  # the one idle the longest
        conn.setblocking(False)
        self._open[conn] = _Pending(address, time.monotonic())
        sel.register(conn, selectors.EVENT_READ)

    def _receive(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        """What ``conn`` sent; a whole head goes to a worker, a closed or oversized one is dropped."""
        pending = self._open[conn]
        try:
            data = conn.recv(MAX_HEAD + 1 - len(pending.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # closed by the client
            self._drop(sel, conn)
            return
        pending.began = pending.began or time.monotonic()
        pending.head += data
        end = pending.head.find(b"\r\n\r\n")
        if end < 0 and len(pending.head) > MAX_HEAD:
            self._drop(sel, conn)
        elif end >= 0:  # its request has arrived: a worker answers it
            sel.unregister(conn)
            del self._open[conn]
            self.heads[conn] = bytes(pending.head[:end + 4])
            self._pool.submit(self._answer, conn, pending.address, pending.began)

    def _close_idle(self, sel: selectors.BaseSelector, opened_before: float) -> None:
        while self._open:
            conn, pending = next(iter(self._open.items()))
            if pending.since > opened_before:
                return
            self._drop(sel, conn)

    def _close_late(self, sel: selectors.BaseSelector, began_before: float) -> None:
        """Requests begun before ``began_before`` and still not whole are closed."""
        for conn in [c for c, p in self._open.items() if p.began is not None and p.began <= began_before]:
            self._drop(sel, conn)

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        sel.unregister(conn)
        self._open.pop(conn, None)
        self.shutdown_request(conn)

    def _answer(self, conn: socket.socket, address, began: float) -> None:
        conn.setblocking(True)
        # what is left of the request's deadline (a floor of 0.1 s to write a scrape's answer)
        conn.settimeout(max(0.1, began + self.request_timeout_s - time.monotonic()))
        try:
            self.finish_request(conn, address)
        except OSError:  # the client went away or stalled: nothing to answer
            pass
        finally:
            self.heads.pop(conn, None)
            self.shutdown_request(conn)

    def shutdown(self) -> None:
        self._stop.set()
        self._stopped.wait(timeout=10)  # the loop notices within one poll interval
        self._pool.shutdown(wait=False)


def serve(app: Callable, host: str, port: int, **limits) -> Tuple[PooledWSGIServer, threading.Thread]:
    """Serves the WSGI ``app`` on ``host:port`` (0: any free port) from a daemon thread."""
    server = PooledWSGIServer((host, port), **limits)
    server.set_app(app)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
