"""The spot-notice shell: asks the metadata services (a daemon duty), and on a notice alerts the owner
at once (uncapped), signals the training so it saves, puts the sync engine in emergency mode
(newest complete checkpoint first), asks the one stop door for a `preemption` stop (its final sync is
the emergency sync, cut to the notice's deadline: `moment`; the training is not interrupted, it saves
on its signal), follows what makes it off the machine until the sync is done or the time is up,
mails that, and keeps it all in state_dir/preemption.json for the next boot.

Decisions are in spot.py; the providers' replies are read in preemption.py; words in mails/preemption.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from supervisor import records
from supervisor.interfaces import Duty
from supervisor.notify.alerts import Severity
from supervisor.notify.mails import preemption as words
from supervisor.spot.decide import (
    Holding,
    NoticeRecord,
    container_host,
    newest_unit,
    next_boot,
    outcome,
    sigterm_is_notice,
    tally,
    unit_of_cgroup,
)
from supervisor.spot.notices import TYPICAL_NOTICE_S, MetadataWatcher, Notice
from supervisor.statefile import set_aside
from supervisor.status import Block
from supervisor.status.spot import PreemptionBlock
from supervisor.timefmt import when

if TYPE_CHECKING:
    from supervisor.config import PreemptionConfig
    from supervisor.context import Context
    from supervisor.sync.engine import SyncEngine
    from supervisor.training.job import Training

log = structlog.get_logger("preemption")

STATE_NAME = "preemption"
REDETECT_S = 600.0     # with watch = [] and nothing answering: ask again this often (a late network)
FOLLOW_EVERY_S = 0.5   # real seconds between looks at the emergency sync while a notice runs
ACTION_RESERVE_S = 5.0  # kept before the deadline for the stopping mail and the action


class SpotGuard:
    def __init__(self, ctx: Context, conf: PreemptionConfig, sync: SyncEngine | None, training: Training | None,
                 hostname: str,
                 watcher: MetadataWatcher | None = None, env: dict[str, str] | None = None,
                 stop: Callable[[str, str], bool] | None = None):
        self.ctx = ctx
        self.cfg = conf
        self.clock = ctx.clock
        self.sync = sync            # SyncEngine: emergency(), holdings(), enabled, display
        self.training = training    # Training: send_signal()
        self.hostname = hostname
        off = self.cfg.watch == ["none"]
        self.watcher = watcher if watcher is not None else (
            None if off else MetadataWatcher(self.cfg.watch, self.cfg.metadata_urls, self.cfg.timeout))
        self.env = dict(os.environ) if env is None else env
        self._stop = stop           # the one stop door (supervisor.stop): a notice is a `preemption` stop
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._decided = threading.Event()
        self._follower: threading.Thread | None = None
        self._next_detect = 0.0
        self._risk_key = ""
        self.active = False                        # a notice on this machine is being handled
        self.record: NoticeRecord | None = self._load()
        self.previous: NoticeRecord | None = None  # the record a boot told the owner about

    # --- boot -------------------------------------------------------------------------------------
    def boot(self) -> None:
        """At daemon start: tell the owner about a notice the previous machine got, or (same boot,
        its time not up: the daemon restarted mid-notice) go on with the emergency."""
        rec = self.record
        now = self.clock.time()
        action = next_boot(rec, self.clock.boot()[0], self.hostname, now)
        if rec is None or not action:
            return
        if action == "resume":
            log.warning("preemption_resumed", provider=rec.provider, deadline=rec.deadline)
            with self._lock:
                self.active = True
            self.sync.emergency()
            self._follow()
            return
        m = words.previous(rec.noticed_at, rec.provider, rec.kind, rec.detail, rec.hostname, rec.newest,
                           rec.newest_on_target, rec.made_it, rec.not_made, rec.outcome)
        self.ctx.alerts.event(f"preempted_previous:{int(rec.noticed_at)}", "preempted_previous",
                              Severity.WARNING, m.subject, m.body)
        rec.told_next_boot = True
        self.previous = rec
        self._save(rec)

    # --- the duty ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Ask the metadata services; act on a notice. Also keeps the record of an active notice fresh."""
        if self.active:
            self._check()
        w = self.watcher
        if w is None:
            return
        now = self.clock.time()
        if not self.cfg.watch and w.detected == [] and now >= self._next_detect:
            w.detected = None  # detect again
        if not self.cfg.watch and w.detected is None:
            self._next_detect = now + REDETECT_S
        for n in w.poll(now):
            self.notice(n)

    def notice(self, n: Notice) -> None:
        if not n.final:
            if self._risk_key != n.key:
                self._risk_key = n.key
                m = words.risk(n.provider, n.detail)
                self.ctx.alerts.event(f"preemption_risk:{n.key}", "preemption_risk", Severity.WARNING,
                                      m.subject, m.body)
                self.sync.request_sync()
            return
        with self._lock:
            if self.active:
                return
            self.active = True
            self._decided.clear()
        now = self.clock.time()
        deadline = n.deadline or now + TYPICAL_NOTICE_S.get(n.provider, self.cfg.sigterm_grace)
        rec = NoticeRecord(n.provider, n.kind, n.detail, now, deadline, self.clock.boot()[0], self.hostname)
        holdings = self._holdings()
        newest = newest_unit(holdings)
        rec.newest_at_notice = newest.unit if newest else ""
        tally(rec, holdings, now)
        self.record = rec
        self._save(rec)  # first: whatever happens next, the next boot knows
        log.warning("preemption_notice", provider=n.provider, kind=n.kind, deadline=deadline, detail=n.detail)
        sig = self.cfg.training_signal
        if sig:
            err = self.training.send_signal(signal.Signals[sig])
            rec.signal, rec.signal_error = ("", f"{sig} not sent: {err}") if err else (sig, "")
        self.sync.emergency()
        self._ask_stop(rec)
        m = words.notice(n.provider, n.kind, n.detail, now, deadline, rec.signal, rec.signal_error,
                         rec.newest_at_notice, bool(newest and newest.on_target), rec.not_made,
                         self.sync.display)
        self.ctx.alerts.event(f"preemption:{int(now)}", "preemption", Severity.CRITICAL, m.subject, m.body)
        self._save(rec)
        self._follow()

    def _ask_stop(self, rec: NoticeRecord) -> None:
        """Through the one door: the stop's final sync is the emergency sync, cut to the deadline."""
        if self._stop is None:
            return
        why = f"{rec.provider} {rec.kind} notice: the machine is taken at {when(rec.deadline)}"
        try:
            self._stop("preemption", why)
        except Exception:  # noqa: BLE001 - the notice's own handling goes on whatever the stop does
            log.exception("preemption_stop_request_failed")

    def moment(self) -> tuple[float | None, str]:
        """Seconds the preemption stop's final sync may still take (the deadline, less the time its
        mail and action need), and the deadline in words; (None, "") with no notice running."""
        rec = self.record
        if rec is None or not self.active:
            return None, ""
        return max(0.0, rec.deadline - ACTION_RESERVE_S - self.clock.time()), f"the notice's deadline {when(rec.deadline)}"

    # --- SIGTERM ----------------------------------------------------------------------------------
    def on_sigterm(self) -> bool:
        """The daemon got SIGTERM. True when it is (or joins) a notice: the caller then waits with
        wait_outcome() before exiting; False for a plain stop."""
        if self.active:
            return True
        host = container_host(self.env)
        watched = bool(self.watcher and self.watcher.detected)
        if not sigterm_is_notice(self.cfg.sigterm, systemd_stopping(), watched, host):
            return False
        why = f"SIGTERM to the daemon ({host} takes interruptible machines this way)" if host else \
            "SIGTERM to the daemon, not from systemd"
        self.notice(Notice("signal", "sigterm", self.clock.time() + self.cfg.sigterm_grace, why))
        return True

    def wait_outcome(self, interrupted: threading.Event | None = None) -> None:
        """Wait until the outcome is known (the sync done, or the deadline), or `interrupted`; an
        outcome not known by then is recorded as "exited" and mailed before the daemon goes."""
        while not self._decided.wait(FOLLOW_EVERY_S):
            if interrupted is not None and interrupted.is_set():
                break
        rec = self.record
        if rec is not None and not rec.outcome:
            self._decide(rec, "exited", self.clock.time())
        self.ctx.alerts.flush(5.0)

    # --- following the emergency sync -------------------------------------------------------------
    def _follow(self) -> None:
        if self._follower is not None and self._follower.is_alive():
            return
        self._follower = threading.Thread(target=self._follow_loop, name="preemption-follow", daemon=True)
        self._follower.start()

    def _follow_loop(self) -> None:
        while not self._closing.is_set() and not self._decided.is_set():
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the next look may work; the duty looks too
                log.exception("preemption_check_failed")
            self._closing.wait(FOLLOW_EVERY_S)

    def _check(self) -> None:
        rec = self.record
        if rec is None:
            return
        now = self.clock.time()
        holdings = self._holdings()
        with self._lock:
            before = dataclasses.asdict(rec)
            tally(rec, holdings, now)
            if rec.newest_on_target and before["newest_off_at"] is None:
                log.warning("preemption_newest_off", unit=rec.newest, after_s=round(now - rec.noticed_at, 1))
            result = "" if rec.outcome else outcome(rec, holdings, now)
            changed = dataclasses.asdict(rec) != before
        if result:
            self._decide(rec, result, now)
        elif changed:
            self._save(rec)

    def _decide(self, rec: NoticeRecord, result: str, now: float) -> None:
        with self._lock:
            if rec.outcome:
                return
            rec.outcome, rec.outcome_at = result, now
        log.warning("preemption_outcome", outcome=result, newest=rec.newest, newest_on_target=rec.newest_on_target,
                    made_it=len(rec.made_it), not_made=len(rec.not_made))
        self._save(rec)  # the outcome is on disk before the mail: the next boot must not have to guess
        m = words.outcome(rec.noticed_at, rec.deadline, result, now, rec.newest, rec.newest_on_target,
                          rec.made_it, rec.not_made, self.sync.display)
        self.ctx.alerts.event(f"preemption_outcome:{int(rec.noticed_at)}", "preemption_outcome",
                              Severity.CRITICAL if rec.not_made else Severity.WARNING, m.subject, m.body)
        rec.told = True
        self._save(rec)
        self._decided.set()

    def _holdings(self) -> list[Holding]:
        if not getattr(self.sync, "enabled", False):
            return []
        try:
            return self.sync.holdings()
        except Exception:  # noqa: BLE001 - a report must never stop the notice handling
            log.exception("preemption_holdings_failed")
            return []

    # --- status and state -------------------------------------------------------------------------
    def status(self) -> dict:
        w = self.watcher
        rec = self.record
        return {
            "watch": list(self.cfg.watch),
            "detected": list(w.detected) if w is not None and w.detected is not None else None,
            "error": (w.last_error or None) if w is not None else None,
            "training_signal": self.cfg.training_signal or None,
            "notice": dataclasses.asdict(rec) if rec is not None and self.active else None,
            "previous": dataclasses.asdict(self.previous) if self.previous is not None else None,
        }

    def close(self, timeout: float = 5.0) -> None:
        self._closing.set()
        f = self._follower
        if f is not None and f is not threading.current_thread():
            f.join(timeout)  # a decision under way finishes (its mail queued) before the daemon goes

    def _save(self, rec: NoticeRecord) -> None:
        try:
            self.ctx.store.save(STATE_NAME, dataclasses.asdict(rec))
        except OSError as e:
            log.error("preemption_record_not_saved", error=str(e))

    def _load(self) -> NoticeRecord | None:
        store = self.ctx.store
        d = store.load(STATE_NAME, None)
        if d is None:
            return None
        try:
            return records.load(NoticeRecord, d, str(store.path(STATE_NAME)))
        except ValueError as e:
            aside = set_aside(store.path(STATE_NAME))
            msg = f"{e}; set aside as {aside.name}"
            store.problems.append(msg)
            log.error("state_file_problem", problem=msg)
            return None

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        return (Duty("preemption", None if self.cfg.watch == ["none"] else self.cfg.poll_interval, self.poll),)

    def status_blocks(self) -> tuple[Block, ...]:
        return (PreemptionBlock.of(self.status()),)


def systemd_stopping() -> bool:
    """Is systemd stopping this service or the whole machine (so a SIGTERM is a plain stop)? Only
    where systemd is the init; when it cannot tell, it says yes: under systemd, SIGTERM is its."""
    if not os.path.isdir("/run/systemd/system"):
        return False
    try:
        def q(*args: str) -> str:
            return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=3).stdout.strip()

        if q("is-system-running") == "stopping":
            return True
        unit = unit_of_cgroup(Path("/proc/self/cgroup").read_text())
        if unit is None:
            return False  # not run as a service: a SIGTERM from systemd would be a machine stop, seen above
        return q("show", "-p", "ActiveState", "--value", unit) in ("deactivating", "inactive", "failed", "")
    except (OSError, subprocess.SubprocessError):
        return True
