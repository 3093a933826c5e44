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
from supervisor.states import IdleState, SyncState, TrainingState

log = structlog.get_logger("metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
P = "train_supervisor_"

TRAINING_STATES = [s.value for s in TrainingState]
IDLE_STATES = [s.value for s in IdleState]
SYNC_STATES = [s.value for s in SyncState]


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

    def enum(self, name: str, help_: str, current: Any, values: list[str]) -> None:
        if not isinstance(current, str) or not current:
            return
        for s in [*values, *([current] if current not in values else [])]:
            self.add(name, "gauge", help_, 1 if s == current else 0, {"state": s})

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
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def _fmt(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _d(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _l(v: Any) -> list:
    return v if isinstance(v, list) else []


def exposition(st: dict) -> str:
    """The Prometheus text for one `status --json` dict. Pure; tolerant of missing or odd values."""
    f = _Families()
    now = _num(st.get("now"))
    daemon = _d(st.get("daemon"))
    f.add(P + "build_info", "gauge", "Always 1; the daemon's version as a label.", 1,
          {"version": st.get("version") or "unknown"})
    f.add(P + "status_timestamp_seconds", "gauge",
          "When the daemon built these figures (a stale value means the daemon stopped writing).", now)
    f.add(P + "daemon_start_timestamp_seconds", "gauge", "When the daemon started.", daemon.get("started_at"))
    f.add(P + "daemon_problems", "gauge", "Problems the daemon reports in status (e.g. a state file set aside).",
          len(_l(daemon.get("problems"))))

    tr = _d(st.get("training"))
    pr = _d(tr.get("progress"))
    f.enum(P + "training_state", "Training state: 1 for the current one.", tr.get("state"), TRAINING_STATES)
    f.add(P + "training_start_timestamp_seconds", "gauge", "When the current or last training started.",
          tr.get("started_at"))
    f.add(P + "training_end_timestamp_seconds", "gauge", "When the last training ended.", tr.get("ended_at"))
    f.add(P + "training_exit_code", "gauge", "Exit code of the last training (-N: killed by signal N).",
          tr.get("exit_code"))
    f.add(P + "training_restarts", "gauge", "Automatic restarts of the current training.", tr.get("restarts"))
    f.add(P + "training_step", "gauge", "Current optimizer step.", pr.get("step"))
    f.add(P + "training_max_steps", "gauge", "Steps the training will run in all.", pr.get("max_steps"))
    f.add(P + "training_epoch", "gauge", "Current epoch (fractional).", pr.get("epoch"))
    f.add(P + "training_loss", "gauge", "Last training loss reported.", pr.get("loss"))
    f.add(P + "training_learning_rate", "gauge", "Last learning rate reported.", pr.get("learning_rate"))
    f.add(P + "training_tokens_per_second", "gauge", "Training throughput in tokens per second.",
          pr.get("tokens_per_s"))
    f.add(P + "training_steps_per_second", "gauge", "Training steps per second.", pr.get("steps_per_s"))
    pct = _num(pr.get("percent"))
    f.add(P + "training_progress_ratio", "gauge", "Fraction of the training done (0-1).",
          pct / 100.0 if pct is not None else None)
    f.add(P + "training_elapsed_seconds", "gauge", "Time the training has run.", pr.get("elapsed_s"))
    f.add(P + "training_eta_seconds", "gauge", "Estimated time left to finish.", pr.get("eta_s"))
    if tr.get("state") == TrainingState.RUNNING.value or pr.get("stalled_since") is not None:
        f.add(P + "training_stalled", "gauge", "1 while a running training shows no progress.",
              pr.get("stalled_since") is not None)
    f.add(P + "training_stalled_since_timestamp_seconds", "gauge", "Since when the training shows no progress.",
          pr.get("stalled_since"))
    f.add(P + "seconds_since_step", "gauge", "Seconds since the running training's step last advanced.",
          pr.get("since_step_s"))
    f.add(P + "training_stall_after_seconds", "gauge",
          "Seconds without a new step after which the running training counts as hung.", pr.get("stall_after_s"))
    if pr.get("since_step_s") is not None:
        f.add(P + "training_hung", "gauge", "1 while the running training's step has not advanced for "
              "training_stall_after_seconds (the training-stalled alert).", bool(pr.get("stalled")))

    cost = _d(st.get("cost"))
    cur = {"currency": cost.get("currency") or ""}
    f.add(P + "cost_price_per_hour", "gauge", "What this machine costs per hour.", cost.get("price_per_hour"), cur)
    f.add(P + "cost_spent", "gauge", "Money spent on the current training so far.", cost.get("spent"), cur)
    f.add(P + "cost_to_finish", "gauge", "Money the training will cost until it finishes (estimate).",
          cost.get("eta_cost"), cur)
    b = _d(st.get("budget"))
    cap, proj = _d(b.get("cap")), _d(b.get("projection"))
    bl = {"currency": b.get("currency") or "", "cap": cap.get("kind") or ""}
    f.add(P + "budget_max_cost", "gauge", "The spend cap (budget.max_cost, money since boot).", b.get("max_cost"), bl)
    f.add(P + "budget_spent", "gauge", "Money since this machine booted at price_per_hour.", b.get("spent"), bl)
    f.add(P + "budget_cap_seconds_left", "gauge", "Seconds until the first cap (spend, deadline, runtime).",
          cap.get("left_s"), bl)
    f.add(P + "budget_stop_seconds_left", "gauge", "Seconds until the stop for the first cap begins.",
          cap.get("act_left_s"), bl)
    f.add(P + "budget_projected_cost", "gauge", "Money the run needs to its end at this rate, since boot.",
          proj.get("need_cost"), bl)

    gpus = _l(st.get("gpus"))
    f.add(P + "gpus", "gauge", "GPUs the daemon sees.", len(gpus))
    f.add(P + "gpu_error", "gauge", "1 when the GPUs cannot be read (no driver, NVML error).",
          bool(st.get("gpu_error")))
    for g in gpus:
        g = _d(g)
        lab = {"gpu": g.get("index", ""), "uuid": g.get("uuid") or "", "model": g.get("name") or ""}
        util = _num(g.get("util_pct"))
        f.add(P + "gpu_utilization_ratio", "gauge", "GPU utilization (0-1), as NVML reports it.",
              util / 100.0 if util is not None else None, lab)
        f.add(P + "gpu_memory_used_bytes", "gauge", "GPU memory in use.", g.get("mem_used_bytes"), lab)
        f.add(P + "gpu_memory_total_bytes", "gauge", "GPU memory in all.", g.get("mem_total_bytes"), lab)
        procs = g.get("processes")
        f.add(P + "gpu_processes", "gauge", "Processes using the GPU.",
              len(procs) if isinstance(procs, list) else None, lab)

    idle = _d(st.get("idle"))
    f.enum(P + "idle_state", "Idle protection state: 1 for the current one.", idle.get("state"), IDLE_STATES)
    since = _num(idle.get("idle_since"))
    if idle.get("state") and now is not None:
        f.add(P + "idle_seconds", "gauge", "How long the machine has been idle (0 while active).",
              max(now - since, 0.0) if since is not None else 0)
    f.add(P + "idle_warn_timestamp_seconds", "gauge", "When the idle warning goes (or went) out.",
          idle.get("warn_at"))
    f.add(P + "idle_stop_timestamp_seconds", "gauge", "When an idle stop is planned.", idle.get("stop_at"))
    f.add(P + "keepalive_until_timestamp_seconds", "gauge", "Until when a keepalive holds the machine.",
          idle.get("keepalive_until"))
    stop = _d(st.get("stop"))
    f.add(P + "stop_planned_timestamp_seconds", "gauge", "When the machine is planned to stop.",
          stop.get("planned_at"))

    sync = _d(st.get("sync"))
    f.enum(P + "sync_state", "Checkpoint sync state: 1 for the current one.", sync.get("state"), SYNC_STATES)
    f.add(P + "sync_pending_files", "gauge", "Files waiting to be copied off the machine.", sync.get("pending_files"))
    f.add(P + "sync_pending_bytes", "gauge", "Bytes waiting to be copied off the machine.", sync.get("pending_bytes"))
    f.add(P + "sync_last_success_timestamp_seconds", "gauge", "When the target last held everything.",
          sync.get("last_ok_at"))
    f.add(P + "sync_uploaded_files_total", "counter", "Files uploaded.", sync.get("uploaded_files"))
    f.add(P + "sync_uploaded_bytes_total", "counter", "Bytes uploaded.", sync.get("uploaded_bytes"))

    disk = _d(st.get("disk"))
    for fs in _l(disk.get("filesystems")):
        fs = _d(fs)
        lab = {"mount": fs.get("mount") or ""}
        f.add(P + "disk_free_bytes", "gauge", "Free bytes on a training filesystem.", fs.get("free_bytes"), lab)
        f.add(P + "disk_size_bytes", "gauge", "Size of a training filesystem.", fs.get("total_bytes"), lab)
        f.add(P + "disk_full_in_seconds", "gauge", "Forecast: seconds until the save that would not fit.",
              fs.get("full_in_s"), lab)
        f.add(P + "disk_checkpoint_bytes", "gauge", "Size of the newest checkpoint.", fs.get("checkpoint_bytes"), lab)
        f.add(P + "disk_checkpoints_local", "gauge", "Complete checkpoints on this filesystem.",
              fs.get("checkpoints"), lab)
        f.add(P + "disk_checkpoints_off_machine", "gauge", "Of those, verified off the machine.",
              fs.get("verified_off"), lab)
    f.add(P + "disk_pruned_total", "counter", "Local checkpoints deleted once verified on the target.",
          disk.get("deleted"))
    f.add(P + "disk_pruned_bytes_total", "counter", "Bytes those deletes freed.", disk.get("freed_bytes"))

    counts: dict[tuple[str, str], int] = {}
    for a in _l(st.get("alerts")):
        a = _d(a)
        k = (str(a.get("kind") or "unknown"), str(a.get("severity") or "warning"))
        counts[k] = counts.get(k, 0) + 1
    f.add(P + "alerts_active", "gauge", "Alerts active now (all kinds).", sum(counts.values()))
    for (kind, sev), n in sorted(counts.items()):
        f.add(P + "alerts_active_by_kind", "gauge", "Alerts active now, by kind and severity.", n,
              {"kind": kind, "severity": sev})

    for ch in _l(_d(st.get("notify")).get("channels")):
        ch = _d(ch)
        lab = {"channel": ch.get("name") or "", "kind": ch.get("kind") or ""}
        f.add(P + "notify_channel_up", "gauge", "0 while a notification channel fails to deliver.",
              ch.get("state") != "failing", lab)
        f.add(P + "notify_queued", "gauge", "Messages waiting for the channel.", ch.get("queued"), lab)
        f.add(P + "notify_last_success_timestamp_seconds", "gauge", "When the channel last delivered.",
              ch.get("last_ok_at"), lab)

    h = _d(st.get("health"))
    if h.get("verdict"):
        f.enum(P + "gpu_health", "GPU health verdict (supervisorctl health): 1 for the current one.", h["verdict"],
               ["OK", "DEGRADED", "BAD", "UNKNOWN"])
        for fd in _l(h.get("findings")):
            fd = _d(fd)
            f.add(P + "gpu_health_problem", "gauge", "1 per health finding, by GPU, check and level.", 1,
                  {"gpu": "" if fd.get("gpu") is None else fd["gpu"], "check": fd.get("check") or "",
                   "level": fd.get("level") or ""})
        for lf in _l(h.get("live")):
            lf = _d(lf)
            f.add(P + "gpu_health_live_fault", "gauge", "1 per GPU fault seen during the run.", 1,
                  {"key": lf.get("key") or ""})
        for g in _l(h.get("gpus")):
            g = _d(g)
            lab = {"gpu": g.get("index")}
            f.add(P + "gpu_temperature_celsius", "gauge", "GPU temperature.", g.get("temp_c"), lab)
            f.add(P + "gpu_power_watts", "gauge", "GPU power draw.", g.get("power_w"), lab)
            f.add(P + "gpu_ecc_uncorrected_volatile", "gauge", "Uncorrectable ECC errors since the driver loaded.",
                  g.get("ecc_uncorrected_volatile"), lab)
            f.add(P + "gpu_pcie_link_width", "gauge", "Current PCIe link width.", g.get("pcie_width"), lab)
            f.add(P + "gpu_clock_event_reasons", "gauge", "NVML clock-event (throttle) reasons bitmask.",
                  g.get("throttle"), lab)
    rs = _d(st.get("resume"))
    if rs.get("enabled"):
        f.add(P + "resume_waiting", "gauge", "1 while a training start waits for the target to restore a checkpoint.",
              rs.get("state") == "waiting")
        if rs.get("state") == "restoring":
            prog = _d(rs.get("progress"))
            f.add(P + "resume_restored_bytes", "gauge", "Bytes of the checkpoint being restored that are here.",
                  prog.get("bytes_done"))
            f.add(P + "resume_restore_total_bytes", "gauge", "Bytes of the checkpoint being restored.",
                  prog.get("bytes_total"))

    orch = _d(st.get("orchestrator"))
    if orch.get("name"):
        f.add(P + "orchestrator_info", "gauge", "1 when an outer orchestrator (SkyPilot, dstack) was detected.",
              1, {"name": orch["name"]})
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

    def status_blocks(self) -> dict[str, object]:
        return {"metrics": self.status()}
