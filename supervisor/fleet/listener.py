"""A small HTTP listener whose threads and memory stay bounded whatever the clients do.

The standard ThreadingHTTPServer gives every TCP connection a thread for as long as the client
keeps it open: any local process (the training itself, a container neighbour) could open
thousands of silent connections and hold as many threads and their stacks for ever, until the
machine runs out of pids and the training's data loaders cannot fork.

Here one selector thread reads the request heads of at most MAX_PENDING connections at once, each
within HEAD_DEADLINE seconds in all (a trickling client is cut off at the deadline) and at most
MAX_HEAD bytes; when a new connection comes with every place taken, the oldest pending one is
dropped (a flood cannot keep a scraper out for longer than it takes to connect again). A complete
head goes to one of WORKERS threads through a queue of QUEUE places (full: the connection is
closed), which answer with a write deadline. So: 1 + WORKERS threads and MAX_PENDING x MAX_HEAD
bytes, at most, in all.
"""

from __future__ import annotations

import io
import queue
import selectors
import socket
import threading
import time
from typing import Any

import structlog

log = structlog.get_logger("listener")

MAX_PENDING = 64
HEAD_DEADLINE = 3.0
MAX_HEAD = 16 * 1024
WORKERS = 2
QUEUE = 16
WRITE_TIMEOUT = 5.0


class BoundedHTTPServer:
    """Serves `handler_class` (a BaseHTTPRequestHandler) on (host, port); see the module."""

    def __init__(self, host: str, port: int, handler_class: type, family: int = socket.AF_INET):
        self.handler_class = handler_class
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self.server_address = self._sock.getsockname()
        self._stop = threading.Event()
        self._work: queue.Queue = queue.Queue(QUEUE)
        self._threads = [threading.Thread(target=self._select_loop, name="metrics-http", daemon=True)]
        self._threads += [threading.Thread(target=self._worker, name=f"metrics-http-{i}", daemon=True)
                          for i in range(WORKERS)]
        self.dropped = 0   # connections closed unanswered (deadline, size, no room)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        for _ in range(WORKERS):
            try:
                self._work.put_nowait(None)
            except queue.Full:
                pass
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=2)
        self._sock.close()

    # --- reading request heads -------------------------------------------------------------------
    def _select_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        pending: dict[socket.socket, list[Any]] = {}   # conn -> [head bytes, deadline, address]
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.25):
                    if key.fileobj is self._sock:
                        self._accept(sel, pending)
                    else:
                        self._read(sel, pending, key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, p in pending.items() if p[1] <= now]:
                    self._drop(sel, pending, conn)
        except Exception:  # noqa: BLE001 - logged; the daemon goes on without its listener
            log.exception("metrics_listener_failed")
        finally:
            for conn in list(pending):
                self._drop(sel, pending, conn)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, pending: dict) -> None:
        for _ in range(256):   # drain the backlog, a bounded amount per wake-up
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(pending) >= MAX_PENDING:
                oldest = min(pending, key=lambda c: pending[c][1])
                self._drop(sel, pending, oldest)
            conn.setblocking(False)
            pending[conn] = [b"", time.monotonic() + HEAD_DEADLINE, addr]
            sel.register(conn, selectors.EVENT_READ)

    def _read(self, sel: selectors.BaseSelector, pending: dict, conn: socket.socket) -> None:
        p = pending.get(conn)
        if p is None:
            return
        try:
            chunk = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(sel, pending, conn)
            return
        p[0] += chunk
        if b"\r\n\r\n" in p[0] or b"\n\n" in p[0]:
            sel.unregister(conn)
            del pending[conn]
            try:
                self._work.put_nowait((conn, p[0], p[2]))
            except queue.Full:
                self.dropped += 1
                conn.close()
        elif len(p[0]) > MAX_HEAD:
            self._drop(sel, pending, conn)

    def _drop(self, sel: selectors.BaseSelector, pending: dict, conn: socket.socket) -> None:
        pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        self.dropped += 1

    # --- answering -------------------------------------------------------------------------------
    def _worker(self) -> None:
        while not self._stop.is_set():
            item = self._work.get()
            if item is None:
                return
            conn, head, addr = item
            try:
                conn.setblocking(True)
                conn.settimeout(WRITE_TIMEOUT)
                self.handler_class(_Prefetched(conn, head), addr, self)
            except Exception:  # noqa: BLE001 - one bad connection must not end a worker
                log.debug("metrics_request_failed", exc_info=True)
            finally:
                try:
                    conn.close()
                except OSError:
                    pass


class _Prefetched:
    """The request a handler gets: the connection, and the head already read from it."""

    def __init__(self, conn: socket.socket, head: bytes):
        self.conn, self.head = conn, head


def prefetched_setup(handler: Any) -> None:
    """BaseHTTPRequestHandler.setup for a _Prefetched request: reads come from the head (a body is
    never needed: GET only), writes go to the connection under its write deadline."""
    from socketserver import _SocketWriter  # type: ignore[attr-defined]

    req: _Prefetched = handler.request
    handler.connection = req.conn
    handler.rfile = io.BytesIO(req.head)
    handler.wfile = _SocketWriter(req.conn)

