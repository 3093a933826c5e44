"""The "training stalled" alert: the shell around supervisor.progress.stall.

Every poll (daemon duty "stall") it asks the progress tracker whether the RUNNING training's step
has stood still past the threshold. The first time a stall is seen it gathers what the owner needs
to find the hang (GPU figures, CPU of the process tree, the last log lines, and the Python stacks
from `py-spy dump`, which takes a few seconds per process and runs once per stall, here, outside
every lock) and raises one condition alert; the alert is resolved when the step moves or the run
ends. With progress.stalled_action = "stop" the guard also counts the run as idle (guard.py).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable

import psutil
import structlog

from supervisor.config import ProgressConfig
from supervisor.context import Context
from supervisor.interfaces import Duty, GpuView, ProgressView, TrainingInfo, TrainingView
from supervisor.notify.mails import stall as words
from supervisor.proc import CpuProbe
from supervisor.progress import stacks
from supervisor.progress.stall import Stall
from supervisor.states import TrainingState
from supervisor.training.runner import RUNNER_MODULES
from supervisor.untrusted.fileopen import open_regular

log = structlog.get_logger("stall")

TAIL_BYTES = 64 * 1024


class StallWatch:
    def __init__(self, ctx: Context, conf: ProgressConfig, training: TrainingView, gpu: GpuView | None, progress: ProgressView,
                 dump: Callable[[Iterable[int]], str] = stacks.dump):
        self.ctx = ctx
        self.cfg = conf
        self.training = training
        self.gpu = gpu
        self.progress = progress
        self.dump = dump
        self.cpu = CpuProbe()      # measured on every poll, so a figure exists when a stall is seen
        self._key: str | None = None
        self._mail: tuple[tuple[int, int, float], words.Mail] | None = None  # (run, step, since) -> mail

    def poll(self) -> None:
        """Never raises: a stall check is not worth a daemon crash."""
        try:
            self._poll()
        except Exception:  # noqa: BLE001
            log.exception("stall_poll_failed")

    def _poll(self) -> None:
        info = self.training.info()
        pids: list[int] = []
        if info.state == TrainingState.RUNNING:
            pids = _job_pids(self.training.pids())
            # CPU time is real, so it is measured against the real monotonic clock
            self.cpu.probe(pids, time.monotonic(), 0.0)
        now = self.ctx.clock.time()
        s = self.progress.stall(now).stall if info.state == TrainingState.RUNNING else None
        if s is None:
            self._clear(info)
            return
        key = f"training:stalled:{info.run_id}"
        if self._key is not None and self._key != key:
            self.ctx.alerts.resolve(self._key)
        ident = (info.run_id, s.step, s.since)
        if self._mail is None or self._mail[0] != ident:
            self._mail = (ident, self._compose(info, s, pids))
            log.warning("training_stalled", run_id=info.run_id, step=s.step, since=s.since,
                        for_s=round(s.for_s), threshold_s=s.threshold_s)
        self._key = key
        mail = self._mail[1]
        self.ctx.alerts.fire(key, "training_stalled", "warning", mail.subject, mail.body)

    def _clear(self, info: TrainingInfo) -> None:
        if self._key is None:
            return
        log.info("training_stall_over", key=self._key, state=info.state.value)
        self.ctx.alerts.resolve(self._key)
        self._key = None
        self._mail = None

    def _compose(self, info: TrainingInfo, s: Stall, pids: list[int]) -> words.Mail:
        snap = self.progress.snapshot(self.ctx.clock.time()) or {}
        gpus, gpu_error = self._gpus()
        cfg = self.cfg
        f = words.Stalled(info.run_id, s.step, s.since, s.for_s, s.threshold_s, cfg.stall_after is not None,
                          cfg.stalled_action, snap.get("max_steps"), tuple(pids), self.cpu.figure, gpus, gpu_error,
                          info.log_path, tuple(_tail(info.log_path, words.LOG_LINES)), self.dump(pids),
                          snap.get("source") or "")
        return words.stalled(f)

    def _gpus(self) -> tuple[tuple[words.GpuFigure, ...], str | None]:
        if self.gpu is None:
            return (), None
        try:
            st = self.gpu.status() or {}
        except Exception as e:  # noqa: BLE001
            return (), f"unreadable ({type(e).__name__})"
        out = []
        for g in st.get("gpus") or []:
            if isinstance(g, dict) and isinstance(g.get("index"), int):
                out.append(words.GpuFigure(g["index"], g.get("util_pct"), g.get("mem_used_bytes"),
                                           g.get("mem_total_bytes")))
        return tuple(out), st.get("gpu_error")

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("stall", 30.0, self.poll),)  # a hung run: its step stands still


def _job_pids(pids: Iterable[int]) -> list[int]:
    """The training's own processes: the tree less our runner (supervisor.training.runner, which only waits
    for the job and records its exit), so its stack does not take one of the few py-spy slots."""
    out = []
    for pid in sorted(pids):
        try:
            if any(m in psutil.Process(pid).cmdline()[:3] for m in RUNNER_MODULES):
                continue
        except psutil.Error:
            continue
        out.append(pid)
    return out


def _tail(path: str, n: int) -> list[str]:
    """The last `n` lines of the log (its last 64 KiB, decoded leniently); [] when unreadable."""
    if not path:
        return []
    try:
        # a FIFO in the log's place must not hold the stall alert (the log may be a link the owner made)
        with os.fdopen(open_regular(os.path.realpath(path)), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            text = f.read(TAIL_BYTES).decode("utf-8", "replace")
    except OSError:
        return []
    lines: deque[str] = deque(maxlen=n)
    for line in text.replace("\r", "\n").splitlines():
        if line.strip():
            lines.append(line[:300])
    return list(lines)
