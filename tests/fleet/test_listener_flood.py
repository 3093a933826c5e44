"""Issue 23, item 3: the metrics listener under a flood of silent TCP connections, against the real
daemon. Threads and memory stay bounded, a scrape still gets through, the connections are freed."""

from __future__ import annotations

import shutil
import socket
import time
import urllib.request

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

FLOOD = 1500


def _proc(pid: int) -> tuple[int, int]:
    """(threads, RSS in KiB) of a process, from /proc."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0])


def _scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.status


def _served(port: int) -> bool:
    """The listener is up: the daemon answers its socket before the metrics listener binds."""
    try:
        return _scrape(port) == 200
    except OSError:
        return False


def test_a_flood_of_silent_connections_holds_no_threads_and_no_memory(tmp_path, make_daemon):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon({"training": {"command": "sleep 300", "workdir": str(tmp_path), "on_finish": "none"},
                     "gpu": {"nvml_library": str(tmp_path / "none.so")},
                     "stop": {"action": "dry-run"},
                     "metrics": {"listen": f"127.0.0.1:{port}"}})
    wait_until(lambda: _served(port), 20, what="metrics served")
    assert d.proc is not None
    pid = d.proc.pid
    threads0, rss0 = _proc(pid)

    conns = []
    t0 = time.monotonic()
    for _ in range(FLOOD):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        conns.append(c)
    try:
        # a scrape in the middle of the flood still gets an answer, promptly; the daemon's other
        # threads (the scheduler's pool) come and go, the listener's three do not grow
        t1 = time.monotonic()
        assert _scrape(port) == 200
        scrape_s = time.monotonic() - t1
        threads, rss = _proc(pid)
        assert threads <= threads0 + 16, f"{threads0} threads before the flood, {threads} during it"
        assert rss - rss0 < 16 * 1024, f"RSS grew {rss0} -> {rss} KiB"
        assert scrape_s < 5, f"a scrape during the flood took {scrape_s:.1f}s"

        # every silent connection is closed by the daemon within the head deadline (3 s) and a margin
        def all_closed() -> bool:
            for c in conns:
                c.settimeout(0.001)
                try:
                    if c.recv(1) != b"":
                        return False
                except (TimeoutError, BlockingIOError):
                    return False
                except OSError:
                    pass
            return True
        wait_until(all_closed, 10, interval=0.2, what="the daemon to close every silent connection")
        assert time.monotonic() - t0 < 30
        threads, rss = _proc(pid)
        assert threads <= threads0 + 16, (threads0, threads)
    finally:
        for c in conns:
            c.close()
    assert _scrape(port) == 200
