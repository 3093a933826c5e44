"""What the GPUs are doing: samples from the NVML probe kept in a rolling window, so "GPU load" is
judged over minutes and one busy or idle second decides nothing; alerts for memory at its limit and
for a GPU that failed. A machine without NVIDIA GPUs is not an alert, only a line in status.

`poll()` is the duty the daemon runs every gpu.poll_interval; everything else reads what the last
polls stored and never touches NVML, so status stays cheap and cannot hang on a sick driver.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import structlog

from supervisor.config import GpuConfig
from supervisor.context import Context
from supervisor.gpu.nvml import GpuSample, GpuSnapshot, NvmlProbe, XidEvent
from supervisor.interfaces import Duty, TrainingView
from supervisor.notify.mails import gpu as words
from supervisor.status import Block
from supervisor.status.gpu import GpusBlock

log = structlog.get_logger("gpu")

PIDS_REFRESH_S = 30.0        # the training's process tree, re-read at most this often ...
PIDS_UNKNOWN_REFRESH_S = 5.0  # ... or this often while a GPU process belongs to nobody we know
RESOLVE_MARGIN = 0.02        # memory must fall this far below the limit to clear the alert

# Xid codes that are usually the application's own fault (illegal access, page fault, stopped,
# killed): only warned about. Others mean the hardware or the driver failed.
XID_APP = frozenset({13, 31, 43, 45})


@dataclass(frozen=True)
class _Point:
    t: float                                  # monotonic
    util: tuple[float | None, ...]            # by position in the snapshot
    index: tuple[int, ...]


class GpuMonitor:
    """`keep_window_s`: the longest window `utilization` will be asked about (the idle guard's is
    given by the daemon); samples are kept that long, and never shorter than gpu.window."""

    def __init__(self, ctx: Context, conf: GpuConfig, probe: NvmlProbe | None = None, training: TrainingView | None = None,
                 keep_window_s: float = 0.0):
        self.ctx = ctx
        self.cfg = conf
        self.probe = probe or NvmlProbe(self.cfg.nvml_library, monotonic=ctx.clock.monotonic)
        self.training = training
        self._lock = threading.Lock()
        self._last: GpuSnapshot | None = None
        self._train_of: dict[int, bool] = {}       # GPU pid -> belongs to the training
        self._window: deque[_Point] = deque()
        self._keep_s = max(self.cfg.window, keep_window_s) + 2 * self.cfg.poll_interval
        self._peak: int | None = None
        self._over: dict[int, int] = {}            # consecutive samples at the limit, per GPU
        self._under: dict[int, int] = {}
        self._at_limit: set[int] = set()
        self._failed_active = False
        self._limit_active = False
        self._seen_gpus = False
        self._pids: set[int] = set()
        self._pids_at = float("-inf")

    # --- the duty ------------------------------------------------------------------------------
    def poll(self) -> GpuSnapshot:
        try:
            snap = self.probe.sample()
        except Exception as e:  # noqa: BLE001 - the probe should not raise; if it does, it is "unknown"
            log.exception("gpu_probe_raised")
            snap = GpuSnapshot(error=f"GPU probe failed: {e}")
        now = self.ctx.clock.monotonic()
        train_of = self._attribute(snap, now)
        with self._lock:
            self._last = snap
            self._train_of = train_of
            self._window.append(_Point(now, tuple(g.util_pct for g in snap.gpus),
                                       tuple(g.index for g in snap.gpus)))
            while self._window and now - self._window[0].t > self._keep_s:
                self._window.popleft()
            for g in snap.gpus:
                if g.mem_used_bytes is not None and (self._peak is None or g.mem_used_bytes > self._peak):
                    self._peak = g.mem_used_bytes
        if snap.gpus:
            self._seen_gpus = True
        self._check_memory(snap)
        self._check_failed(snap)
        for ev in snap.events:
            self._xid_alert(ev, snap)
        return snap

    def close(self) -> None:
        self.probe.close()

    # --- reading -------------------------------------------------------------------------------
    def utilization(self, window_s: float) -> float | None:
        """Highest per-GPU time-weighted mean utilization over the last window_s seconds. None when
        no GPU has known samples covering at least half the window (a fresh daemon, no driver,
        NotSupported/MIG): "unknown" must never read as "idle"."""
        now = self.ctx.clock.monotonic()
        cap = 2.0 * max(self.cfg.poll_interval, 0.1)  # a stalled poll does not stretch one sample
        with self._lock:
            pts = [p for p in self._window if now - p.t <= window_s]
        if not pts:
            return None
        weighted: dict[int, float] = {}
        covered: dict[int, float] = {}
        for i, p in enumerate(pts):
            nxt = pts[i + 1].t if i + 1 < len(pts) else now
            dt = min(max(nxt - p.t, 0.0), cap)
            for idx, u in zip(p.index, p.util, strict=True):
                if u is None:
                    continue
                weighted[idx] = weighted.get(idx, 0.0) + u * dt
                covered[idx] = covered.get(idx, 0.0) + dt
        means = [weighted[i] / covered[i] for i in covered if covered[i] > 0 and covered[i] >= window_s / 2]
        return max(means) if means else None

    def peak_mem_bytes(self) -> int | None:
        """The most memory any one GPU had in use since start (or reset_peak)."""
        with self._lock:
            return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = None

    def status(self) -> dict:
        with self._lock:
            snap, train_of = self._last, dict(self._train_of)
        if snap is None:
            return {"gpus": [], "gpu_error": "GPUs not polled yet", "gpu_driver": None}
        return {"gpus": [gpu_dict(g, train_of) for g in snap.gpus], "gpu_error": snap.error,
                "gpu_driver": snap.driver_version}

    # --- attribution ---------------------------------------------------------------------------
    def _attribute(self, snap: GpuSnapshot, now: float) -> dict[int, bool]:
        """Which GPU processes belong to the training. NVML reports host PIDs; inside a container
        they do not match ours and read as "other" (never as training that is not there)."""
        gpu_pids = {p.pid for g in snap.gpus for p in g.processes}
        if not gpu_pids or self.training is None:
            return dict.fromkeys(gpu_pids, False)
        age = now - self._pids_at
        stranger = bool(gpu_pids - self._pids)
        if age >= PIDS_REFRESH_S or (stranger and age >= PIDS_UNKNOWN_REFRESH_S):
            try:
                self._pids = set(self.training.pids())
            except Exception:  # noqa: BLE001 - attribution is cosmetic; never fail the poll for it
                log.exception("training_pids_failed")
                self._pids = set()
            self._pids_at = now
        return {pid: pid in self._pids for pid in gpu_pids}

    # --- alerts --------------------------------------------------------------------------------
    def _check_memory(self, snap: GpuSnapshot) -> None:
        frac, need = self.cfg.mem_limit_fraction, self.cfg.mem_limit_samples
        for g in snap.gpus:
            if g.mem_used_bytes is None or not g.mem_total_bytes:
                continue
            ratio = g.mem_used_bytes / g.mem_total_bytes
            if ratio >= frac:
                self._over[g.index] = self._over.get(g.index, 0) + 1
                self._under[g.index] = 0
                if self._over[g.index] >= need:
                    self._at_limit.add(g.index)
            else:
                self._over[g.index] = 0
                if ratio < frac - RESOLVE_MARGIN:
                    self._under[g.index] = self._under.get(g.index, 0) + 1
                    if self._under[g.index] >= need:
                        self._at_limit.discard(g.index)
                else:
                    self._under[g.index] = 0
        self._at_limit &= {g.index for g in snap.gpus if not g.error}  # a failed GPU is its own alert
        if self._at_limit:
            by_idx = {g.index: g for g in snap.gpus}
            mail = words.mem_limit([words.GpuMem(i, getattr(by_idx.get(i), "mem_used_bytes", None),
                                                 getattr(by_idx.get(i), "mem_total_bytes", None))
                                    for i in sorted(self._at_limit)], frac, need, self.cfg.poll_interval)
            self.ctx.alerts.fire("gpu:mem_limit", "gpu_mem_limit", "warning", mail.subject, mail.body)
            self._limit_active = True
        elif self._limit_active:
            self.ctx.alerts.resolve("gpu:mem_limit")
            self._limit_active = False

    def _check_failed(self, snap: GpuSnapshot) -> None:
        bad = [g for g in snap.gpus if g.error]
        lost = not bad and snap.error and self._seen_gpus and not snap.gpus
        if not bad and not lost:
            if self._failed_active:
                self.ctx.alerts.resolve("gpu:failed")
                self._failed_active = False
            return
        mail = words.gpu_failed([words.GpuFault(g.index, g.name, g.uuid, g.error or "") for g in bad], snap.error)
        self.ctx.alerts.fire("gpu:failed", "gpu_failed", "critical", mail.subject, mail.body)
        self._failed_active = True

    def _xid_alert(self, ev: XidEvent, snap: GpuSnapshot) -> None:
        name = next((g.name for g in snap.gpus if g.index == ev.index), None)
        app = ev.xid in XID_APP
        mail = words.xid(ev.xid, ev.index, name, ev.uuid, app)
        self.ctx.alerts.event(f"gpu:xid:{ev.uuid or ev.index}:{ev.xid}", "gpu_xid", "warning" if app else "critical",
                              mail.subject, mail.body)

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        return (Duty("gpu", self.cfg.poll_interval, self.poll),)

    def status_blocks(self) -> tuple[Block, ...]:
        g = self.status()
        return (GpusBlock.of({"gpus": g.get("gpus", []), "gpu_error": g.get("gpu_error")}),)


def gpu_dict(g: GpuSample, train_of: dict[int, bool]) -> dict:
    return {
        "index": g.index, "name": g.name, "uuid": g.uuid, "util_pct": g.util_pct,
        "mem_used_bytes": g.mem_used_bytes, "mem_total_bytes": g.mem_total_bytes,
        "processes": [{"pid": p.pid, "mem_bytes": p.mem_bytes, "training": train_of.get(p.pid, False)}
                      for p in g.processes],
        "mig": g.mig, "error": g.error,
    }

