"""The HTTP server behind the metrics endpoint: a bounded pool of threads, idle connections closed.

prometheus_client's own server starts a thread for every connection, and a connection that sends
nothing holds its thread for as long as it stays open (500 idle connections: 506 threads). Here one
thread accepts connections and watches every open one in a single selector; a connection goes to one
of ``workers`` threads only once its request has arrived, and is closed after answering (wsgiref
serves one request per connection). A connection idle for ``idle_s`` is closed, and beyond
``max_open`` open connections the one idle the longest is. A request must arrive whole within
``request_timeout_s`` once it has begun, so a slow sender holds a worker that long at most.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Tuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        """No line per scrape on the console (the progress bar's)."""


class PooledWSGIServer(WSGIServer):
    """wsgiref's WSGI server on a bounded pool of threads (see the module docstring)."""

    def __init__(self, address: Tuple[str, int], workers: int = 4, max_open: int = 64, idle_s: float = 10.0,
                 request_timeout_s: float = 5.0):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _QuietHandler)
        self.max_open, self.idle_s, self.request_timeout_s = max_open, idle_s, request_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="metrics-http")
        self._open: "OrderedDict[socket.socket, Tuple[object, float]]" = OrderedDict()  # idle first
        self._stop, self._stopped = threading.Event(), threading.Event()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.socket, selectors.EVENT_READ)
            try:
                while not self._stop.is_set():
                    for key, _ in sel.select(min(poll_interval, self.idle_s)):
                        if key.fileobj is self.socket:
                            self._accept(sel)
                        else:  # its request has arrived: a worker answers it
                            sel.unregister(key.fileobj)
                            address, _ = self._open.pop(key.fileobj)
                            self._pool.submit(self._answer, key.fileobj, address)
                    self._close_idle(sel, time.monotonic() - self.idle_s)
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
        self._open[conn] = (address, time.monotonic())
        sel.register(conn, selectors.EVENT_READ)

    def _close_idle(self, sel: selectors.BaseSelector, opened_before: float) -> None:
        while self._open:
            conn, (_, since) = next(iter(self._open.items()))
            if since > opened_before:
                return
            self._drop(sel, conn)

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        sel.unregister(conn)
        self._open.pop(conn, None)
        self.shutdown_request(conn)

    def _answer(self, conn: socket.socket, address) -> None:
        conn.settimeout(self.request_timeout_s)
        try:
            self.finish_request(conn, address)
        except OSError:  # the client went away or stalled: nothing to answer
            pass
        finally:
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
