"""Proving a local folder is safe off the machine, for the disk wing's prune: the target holds the
unit complete per its manifest (the ledger's manifest digest is of exactly these files, in these
versions) and a content check against the target passes right now, the same check the final sync
makes (`Target.missing` over every file with the fingerprint recorded at upload, and the
manifest). The engine's `prover`: it sees the engine through one snapshot (its units, uploader, ledger
and target, taken under the engine's lock) and asks it to send again what the target lost.

The check runs on the caller's thread, not the sync worker's: the worker may be in the middle of
a long upload (an 88 GiB checkpoint), and the disk must be freed before the next save, not after
that upload. `missing` only reads the target, and every target reads safely beside the worker (S3:
one thread-safe client; rsync: another ssh session over the same master; local: the filesystem;
the Hub: HTTP). The ledger is locked on its own. A file the target lost is forgotten at once and
the worker asked to send it again, as the final sync does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from supervisor.clock import Clock
from supervisor.store._log import get_logger
from supervisor.store.base import Target, TargetError
from supervisor.sync import final

if TYPE_CHECKING:
    from supervisor.sync import scan as sc
    from supervisor.sync.ledger import Ledger
    from supervisor.sync.upload import Uploader

log = get_logger("sync")


@dataclass(frozen=True)
class EngineView:
    """What a proof reads of the sync engine, taken at once under its lock."""

    units: dict[str, sc.Unit]          # folder units by their absolute path
    up: Uploader | None
    ledger: Ledger | None
    target: Target | None


def _answer(ok: bool, reason: str = "", unit: str = "", files: dict | None = None, at: float = 0.0) -> dict:
    return {"ok": ok, "reason": reason, "unit": unit, "files": files or {}, "checked_at": at}


class Prover:
    def __init__(self, view: Callable[[], EngineView | None], resend: Callable[[], None], clock: Clock):
        self.view = view        # None: the engine has no target
        self.resend = resend    # the engine sends again what the target lost
        self.clock = clock

    def prove_held(self, paths: list[str]) -> dict[str, dict]:
        """path -> {"ok", "reason", "unit" (the key on the target), "files" (rel -> [size, mtime_ns,
        inode, ctime_ns] of exactly the files verified), "checked_at" (clock.time() of the check)}. ok only
        when the target was just seen to hold every file of the folder as uploaded, and its
        complete manifest. Blocks on the target (a few requests per folder)."""
        norm = [os.path.normpath(p) for p in paths if p]
        if not norm:
            return {}
        v = self.view()
        if v is None or v.target is None:
            return {p: _answer(False, "no sync target") for p in norm}
        up = v.up
        out: dict[str, dict] = {}
        for p in norm:
            u = v.units.get(p)
            if u is None or up is None or v.ledger is None:
                out[p] = _answer(False, "not a folder the sync engine has seen")
            elif not u.verdict.complete:
                out[p] = _answer(False, f"not complete here ({u.verdict.reason})", u.key)
            elif not up.held(u):
                out[p] = _answer(False, "the target does not hold it complete per its manifest yet", u.key)
            else:
                out[p] = self._check(u, v.ledger, v.target)
        return out

    def _check(self, u: sc.Unit, ledger: Ledger, target: Target) -> dict:
        expected = {**final.expected([u], ledger.current), **final.manifest_keys(final.manifest_units([u]))}
        try:
            lost = target.missing(expected)
        except TargetError as e:
            return _answer(False, f"the target cannot be checked: {e}", u.key)
        except Exception as e:  # noqa: BLE001 - an odd failure of a target is a failed check, never a delete
            log.exception("sync_proof_failed", unit=u.label)
            return _answer(False, f"the target cannot be checked: {type(e).__name__}: {e}", u.key)
        if lost:
            log.warning("sync_proof_lost", unit=u.label, files=lost[:10], count=len(lost))
            final.forget_lost(ledger, lost, {u.key})
            self.resend()
            return _answer(False, f"the target lost {len(lost)} file(s): {', '.join(lost[:3])}", u.key)
        files: dict[str, list[int]] = {}
        for s in u.selected:
            # with the ctime: a file rewritten in place and its mtime set back (touch -d, cp -p,
            # rsync -t) keeps size, mtime and inode, never its ctime
            try:
                st = os.stat(s.path, follow_symlinks=False)
            except OSError as e:
                return _answer(False, f"{s.rel}: {e.strerror or e}", u.key)
            if (st.st_size, st.st_mtime_ns) != (s.size, s.mtime_ns) or (s.ino and st.st_ino != s.ino):
                return _answer(False, f"{s.rel} changed since the scan", u.key)
            files[s.rel] = [s.size, s.mtime_ns, st.st_ino, st.st_ctime_ns]
        log.info("sync_proof_ok", unit=u.label, files=len(files))
        return _answer(True, "", u.key, files, self.clock.time())
