"""The metrics endpoint under idle connections: it serves from a bounded pool of threads (100 idle
connections used to start 100 threads), still answers a scrape while they are open, and closes the
ones that stay idle."""

import socket
import threading
import time
import urllib.request

from verl_fast.metrics import MetricsServer


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def idle_connections(port: int, n: int):
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        out.append(s)
    return out


def test_a_hundred_idle_connections_do_not_take_a_hundred_threads():
    before = threading.active_count()
    server = MetricsServer(0)
    idle = []
    try:
        server.observe({"reward/mean": 0.5})
        idle = idle_connections(server.port, 100)
        time.sleep(0.5)
        text = scrape(server.port)  # answered while they are open
        assert "verl_reward_mean 0.5" in text
        assert threading.active_count() - before <= 1 + 4, threading.enumerate()  # the acceptor + the pool
    finally:
        for s in idle:
            s.close()
        server.close()


def test_idle_connections_are_closed():
    server = MetricsServer(0, idle_s=0.3, max_open=8)
    idle = []
    try:
        idle = idle_connections(server.port, 20)  # beyond max_open: the oldest closed at once
        time.sleep(1.0)  # beyond idle_s: the rest closed too
        for s in idle:
            s.settimeout(5)
            assert s.recv(1) == b""  # the server closed it
        assert "verl_reward_mean" in scrape(server.port)
    finally:
        for s in idle:
            s.close()
        server.close()


def test_a_stalled_request_holds_a_worker_only_briefly():
    server = MetricsServer(0, workers=1, request_timeout_s=0.5)
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        stalled.sendall(b"GET /metr")  # a request begun and never finished: on the only worker
        time.sleep(0.2)
        start = time.monotonic()
        assert "verl_reward_mean" in scrape(server.port)
        assert time.monotonic() - start < 5
    finally:
        stalled.close()
        server.close()
