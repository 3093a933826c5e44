"""Answering the callers who wait on the sync engine: `sync --wait`, the final sync before a stop,
`once`, and what made it off the machine (`holdings`, for a spot notice), and which units are here at all
(`held_units`, `held_parts`, for a cluster heartbeat): the engine's part `answers`. The decisions themselves are
final.py's and scan.py's, pure.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from supervisor.durations import format_duration
from supervisor.interfaces import FinalSyncResult, Holding
from supervisor.requests import sync_wait
from supervisor.saves.parts import Held
from supervisor.store._log import get_logger
from supervisor.store.base import TargetError
from supervisor.sync import final
from supervisor.sync import scan as sc
from supervisor.sync.final import FinalJob
from supervisor.sync.proof import EngineView
from supervisor.sync.waiter import Ticket, Waiters
from supervisor.training.checkpoints import unit_order

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from supervisor.clock import Clock
    from supervisor.store.base import Target
    from supervisor.sync.ledger import Ledger
    from supervisor.sync.lost import LostWatch
    from supervisor.sync.status import Board
    from supervisor.sync.targethealth import Health
    from supervisor.sync.upload import Uploader

log = get_logger("sync")

FINAL_GRACE_S = 5.0      # a final-sync caller waits this much past its timeout for the worker's answer


class Worker(Protocol):
    """What the answers read and ask of the engine (SyncEngine, which imports this module): its
    public state, read under `lock`, and the few things it does for them."""
    enabled: bool
    lock: AbstractContextManager
    thread: threading.Thread | None   # None: not started
    units: dict[sc.UnitKey, sc.Unit]  # the last scan's
    up: Uploader | None
    ledger: Ledger | None
    target: Target | None
    board: Board
    health: Health
    lost: LostWatch
    stats: dict
    clock: Clock
    display: str
    roots: list[sc.Root]
    extra_roots: list[sc.Root]        # folders a final sync named outside the watched ones
    passes: int                       # scans begun

    def request_sync(self) -> None: ...
    def reload_credentials(self) -> None: ...
    def start(self, watch: bool = True) -> None: ...
    def status(self) -> dict: ...
    def failed(self, error: str, cause: BaseException | None = None) -> None: ...
    def scan_again(self) -> None: ...


@dataclass(eq=False)
class IdleJob:
    after_pass: int      # answered after this pass (one that started after the call)
    started_ok: int      # uploaded count when it began
    # the units that pass found complete or about to be: what it waits for (a checkpoint the
    # training writes later is the next `sync --wait`'s, or a run would never let it return)
    want: frozenset[str] | None = None


class Answers:
    """The engine's callers and their answers: `sync --wait` and `once` (idle waits), the final sync
    before a stop, and what the engine holds (`holdings`, `held_units`, `unit_formats`). It owns the
    waiters; it reads the engine's units, ledger, target and board under the engine's lock."""

    def __init__(self, e: Worker):
        self.e = e
        self.finals: Waiters[FinalJob, FinalSyncResult] = Waiters()
        self.idle_waits: Waiters[IdleJob, FinalSyncResult] = Waiters()

    def proof_view(self) -> EngineView | None:
        """What a proof that a folder is safe off the machine reads (the disk wing's prune)."""
        if not self.e.enabled:
            return None
        with self.e.lock:
            units = {u.abspath: u for u in self.e.units.values() if u.kind == "dir"}
            return EngineView(units, self.e.up, self.e.ledger, self.e.target)

    def unit_formats(self, limit: int = 20) -> list[dict]:
        """Every unit here, newest first: the trainer's format it is judged by, complete or what it
        waits for (status --json sync.units)."""
        with self.e.lock:
            units = [(u.label, u.verdict) for u in self.e.units.values() if not u.retired]
        units.sort(key=lambda x: unit_order(x[0]), reverse=True)
        return [{"unit": k, "format": v.format or "files", "complete": v.complete,
                 "waiting_for": "" if v.complete else (v.waiting_for or v.reason.removeprefix("waiting for "))}
                for k, v in units[:limit]]

    def held_units(self, limit: int = 64) -> list[str]:
        """The units in the watched folders, complete or not, newest first (a cluster heartbeat
        says which units this node has a part of)."""
        with self.e.lock:
            keys = {u.key for u in self.e.units.values() if u.key}
        return sorted(keys, key=unit_order, reverse=True)[:limit]

    def held_parts(self, limit: int = 64) -> Held:
        """What a cluster heartbeat says of this node's units: nothing known before the first scan
        ended (a restarted daemon's first heartbeat must not read as "holds no part"); then the
        units here, newest first, each with its part's digest when the target holds it verified
        exactly as it is here; and the units deleted here before they were sent (sync/lost.py)."""
        with self.e.lock:
            if not self.e.stats.get("scans"):
                return Held(False)
            up = self.e.up
            pairs: dict[str, str] = {}
            for u in self.e.units.values():
                if not u.key:
                    continue
                d = ""
                if up is not None and self.e.ledger is not None and u.verdict.complete and up.synced(u):
                    m = self.e.ledger.manifest(u.key)
                    d = str((m or {}).get("digest") or "")
                pairs[u.key] = pairs.get(u.key) or ("" if d.startswith("damaged:") else d)
            lost = tuple(str(x.get("unit") or "") for x in self.e.lost.lost)
        keys = sorted(pairs, key=unit_order, reverse=True)[:limit]
        return Held(True, tuple((k, pairs[k]) for k in keys), tuple(x for x in lost if x))

    def wait_idle(self, timeout_s: float) -> FinalSyncResult:
        """Block until a full pass that started after this call has uploaded and verified every
        unit that was complete; ok=False with the error when that pass failed, or on timeout."""
        if not self.e.enabled:
            return FinalSyncResult(ok=True, target="")
        if self.e.thread is None:
            return self.result(False, 0, error="sync engine not started")
        with self.e.lock:
            t = self.idle_waits.open(IdleJob(self.e.passes + 1, self.e.board.uploaded_session))
        self.e.request_sync()
        return self.idle_answer(t, timeout_s)

    def once(self, timeout_s: float) -> FinalSyncResult:
        """A one-shot run (`python -m supervisor.sync --once`): start without inotify and answer
        as wait_idle does, after the first pass (wait_idle, called after start, may find that
        pass already begun and wait for a second one)."""
        if not self.e.enabled:
            return FinalSyncResult(ok=True, target="")
        with self.e.lock:
            t = self.idle_waits.open(IdleJob(self.e.passes + 1, self.e.board.uploaded_session))
        self.e.start(watch=False)
        return self.idle_answer(t, timeout_s)

    def final_sync(self, paths: list[str], timeout_s: float) -> FinalSyncResult:
        """Upload everything the policy selects under `paths`, regardless of the quiet period,
        then check on the target itself that it holds all of it. Retries with backoff until
        timeout_s. Never returns ok=True unless the target was seen to hold every file."""
        if not self.e.enabled:
            return FinalSyncResult(ok=True, target="")
        if self.e.thread is None:
            return self.result(False, 0, error="sync engine not started")
        norm = [os.path.normpath(p) for p in paths if p]
        with self.e.lock:
            for p in norm:
                root = sc.extra_root(p, self.e.roots, self.e.extra_roots)
                if root is not None:
                    self.e.extra_roots.append(root)
            t = self.finals.open(FinalJob(norm, self.e.clock.monotonic() + max(0.0, timeout_s),
                                            self.e.board.uploaded_session))
        self.e.request_sync()
        r = self.finals.wait(t, max(0.0, timeout_s) + FINAL_GRACE_S)
        if r is not None:
            return r
        with self.e.lock:
            return self.result(False, t.spec.started_ok, error="final sync timed out", unsynced=self.unsynced(norm))

    def holdings(self) -> list[Holding]:
        """Each folder unit of the last scan (checkpoint-N, adapters), newest first: complete here, and
        does the target hold it whole?"""
        with self.e.lock:
            units = [u for u in self.e.units.values() if u.kind == "dir" and u.selected and not u.retired]
            up = self.e.up
        out = [Holding(u.label, u.abspath, u.verdict.complete, bool(up and u.verdict.complete and up.synced(u)),
                       max((s.mtime_ns for s in u.selected), default=0) / 1e9, sum(s.size for s in u.selected),
                       u.verdict.reason, not u.verdict.complete and u.verdict.ready_in is not None)
               for u in units]
        return sorted(out, key=lambda h: h.mtime, reverse=True)

    def idle_answer(self, t: Ticket, timeout_s: float) -> FinalSyncResult:
        r = self.idle_waits.wait(t, timeout_s)
        if r is not None:
            return r
        with self.e.lock:
            err = self.e.board.last_error
            return self.result(False, t.spec.started_ok,
                                error=f"timed out after {format_duration(timeout_s)}{': ' + err if err else ''}",
                                unsynced=self.unsynced(None))

    # --- answering callers ------------------------------------------------------------------------
    def answer_all(self, error: str) -> None:
        def answer(t: Ticket) -> FinalSyncResult:
            with self.e.lock:
                return self.result(False, t.spec.started_ok, error=error)

        self.finals.close(answer)
        self.idle_waits.close(answer)

    def answer_idle_waits(self, error: str | None, pass_id: int) -> None:
        with self.e.lock:
            tickets = [t for t in self.idle_waits.tickets() if pass_id >= t.spec.after_pass]
            if not tickets:
                return
            assert self.e.up is not None
            units = list(self.e.units.values())
            for t in tickets:
                if t.spec.want is None:
                    t.spec.want = sc.wanted(units, self.e.up.synced)
                mine = [u for u in units if u.key in t.spec.want]
                err = error
                if err is None:
                    if sc.settling(mine, self.e.up.synced):
                        continue
                    err = "; ".join(sc.blocked(mine, self.e.up.synced)) or None
                if err is not None:
                    r = self.result(False, t.spec.started_ok, error=err, unsynced=self.unsynced(None))
                else:
                    r = self.result(True, t.spec.started_ok)
                self.idle_waits.settle(t, r)

    def expire_finals(self) -> None:
        now = self.e.clock.monotonic()
        with self.e.lock:
            for t in self.finals.tickets():
                if now >= t.spec.deadline:
                    why = self.e.board.last_error or "not all files on the target yet"
                    self.finals.settle(t, self.result(False, t.spec.started_ok, error=f"final sync timed out: {why}",
                                                        unsynced=self.unsynced(t.spec.paths)))

    def verify_finals(self) -> None:
        """For each final sync whose folders are fully uploaded, ask the target itself; once it
        holds everything, scan again, and answer ok only when that scan finds nothing new or
        changed (a checkpoint completed while the final sync ran goes up too)."""
        assert self.e.ledger is not None and self.e.target is not None and self.e.up is not None
        with self.e.lock:
            tickets = self.finals.tickets()
            units = list(self.e.units.values())
        for t in tickets:
            j = t.spec
            scope = sc.final_scope(units, j.paths)
            if not final.uploaded(scope, self.e.up.synced):
                continue  # still work to do (or failing); the next pass gets there
            expected = final.expected(scope, self.e.ledger.current)
            fp = final.fingerprint(scope)
            if j.verified == fp:
                with self.e.lock:
                    sent = self.e.board.uploaded_session - j.started_ok
                    r = final.verified(scope, expected, self.e.display, sent)
                    self.with_unselected(r)
                    self.finals.settle(t, r)
                log.info("sync_final_verified", paths=j.paths, files=len(expected))
                continue
            manifests = final.manifest_units(scope)
            deep = final.unchecked(expected, self.e.ledger.get)
            try:
                lost = self.e.target.missing({**expected, **final.manifest_keys(manifests)}, deep=deep)
            except TargetError as e:
                self.e.failed(f"verifying final sync: {e}", e)
                return
            with self.e.lock:
                self.e.health.recovered()  # the target answered
                self.e.scan_again()  # send what was lost, or scan once more for what is new
            if not lost:
                j.verified = fp
                self.e.ledger.checked(final.versions(deep, self.e.ledger.get), self.e.clock.time())
                log.info("sync_final_checked", by_content=len(deep), by_listing=len(expected) - len(deep))
                continue
            j.verify_rounds += 1
            log.warning("sync_final_verify_lost", files=lost[:10], count=len(lost), round=j.verify_rounds)
            final.forget_lost(self.e.ledger, lost, manifests)
            if j.verify_rounds >= final.VERIFY_ROUNDS:
                with self.e.lock:
                    self.finals.settle(t, self.result(False, j.started_ok, unsynced=lost,
                                                        error=f"target keeps losing files: {', '.join(lost[:5])}"))

    def result(self, ok: bool, started_ok: int, error: str = "", unsynced: list[str] | None = None) -> FinalSyncResult:
        files, nbytes = sc.held(self.e.units.values(), self.e.ledger.current, None) if self.e.ledger else (0, 0)
        r = FinalSyncResult(ok=ok, target=self.e.display, files=files, bytes=nbytes,
                               uploaded_files=self.e.board.uploaded_session - started_ok, error=error,
                               unsynced=list(unsynced or []),
                               unsynced_units=sc.unsynced_units(self.e.units.values(), self.e.ledger.current)
                               if unsynced and self.e.ledger else [],
                               newest=sc.newest_checkpoints(self.e.units.values()) if ok else [],
                               finals=sc.final_saves(self.e.units.values()) if ok else [])
        return self.with_unselected(r)

    def with_unselected(self, r: FinalSyncResult) -> FinalSyncResult:
        """What no include selects, named and counted in the answer (under the engine's lock)."""
        u = self.e.board.unselected_report
        r.unselected, r.unselected_files, r.unselected_bytes, r.unselected_hold = list(u.names), u.files, u.bytes, u.hold
        return r

    def unsynced(self, scope: list[str] | None) -> list[str]:
        return sc.unsynced(self.e.units.values(), self.e.ledger.current, scope) if self.e.ledger else []


    def on_request(self, a: dict) -> dict:
        """`supervisorctl sync [--wait]`: keys fixed meanwhile are used by this very sync."""
        timeout = sync_wait(a)  # checked before anything moves
        self.e.reload_credentials()
        self.e.request_sync()
        if timeout is None:
            return {"requested": True, "sync": self.e.status()}
        r = self.wait_idle(timeout)
        return {"ok": r.ok, "target": r.target, "files": r.files, "bytes": r.bytes, "uploaded_files": r.uploaded_files,
                "error": r.error, "unsynced": r.unsynced[:50], "unsynced_units": r.unsynced_units[:50],
                "unselected": r.unselected[:20], "unselected_files": r.unselected_files,
                "unselected_bytes": r.unselected_bytes, "unselected_newer": r.unselected_hold}
