"""Proving a local folder is safe off the machine, for the disk wing's prune: the target holds the
unit complete per its manifest (the ledger's manifest digest is of exactly these files, in these
versions) and a content check against the target passes right now, the same check the final sync
makes (`Target.missing` over every file with the fingerprint recorded at upload, and the
manifest). A mixin of SyncEngine: the check runs on the sync worker, the one thread that talks
to the target; callers wait on a ticket.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from supervisor.sync import final
from supervisor.sync._log import get_logger
from supervisor.sync.targets.base import TargetError
from supervisor.sync.waiter import Ticket, Waiters

log = get_logger("sync")

PROOF_GRACE_S = 5.0   # a caller waits this much past its timeout for the worker's answer


@dataclass(eq=False)
class ProofJob:
    paths: list[str]


def _answer(ok: bool, reason: str = "", unit: str = "", files: dict | None = None, at: float = 0.0) -> dict:
    return {"ok": ok, "reason": reason, "unit": unit, "files": files or {}, "checked_at": at}


class Proofs:
    _proofs: Waiters[ProofJob, dict]

    def prove_held(self, paths: list[str], timeout_s: float = 60.0) -> dict[str, dict]:
        """path -> {"ok", "reason", "unit" (the key on the target), "files" (rel -> [size, mtime_ns,
        inode] of exactly the files verified), "checked_at" (clock.time())}. ok only when the target
        was just seen to hold every file of the folder as uploaded, and its complete manifest."""
        norm = [os.path.normpath(p) for p in paths if p]
        if not norm:
            return {}
        if not self.enabled:
            return {p: _answer(False, "no sync target") for p in norm}
        if self._thread is None:
            return {p: _answer(False, "sync engine not started") for p in norm}
        t = self._proofs.open(ProofJob(norm))
        self._wake.set()
        r = self._proofs.wait(t, max(0.0, timeout_s) + PROOF_GRACE_S)
        if r is None:
            return {p: _answer(False, f"the content check did not finish within {timeout_s:g}s") for p in norm}
        return r

    def _answer_proofs(self) -> None:
        for t in self._proofs.tickets():
            self._proofs.settle(t, self._prove(t))

    def _close_proofs(self, error: str) -> None:
        self._proofs.close(lambda t: {p: _answer(False, error) for p in t.spec.paths})

    def _prove(self, t: Ticket) -> dict[str, dict]:
        now = self.clock.time()
        with self._lock:
            units = {u.abspath: u for u in self._units.values() if u.kind == "dir"}
            up = self._up
        out: dict[str, dict] = {}
        ask: dict[str, tuple] = {}
        for p in t.spec.paths:
            u = units.get(p)
            if u is None or up is None or self.ledger is None:
                out[p] = _answer(False, "not a folder the sync engine watches")
            elif not u.verdict.complete:
                out[p] = _answer(False, f"not complete here ({u.verdict.reason})", u.key)
            elif not up.held(u):
                out[p] = _answer(False, "the target does not hold it complete per its manifest yet", u.key)
            else:
                expected = final.expected([u], self.ledger.current)
                ask[p] = (u, {**expected, **final.manifest_keys({u.key})})
        for p, (u, expected) in ask.items():
            try:
                lost = self.target.missing(expected)
            except TargetError as e:
                out[p] = _answer(False, f"the target cannot be checked: {e}", u.key)
                continue
            if lost:
                log.warning("sync_proof_lost", unit=u.label, files=lost[:10], count=len(lost))
                final.forget_lost(self.ledger, lost, {u.key})
                with self._lock:
                    self._requested = True  # send what the target lost again
                out[p] = _answer(False, f"the target lost {len(lost)} file(s): {', '.join(lost[:3])}", u.key)
                continue
            files = {s.rel: [s.size, s.mtime_ns, s.ino] for s in u.selected}
            out[p] = _answer(True, "", u.key, files, now)
            log.info("sync_proof_ok", unit=u.label, files=len(files))
        return out
