"""A TCP proxy on loopback that gives every request a network round trip: what a bench on one box
lacks when it compares tools against an object store in another building (S3 in the same region
answers a GET's first byte in 10-30 ms; loopback in 0.05).

Each connection is held `rtt` before it reaches the server (the handshake), and each chunk the
client sends is held `rtt` before it is passed on (a request's round trip: the answer follows
it). What the server sends comes back at once, spliced kernel to kernel (os.splice), so the proxy
adds latency, not CPU time, and no tool is slowed more than another by its bandwidth.

    with LatencyProxy("127.0.0.1", 8333, rtt=0.010) as p: ... p.endpoint ...
"""

from __future__ import annotations

import os
import socket
import threading
import time


class LatencyProxy:
    def __init__(self, host: str, port: int, rtt: float):
        self.upstream = (host, port)
        self.rtt = rtt
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        time.sleep(self.rtt)
        try:
            s = socket.create_connection(self.upstream)
        except OSError:
            c.close()
            return
        for x in (c, s):
            x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._back, args=(s, c), daemon=True).start()
        try:
            while chunk := c.recv(1 << 16):
                time.sleep(self.rtt)
                s.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    @staticmethod
    def _back(s: socket.socket, c: socket.socket) -> None:
        r, w = os.pipe()
        try:
            while True:
                n = os.splice(s.fileno(), w, 1 << 20)
                if not n:
                    break
                while n:
                    n -= os.splice(r, c.fileno(), n)
        except OSError:
            pass
        finally:
            os.close(r)
            os.close(w)
            c.close()
            s.close()
