"""The daemon's gate before a training start: with `resume.from_target` and no complete checkpoint
in the watched folders, the newest complete unit is restored from the target first (on a thread of
its own, so `supervisorctl start` answers at once and status shows the progress), then the training
starts with TRAIN_SUPERVISOR_RESUME_FROM pointing at it.

Target unreachable or refusing: never a silent fresh start. With if_unreachable = "wait" it retries
with backoff (shown in status, alerted); with "start_fresh" it alerts and starts from scratch. A
target that answers and holds no complete unit is a first run: it starts fresh and says so.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from supervisor.config.target import parse_target
from supervisor.interfaces import RequestError, Verb
from supervisor.notify.mails import resume as words
from supervisor.resume.local import newest_local
from supervisor.resume.restore import AllDamaged, NothingToRestore, Progress, Restorer, saved_epoch
from supervisor.resume.wholerun import run_parts
from supervisor.status import Block
from supervisor.status.resume import ResumeBlock
from supervisor.store import make_target
from supervisor.store._log import get_logger
from supervisor.store.base import TargetError
from supervisor.training.runner import RESUME_ENV

if TYPE_CHECKING:
    from supervisor.clock import Clock
    from supervisor.config import Config, ResumeConfig, SyncConfig
    from supervisor.notify.alerts import Alerts
    from supervisor.sync.engine import SyncEngine

log = get_logger("resume")

ENV = RESUME_ENV
RETRY_BASE_S = 10.0
RETRY_MAX_S = 300.0
ALERT_KEY = "resume:unreachable"


@dataclass(frozen=True)
class GateConfig:
    """What the resume gate reads of the config: its `[resume]` section, the `[sync]` section it restores
    from, and the few facts of others a restore needs."""

    resume: ResumeConfig
    sync: SyncConfig
    state_dir: str
    nodes: int = 1            # cluster.nodes: a run of several restores whole units only
    user: str = ""            # training.user: the restored files are the training's
    hostname: str = ""
    rank: int = 0             # cluster.rank: this node's part of the run's one unit
    key_file: str = ""        # cluster.key_file: the run-wide records are signed with it

    @classmethod
    def of(cls, c: Config) -> GateConfig:
        return cls(c.resume, c.sync, c.state_dir, c.cluster.nodes, c.training.user, c.hostname, c.cluster.rank or 0,
                   c.cluster.key_file)


class ResumeGate:
    """engine: the sync engine (its ledger, watched roots and target URL); alerts: Alerts or None."""

    def __init__(self, cfg: GateConfig, clock: Clock, alerts: Alerts, engine: SyncEngine, hostname: str = "",
                 retry_base_s: float = RETRY_BASE_S, run_target: str = "", busy: Callable[[], bool] | None = None):
        self.cfg = cfg
        self.run_target = run_target  # a run of several nodes: whole units only (their parts all complete)
        self.clock = clock
        self.alerts = alerts
        self.engine = engine
        self.hostname = hostname or cfg.hostname or socket.gethostname()
        self.retry_base_s = retry_base_s
        self.progress = Progress()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._st: dict[str, Any] = {"state": "idle"}
        # the training runs already (set by the daemon): then start() itself refuses, and no restore
        # may write into the folders under it
        self.busy: Callable[[], bool] = busy or (lambda: False)

    # --- what the training gets -----------------------------------------------------------------
    def local(self) -> tuple[str, int] | None:
        return newest_local([w for w in self.cfg.sync.watch if w], self.cfg.sync.complete_marker)

    def env(self) -> dict[str, str]:
        """TRAIN_SUPERVISOR_RESUME_FROM for every start when a complete checkpoint is here."""
        found = self.local()
        return {ENV: found[0]} if found else {}

    # --- the gate -------------------------------------------------------------------------------
    def gate(self, start: Callable[[], dict]) -> dict:
        if not self.cfg.resume.from_target or not self.engine.enabled or self.busy() or self.local() is not None:
            return start()
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RequestError("a restore from the target is under way; the training starts when it is done "
                                   "(see `supervisorctl status`)")
            self._set(state="restoring", error="", next_try_at=None)
            self._thread = threading.Thread(target=self._run, args=(start,), name="resume", daemon=True)
            self._thread.start()
        return {"state": "restoring", "resuming": True,
                "note": f"restoring the newest complete checkpoint from {self.engine.display}; "
                        "the training starts once it is verified"}

    def _run(self, start: Callable[[], dict]) -> None:
        attempt = 0
        unexpected = False
        while not self._closing.is_set():
            try:
                res = self._with(lambda rs: rs.restore())
            except AllDamaged as e:
                fresh = self.cfg.resume.if_unreachable == "start_fresh"
                log.error("resume_all_damaged", error=str(e), then="start fresh" if fresh else "not starting")
                if self.alerts is not None:
                    m = words.all_damaged(self.hostname, self.engine.display, str(e), fresh)
                    self.alerts.event(f"resume:damaged:{int(self.clock.time())}", "resume_damaged", "critical",
                                      m.subject, m.body)
                self._set(state="fresh" if fresh else "failed", error=str(e))
                if fresh:
                    self._start(start)
                return
            except NothingToRestore as e:
                log.info("resume_nothing_on_target", why=str(e))
                self._set(state="fresh", note=words.nothing_on_target(self.hostname, self.engine.display, str(e)))
                self._start(start)
                return
            except Exception as e:  # noqa: BLE001 - the thread must never die with status saying "restoring"
                if not isinstance(e, TargetError | OSError):
                    # a bug or a target's bytes no reader expected: said once, then handled like a
                    # target that cannot be read (the owner's if_unreachable decides: wait or fresh)
                    if not unexpected:
                        log.exception("resume_internal_error")
                    unexpected = True
                    e = TargetError(f"internal error while restoring: {type(e).__name__}: {str(e)[:200]}")
                attempt += 1
                delay = min(RETRY_MAX_S, self.retry_base_s * 2 ** (attempt - 1))
                fresh = self.cfg.resume.if_unreachable == "start_fresh"
                log.error("resume_target_unreachable", error=str(e), attempt=attempt,
                          then="start fresh" if fresh else f"retry in {delay:.0f}s")
                m = words.unreachable(self.hostname, self.engine.display, str(e), delay, self.cfg.resume.if_unreachable)
                if self.alerts is not None:
                    if fresh:
                        self.alerts.event(f"{ALERT_KEY}:fresh", "resume_unreachable", "critical", m.subject, m.body)
                    else:
                        self.alerts.fire(ALERT_KEY, "resume_unreachable", "critical", m.subject, m.body)
                if fresh:
                    self._set(state="fresh", error=str(e), note="target unreachable; started fresh")
                    self._start(start)
                    return
                self._set(state="waiting", error=str(e), attempts=attempt,
                          next_try_at=self.clock.time() + delay, wait_s=delay)
                if self._closing.wait(delay):
                    return
                self._set(state="restoring", next_try_at=None)
                continue
            if self.alerts is not None:
                self.alerts.resolve(ALERT_KEY)
            r = words.Resumed(self.hostname, res.unit.name, res.unit.step, res.unit.max_steps, saved_epoch(res.unit),
                              res.unit.host, self.clock.time(), res.path, res.bytes, res.seconds,
                              tuple((u.key, u.why) for u in res.skipped), tuple(res.fallbacks))
            mail = words.resumed(r)
            self._set(state="done", result=res.to_json(), line=words.resumed_line(r), error="", next_try_at=None)
            if self.alerts is not None:
                self.alerts.event(f"resume:done:{res.unit.key}:{int(self.clock.time())}", "resumed", "info",
                                  mail.subject, mail.body)
            self._start(start)
            return

    def _start(self, start: Callable[[], dict]) -> None:
        try:
            start()
        except Exception as e:  # noqa: BLE001 - the status says why the training did not start
            log.error("resume_start_failed", error=str(e))
            self._set(error=f"training did not start: {e}")

    # --- on demand (supervisorctl resume) -------------------------------------------------------
    def request(self, a: dict) -> Any:
        """`supervisorctl resume --list` / `resume [--checkpoint NAME] [--dry-run]` over the socket."""
        try:
            if a.get("list"):
                return self.units()
            if not a.get("dry_run") and self.busy():
                raise RequestError("the training is running: stop it before restoring a checkpoint under it")
            name = a.get("checkpoint")
            return self.restore_now(str(name) if name else None, bool(a.get("dry_run")))
        except TargetError as e:
            raise RequestError(str(e)) from None

    def units(self) -> dict:
        sv = self._with(lambda rs: rs.survey(), record=False)
        return {"target": self.engine.display, "units": [u.to_json() for u in sv.units],
                "newest_complete": sv.order[0].key if sv.order else None}

    def restore_now(self, checkpoint: str | None, dry_run: bool) -> dict:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RequestError("a restore is already under way")
        try:
            if dry_run:
                return self._with(lambda rs: rs.restore(checkpoint, dry_run=True), record=False).to_json()
            self._set(state="restoring", error="")
            res = self._with(lambda rs: rs.restore(checkpoint))
        except NothingToRestore as e:
            self._set(state="idle")
            raise RequestError(str(e)) from None
        except (TargetError, OSError) as e:
            self._set(state="failed", error=str(e))
            raise RequestError(f"restore failed: {e}") from None
        self._set(state="done", result=res.to_json(), error="")
        return res.to_json()

    def _with(self, fn: Callable[[Restorer], Any], record: bool = True) -> Any:
        """fn on a Restorer over a target of its own (one client for the whole restore), closed after."""
        if not self.engine.enabled:
            raise RequestError("no sync.target configured: nothing to resume from")
        url = self.engine.url
        target = make_target(url, self.cfg.sync, self.cfg.state_dir)
        try:
            run = run_parts(self.run_target, self.cfg.nodes, self.cfg.rank, self.cfg.key_file,
                            lambda u: make_target(parse_target(u), self.cfg.sync, self.cfg.state_dir))
        except TargetError:
            target.close()
            raise
        try:
            return fn(Restorer(target, self.engine.ledger if record else None, list(self.engine.roots),
                               self.clock.time, etag_is_sha=url.kind in ("local", "rsync"), progress=self.progress,
                               user=self.cfg.user, run=run))
        finally:
            target.close()
            if run is not None:
                run.close()

    # --- status ---------------------------------------------------------------------------------
    def _set(self, **kw: Any) -> None:
        with self._lock:
            self._st.update(kw)
            self._st["since"] = time.time()

    def status(self) -> dict:
        with self._lock:
            st = dict(self._st)
        found = self.local()
        out: dict[str, Any] = {"enabled": bool(self.cfg.resume.from_target), "state": st.get("state", "idle"),
                               "if_unreachable": self.cfg.resume.if_unreachable,
                               "resume_from": found[0] if found else None}
        for k in ("error", "note", "line", "result", "attempts", "wait_s"):
            if st.get(k):
                out[k] = st[k]
        if st.get("next_try_at"):
            out["next_try_at"] = st["next_try_at"]
            out["next_try_in_s"] = max(0.0, round(st["next_try_at"] - self.clock.time(), 1))
        if st.get("state") == "restoring":
            out["progress"] = self.progress.to_json()
        return out

    def close(self) -> None:
        self._closing.set()

    def status_blocks(self) -> tuple[Block, ...]:
        return (ResumeBlock.of(self.status()),)

    def verbs(self) -> dict[str, Verb]:
        return {"resume": self.request}  # root only: restores files under the watch folders
