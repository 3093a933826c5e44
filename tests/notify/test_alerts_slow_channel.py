"""Issue 23, item 4: a webhook server that answers one byte a second, beside a real SMTP server, on
the real daemon. The mail of every alert still goes out at once, the stuck webhook is marked
failing in status and in `alerts`, and the "stopping now" mail goes out before the stop action with
no wait on the webhook."""

from __future__ import annotations

import base64
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.nvml import gpu
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()


class Trickler:
    """Accepts HTTP requests and answers `HTTP/1.1 200 OK...` one byte per second, for ever."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.port = self.srv.getsockname()[1]
        self.stop = threading.Event()
        self.requests = 0
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        self.srv.settimeout(0.2)
        while not self.stop.is_set():
            try:
                c, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.requests += 1
            t = threading.Thread(target=self._trickle, args=(c,), daemon=True)
            self.threads.append(t)
            t.start()

    def _trickle(self, c: socket.socket) -> None:
        with c:
            for b in b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" * 100:
                if self.stop.wait(1.0):
                    return
                try:
                    c.sendall(bytes([b]))
                except OSError:
                    return

    def close(self) -> None:
        self.stop.set()
        self.srv.close()
        for t in self.threads:
            t.join(5)


def _mail_times(smtp, seen: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """(subject, when first seen here) of every mail received, in order."""
    for m in list(smtp.messages)[len(seen):]:
        seen.append((str(m["Subject"]).replace("\r\n", ""), time.monotonic()))
    return seen


def test_a_trickling_webhook_holds_back_no_mail_and_no_stop(tmp_path: Path, make_daemon, smtp_server, fake_nvml):
    fake_nvml.write([gpu(util=90)])          # busy while the alerts are checked, idle for the stop
    hook = Trickler()
    secret = tmp_path / "whsec"
    secret.write_text(SECRET + "\n")
    stopped = tmp_path / "stopped.txt"
    try:
        d = make_daemon({
            "training": {"command": "exit 3", "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                         "on_finish": "none"},
            "gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "0.2s"},
            "idle": {"warn_after": "2s", "stop_after_warning": "2s", "poll_interval": "0.3s", "gpu_window": "1s",
                     "activity_window": "1s", "count_training_output": False},
            "stop": {"action": "command", "command": f"date +%s.%N > {stopped}", "retry_interval": "1s"},
            "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                      "smtp_port": smtp_server.port, "security": "none"},
            "notify": {"webhook_url": f"http://127.0.0.1:{hook.port}/hook", "webhook_secret_file": str(secret),
                       "timeout": "2s"},
            "alerts": {"first_delay": "0s"},
        })
        seen: list[tuple[str, float]] = []
        for run in (1, 2):
            t0 = time.monotonic()
            assert d.ctl("start").returncode == 0
            wait_until(lambda run=run: sum("failed" in s.lower() for s, _ in _mail_times(smtp_server, seen))
                       >= run, 15, interval=0.1, what=f"the mail of failed run {run}; got {smtp_server.subjects()}")
            took = time.monotonic() - t0
            assert took < 8, f"the mail of run {run} took {took:.1f}s with the webhook stuck"
        assert hook.requests >= 1

        def webhook():
            return next((c for c in d.status()["notify"]["channels"] if c["name"] == "webhook"), None)
        ch = wait_until(lambda: (lambda c: c if c and c["state"] == "failing" else None)(webhook()), 15,
                        interval=0.2, what="the webhook marked failing")
        assert "stuck" in (ch["last_error"] or ""), ch
        assert any(e.get("channel") == "webhook" and "stuck" in (e.get("error") or "")
                   for e in d.req("alerts", {"n": 100})["recent"]), "the stuck send in `alerts`"

        # now idle: the stop's last mail goes out and the stop follows without waiting on the webhook
        fake_nvml.write([gpu(util=0)])
        wait_until(lambda: stopped.exists() and stopped.read_text().strip(), 40, interval=0.2,
                   what="the stop action")
        stop_wall = float(stopped.read_text())
        stop_mono = time.monotonic() - (time.time() - stop_wall)
        stopping = wait_until(lambda: next((t for s, t in _mail_times(smtp_server, seen)
                                            if "stopping" in s.lower()), None), 10, interval=0.1,
                              what=f"the stopping mail; got {smtp_server.subjects()}")
        assert stopping <= stop_mono + 0.5, "the stopping mail should go out before the stop"
        # the flush before the stop did not wait out the webhook's whole-send deadline (4 s)
        assert stop_mono - stopping < 3.5, f"the stop came {stop_mono - stopping:.1f}s after its mail"
    finally:
        hook.close()
