"""Answering the callers who wait on the sync engine: `sync --wait`, the final sync before a stop,
`once`, and what made it off the machine (`holdings`, for a spot notice), and which units are here at all
(`held_units`, for a cluster heartbeat). A mixin of SyncEngine (it reads the engine's units, ledger, target and board under the
engine's lock); the decisions themselves are final.py's and scan.py's, pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from supervisor.durations import format_duration
from supervisor.interfaces import FinalSyncResult
from supervisor.requests import sync_wait
from supervisor.sync import final
from supervisor.sync import scan as sc
from supervisor.sync._log import get_logger
from supervisor.sync.targets.base import Target, TargetError
from supervisor.sync.waiter import Ticket
from supervisor.training.checkpoints import unit_order

if TYPE_CHECKING:
    from supervisor.sync.engine import SyncEngine

log = get_logger("sync")


@dataclass(eq=False)
class IdleJob:
    after_pass: int      # answered after this pass (one that started after the call)
    started_ok: int      # uploaded count when it began
    # the units that pass found complete or about to be: what it waits for (a checkpoint the
    # training writes later is the next `sync --wait`'s, or a run would never let it return)
    want: frozenset[str] | None = None


class Answers:
    def sibling_target(self, where: str) -> Target:
        """Another place on the same store (the run's prefix, its ledger) for a wing that keeps a
        client open: built from this engine's credential sources, so keys written down after the
        daemon started (the environment file the engine watches) reach it too."""
        from supervisor.sync.targets import make_target
        from supervisor.syncurl import parse_target

        return make_target(parse_target(where), self.cfg, self.state_dir, self.access.creds)

    def fs_events(self, fn: Callable[[str], None]) -> bool:
        """Tell `fn` of every change under the watched folders, from this engine's own watcher
        (the disk wing needs no second one); False when the engine watches nothing."""
        if self._watcher is None:
            return False
        self._watcher.also(fn)
        return True

    def unit_formats(self, limit: int = 20) -> list[dict]:
        """Every unit here, newest first: the trainer's format it is judged by, complete or what it
        waits for (status --json sync.units)."""
        with self._lock:
            units = [(u.label, u.verdict) for u in self._units.values() if not u.retired]
        units.sort(key=lambda x: unit_order(x[0]), reverse=True)
        return [{"unit": k, "format": v.format or "files", "complete": v.complete,
                 "waiting_for": "" if v.complete else (v.waiting_for or v.reason.removeprefix("waiting for "))}
                for k, v in units[:limit]]

    def held_units(self, limit: int = 64) -> list[str]:
        """The units in the watched folders, complete or not, newest first (a cluster heartbeat
        says which units this node has a part of)."""
        with self._lock:
            keys = {u.key for u in self._units.values() if u.key}
        return sorted(keys, key=unit_order, reverse=True)[:limit]

    def wait_idle(self, timeout_s: float) -> FinalSyncResult:
        """Block until a full pass that started after this call has uploaded and verified every
        unit that was complete; ok=False with the error when that pass failed, or on timeout."""
        if not self.enabled:
            return FinalSyncResult(ok=True, target="")
        if self._thread is None:
            return self._result(False, 0, error="sync engine not started")
        with self._lock:
            t = self._idle_waits.open(IdleJob(self._pass + 1, self.board.uploaded_session))
        self.request_sync()
        return self._idle_answer(t, timeout_s)

    def once(self, timeout_s: float) -> FinalSyncResult:
        """A one-shot run (`python -m supervisor.sync --once`): start without inotify and answer
        as wait_idle does, after the first pass (wait_idle, called after start, may find that
        pass already begun and wait for a second one)."""
        if not self.enabled:
            return FinalSyncResult(ok=True, target="")
        with self._lock:
            t = self._idle_waits.open(IdleJob(self._pass + 1, self.board.uploaded_session))
        self.start(watch=False)
        return self._idle_answer(t, timeout_s)

    def holdings(self) -> list[dict]:
        """Each folder unit of the last scan (checkpoint-N, adapters): complete here, and does the
        target hold it whole? What a preemption notice reports as made off the machine or not."""
        with self._lock:
            units = [u for u in self._units.values() if u.kind == "dir" and u.selected and not u.retired]
            up = self._up
        out = []
        for u in units:
            newest = max((s.mtime_ns for s in u.selected), default=0)
            out.append({"unit": u.label, "path": u.abspath, "complete": u.verdict.complete,
                        "reason": u.verdict.reason, "on_target": bool(up and u.verdict.complete and up.synced(u)),
                        "settling": not u.verdict.complete and u.verdict.ready_in is not None,
                        "bytes": sum(s.size for s in u.selected), "mtime": newest / 1e9})
        return sorted(out, key=lambda h: h["mtime"], reverse=True)

    def _idle_answer(self, t: Ticket, timeout_s: float) -> FinalSyncResult:
        r = self._idle_waits.wait(t, timeout_s)
        if r is not None:
            return r
        with self._lock:
            err = self.board.last_error
            return self._result(False, t.spec.started_ok,
                                error=f"timed out after {format_duration(timeout_s)}{': ' + err if err else ''}",
                                unsynced=self._unsynced(None))

    # --- answering callers ------------------------------------------------------------------------
    def _answer_all(self, error: str) -> None:
        def answer(t: Ticket) -> FinalSyncResult:
            with self._lock:
                return self._result(False, t.spec.started_ok, error=error)

        self._finals.close(answer)
        self._idle_waits.close(answer)

    def _answer_idle_waits(self, error: str | None, pass_id: int) -> None:
        with self._lock:
            tickets = [t for t in self._idle_waits.tickets() if pass_id >= t.spec.after_pass]
            if not tickets:
                return
            assert self._up is not None
            units = list(self._units.values())
            for t in tickets:
                if t.spec.want is None:
                    t.spec.want = sc.wanted(units, self._up.synced)
                mine = [u for u in units if u.key in t.spec.want]
                err = error
                if err is None:
                    if sc.settling(mine, self._up.synced):
                        continue
                    err = "; ".join(sc.blocked(mine, self._up.synced)) or None
                if err is not None:
                    r = self._result(False, t.spec.started_ok, error=err, unsynced=self._unsynced(None))
                else:
                    r = self._result(True, t.spec.started_ok)
                self._idle_waits.settle(t, r)

    def _expire_finals(self) -> None:
        now = self.clock.monotonic()
        with self._lock:
            for t in self._finals.tickets():
                if now >= t.spec.deadline:
                    why = self.board.last_error or "not all files on the target yet"
                    self._finals.settle(t, self._result(False, t.spec.started_ok, error=f"final sync timed out: {why}",
                                                        unsynced=self._unsynced(t.spec.paths)))

    def _verify_finals(self) -> None:
        """For each final sync whose folders are fully uploaded, ask the target itself; once it
        holds everything, scan again, and answer ok only when that scan finds nothing new or
        changed (a checkpoint completed while the final sync ran goes up too)."""
        assert self.ledger is not None and self.target is not None and self._up is not None
        with self._lock:
            tickets = self._finals.tickets()
            units = list(self._units.values())
        for t in tickets:
            j = t.spec
            scope = sc.final_scope(units, j.paths)
            if not final.uploaded(scope, self._up.synced):
                continue  # still work to do (or failing); the next pass gets there
            expected = final.expected(scope, self.ledger.current)
            fp = final.fingerprint(scope)
            if j.verified == fp:
                with self._lock:
                    sent = self.board.uploaded_session - j.started_ok
                    r = final.verified(scope, expected, self.display, sent)
                    r.unselected = list(self.board.unselected)
                    self._finals.settle(t, r)
                log.info("sync_final_verified", paths=j.paths, files=len(expected))
                continue
            manifests = final.manifest_units(scope)
            deep = final.unchecked(expected, self.ledger.get)
            try:
                lost = self.target.missing({**expected, **final.manifest_keys(manifests)}, deep=deep)
            except TargetError as e:
                self._failed(f"verifying final sync: {e}", e)
                return
            with self._lock:
                self.health.recovered()  # the target answered
                self._requested = True  # send what was lost, or scan once more for what is new
            if not lost:
                j.verified = fp
                self.ledger.checked(final.versions(deep, self.ledger.get), self.clock.time())
                log.info("sync_final_checked", by_content=len(deep), by_listing=len(expected) - len(deep))
                continue
            j.verify_rounds += 1
            log.warning("sync_final_verify_lost", files=lost[:10], count=len(lost), round=j.verify_rounds)
            final.forget_lost(self.ledger, lost, manifests)
            if j.verify_rounds >= final.VERIFY_ROUNDS:
                with self._lock:
                    self._finals.settle(t, self._result(False, j.started_ok, unsynced=lost,
                                                        error=f"target keeps losing files: {', '.join(lost[:5])}"))

    def _result(self, ok: bool, started_ok: int, error: str = "", unsynced: list[str] | None = None) -> FinalSyncResult:
        files, nbytes = sc.held(self._units.values(), self.ledger.current, None) if self.ledger else (0, 0)
        return FinalSyncResult(ok=ok, target=self.display, files=files, bytes=nbytes,
                               uploaded_files=self.board.uploaded_session - started_ok, error=error,
                               unsynced=list(unsynced or []),
                               unsynced_units=sc.unsynced_units(self._units.values(), self.ledger.current)
                               if unsynced and self.ledger else [], unselected=list(self.board.unselected),
                               newest=sc.newest_checkpoints(self._units.values()) if ok else [],
                               finals=sc.final_saves(self._units.values()) if ok else [])

    def _unsynced(self, scope: list[str] | None) -> list[str]:
        return sc.unsynced(self._units.values(), self.ledger.current, scope) if self.ledger else []


def on_sync_request(engine: SyncEngine, a: dict) -> dict:
    """`supervisorctl sync [--wait]`: keys fixed meanwhile are used by this very sync."""
    timeout = sync_wait(a)  # checked before anything moves
    engine.reload_credentials()
    engine.request_sync()
    if timeout is None:
        return {"requested": True, "sync": engine.status()}
    r = engine.wait_idle(timeout)
    return {"ok": r.ok, "target": r.target, "files": r.files, "bytes": r.bytes, "uploaded_files": r.uploaded_files,
            "error": r.error, "unsynced": r.unsynced[:50], "unsynced_units": r.unsynced_units[:50]}
