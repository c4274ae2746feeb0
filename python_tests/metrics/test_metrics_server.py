"""The metrics endpoint under idle connections: it serves from a bounded pool of threads (100 idle
connections used to start 100 threads), still answers a scrape while they are open, and closes the
ones that stay idle."""

import contextlib
import socket
import threading
import time
import urllib.request

from verl_fast.metrics.logger import MetricsServer


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@contextlib.contextmanager
def serving(idle: int = 0, **limits):
    """A metrics server and ``idle`` connections to it that send nothing; all closed at the end."""
    server = MetricsServer(0, **limits)
    sockets = []
    try:
        sockets.extend(socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(idle))
        yield server, sockets
    finally:
        for s in sockets:
            s.close()
        server.close()


def test_a_hundred_idle_connections_do_not_take_a_hundred_threads():
    before = threading.active_count()
    with serving(idle=100) as (server, _):
        server.observe({"reward/mean": 0.5})
        time.sleep(0.5)
        assert "verl_reward_mean 0.5" in scrape(server.port)  # answered while they are open
        assert threading.active_count() - before <= 1 + 4, threading.enumerate()  # the acceptor + the pool


def test_idle_connections_are_closed():
    with serving(idle=20, idle_s=0.3, max_open=8) as (server, idle):  # beyond max_open: the oldest closed at once
        time.sleep(1.0)  # beyond idle_s: the rest closed too
        for s in idle:
            s.settimeout(5)
            assert s.recv(1) == b""  # the server closed it
        assert "verl_reward_mean" in scrape(server.port)


def test_a_stalled_request_holds_a_worker_only_briefly():
    with serving(idle=1, workers=1, request_timeout_s=0.5) as (server, (stalled,)):
        stalled.sendall(b"GET /metr")  # a request begun and never finished: on the only worker
        time.sleep(0.2)
        start = time.monotonic()
        assert "verl_reward_mean" in scrape(server.port)
        assert time.monotonic() - start < 5


def test_slow_clients_cannot_block_the_endpoint():
    """Four clients (as many as workers) each sending a byte every 0.3 s, never finishing: the deadline
    is for the whole request, so they hold no worker and are closed after request_timeout_s."""
    with serving(idle=4, workers=4, request_timeout_s=1.0) as (server, slow):
        server.observe({"reward/mean": 0.5})
        start = time.monotonic()
        closed = set()
        while time.monotonic() - start < 2.5:  # per-read timeouts never fire at this pace
            for i, s in enumerate(slow):
                if i not in closed:
                    try:
                        s.sendall(b"G")
                    except OSError:
                        closed.add(i)
            assert "verl_reward_mean 0.5" in scrape(server.port)
            time.sleep(0.3)
        assert closed == {0, 1, 2, 3}, "each slow request closed at its deadline"


def test_an_oversized_request_head_is_closed():
    from verl_fast.metrics.http_server import MAX_HEAD

    with serving(idle=1) as (server, (big,)):
        big.settimeout(5)
        with contextlib.suppress(OSError):
            big.sendall(b"GET /metrics HTTP/1.0\r\nX: " + b"a" * (MAX_HEAD + 10))
        assert big.recv(1) == b""
        assert "verl_reward_mean" in scrape(server.port)
