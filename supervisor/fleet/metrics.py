"""Prometheus metrics, the way node-level agents export them.

`exposition(status)` is a pure function from the `status --json` dict to the text exposition
format (version 0.0.4): every number the status shows that a dashboard or an alert rule wants,
named per Prometheus' conventions (base units, `_seconds`, `_bytes`, `_ratio`, `_total` for
counters, `_timestamp_seconds` for points in time; a state is one series per possible value,
1 for the current one). Unknown figures are left out, never written as 0.

The shell around it: `write_textfile` (temp file + rename in the same folder, so
node_exporter's textfile collector never reads half a file) and `MetricsServer` (GET /metrics on
loopback unless the config says otherwise).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

import structlog

from supervisor.interfaces import Duty
from supervisor.status import Block, View
from supervisor.status import P as PREFIX
from supervisor.status.alerts import AlertsBlock, NotifyBlock
from supervisor.status.disk import DiskBlock
from supervisor.status.gpu import GpusBlock
from supervisor.status.health import HealthBlock
from supervisor.status.idle import (
    IDLE_STATES as IDLE_STATES,  # the states' series, as tests and docs name them
)
from supervisor.status.idle import IdleBlock, StopBlock
from supervisor.status.misc import MetricsBlock, OrchestratorBlock
from supervisor.status.money import BudgetBlock
from supervisor.status.resume import ResumeBlock
from supervisor.status.sync import SyncBlock
from supervisor.status.training import CostBlock, DaemonBlock, TrainingBlock

log = structlog.get_logger("metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
P = PREFIX


class _Families:
    """Collects samples per metric family, then writes HELP/TYPE once per family, in order."""

    def __init__(self) -> None:
        self._order: list[str] = []
        self._meta: dict[str, tuple[str, str]] = {}
        self._samples: dict[str, list[str]] = {}

    def add(self, name: str, kind: str, help_: str, value: Any, labels: dict[str, Any] | None = None) -> None:
        v = _num(value)
        if v is None:
            return
        if name not in self._meta:
            self._order.append(name)
            self._meta[name] = (kind, help_)
            self._samples[name] = []
        lab = ""
        if labels:
            lab = "{" + ",".join(f'{k}="{_esc(str(x))}"' for k, x in labels.items()) + "}"
        self._samples[name].append(f"{name}{lab} {_fmt(v)}")

    def extend(self, view: View, *blocks: type[Block]) -> None:
        """Each block's own samples (supervisor/status/), in the order given."""
        for cls in blocks:
            for m in view.block(cls).metrics(view):
                self.add(m.name, m.kind, m.help, m.value, m.labels)

    def text(self) -> str:
        out = []
        for name in self._order:
            kind, help_ = self._meta[name]
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(self._samples[name])
        return "\n".join(out) + "\n"


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, (int, float)):
        try:
            f = float(v)
        except OverflowError:  # an int past a float's range (JSON allows it): not a figure we can show
            return None
        return f if math.isfinite(f) else None
    return None


def _fmt(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# The families' order in the text (each block says its own samples: supervisor/status/).
EXPOSED: tuple[type[Block], ...] = (
    DaemonBlock, TrainingBlock, CostBlock, BudgetBlock, GpusBlock, IdleBlock, StopBlock, SyncBlock, DiskBlock,
    AlertsBlock, NotifyBlock, HealthBlock, ResumeBlock, OrchestratorBlock,
)


def exposition(st: dict) -> str:
    """The Prometheus text for one `status --json` dict. Pure; tolerant of missing or odd values."""
    f = _Families()
    v = View(st)
    f.extend(v, *EXPOSED)
    return f.text()


# --- the shell ---------------------------------------------------------------------------------------

def write_textfile(path: str, text: str) -> None:
    """Replace `path` atomically. The temp name does not end in .prom, so the collector never reads it."""
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # node_exporter runs as its own user
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class MetricsServer:
    """GET /metrics (and / for a pointer) over HTTP; anything else 404. Serves what `get_text` returns."""

    def __init__(self, host: str, port: int, get_text: Callable[[], str]):
        self.get_text = get_text
        outer = self

        # here, not at the top: http.server costs ~1 MiB a daemon without a listener never uses
        from http.server import BaseHTTPRequestHandler

        from supervisor.fleet.listener import BoundedHTTPServer, prefetched_setup

        class Handler(BaseHTTPRequestHandler):
            server_version = "train-supervisor"
            sys_version = ""

            def setup(self) -> None:
                prefetched_setup(self)  # the head was read by the listener, under its deadline

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    try:
                        body, code, ctype = outer.get_text().encode(), 200, CONTENT_TYPE
                    except Exception:  # noqa: BLE001 - a scrape must never take anything down
                        log.exception("metrics_render_failed")
                        body, code, ctype = b"metrics unavailable\n", 500, "text/plain"
                elif path == "/":
                    body, code, ctype = b"train-supervisor: see /metrics\n", 200, "text/plain"
                else:
                    body, code, ctype = b"not found\n", 404, "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        # bounded threads and memory whatever the clients do (listener's docstring)
        self._srv = BoundedHTTPServer(host, port, Handler, _family(host))
        self.address = self._srv.server_address[:2]

    def start(self) -> None:
        self._srv.start()
        log.info("metrics_listening", address=f"{self.address[0]}:{self.address[1]}")

    def close(self) -> None:
        self._srv.close()


def _family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


class MetricsDuty:
    """Each poll: one status snapshot, turned into the exposition text, written to the textfile and
    kept for the listener (and for the webhook's facts). Errors are shown in status, logged once."""

    def __init__(self, textfile: str, listen: str, status: Callable[[], dict], clock: Callable[[], float],
                 every: float | None = None):
        self.every = every    # None: nothing reads the figures (no textfile, listener or webhook)
        self.textfile = textfile
        self.listen = listen
        self._status = status
        self._clock = clock
        self.last_status: dict | None = None
        self.text = ""
        self.written_at: float | None = None
        self.error: str | None = None
        self.server: MetricsServer | None = None

    def start(self) -> None:
        if not self.listen:
            return
        from supervisor.config import parse_listen

        host, port = parse_listen(self.listen)
        try:
            self.server = MetricsServer(host, port, self.current_text)
            self.server.start()
        except OSError as e:
            self._problem(f"metrics.listen {self.listen}: cannot listen ({e.strerror or e})")

    def close(self) -> None:
        if self.server:
            self.server.close()

    def current_text(self) -> str:
        return self.text or self.poll()

    def poll(self) -> str:
        try:
            st = self._status()
            text = exposition(st)
        except Exception as e:
            # never go on serving the values from before: a scrape fails (500) until status answers
            self.text = ""
            self._problem(f"status failed: {type(e).__name__}: {str(e)[:200]}")
            raise
        if self.error and self.error.startswith("status failed"):
            log.info("metrics_status_ok")
            self.error = None
        self.last_status = st
        self.text = text
        if self.textfile:
            try:
                write_textfile(self.textfile, text)
                self.written_at = self._clock()
                if self.error and self.error.startswith("metrics.textfile"):
                    log.info("metrics_textfile_ok", path=self.textfile)
                    self.error = None
            except OSError as e:
                self._problem(f"metrics.textfile {self.textfile}: cannot write ({e.strerror or type(e).__name__})")
        return text

    def _problem(self, msg: str) -> None:
        if msg != self.error:
            log.error("metrics_problem", problem=msg)
        self.error = msg

    def status(self) -> dict:
        return {"textfile": self.textfile or None, "listen": self.listen or None,
                "address": (f"{self.server.address[0]}:{self.server.address[1]}" if self.server else None),
                "written_at": self.written_at, "error": self.error}

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("metrics", self.every, self.poll),)

    def status_blocks(self) -> tuple[Block, ...]:
        return (MetricsBlock.of(self.status()),)
