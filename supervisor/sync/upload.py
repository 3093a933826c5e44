"""Getting units onto the target: the files first, each recorded in the ledger as the target
confirms it, then the folder's manifest, last; keep_last's deletions after a folder completed.
Raises TargetError when the target fails (the engine backs off); a problem with one source file
(vanished, changed, unreadable) is reported and the unit waits for the next scan.

A target that lands whole units in one step (the Hub: files and `_MANIFEST.json` of several
folders in one commit, see targets.base.put_units) gets the folders of a pass together, and the
ledger records the commit that holds each one."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from supervisor.clock import Clock
from supervisor.saves.snapshot import Snapshots, SnapshotTarget
from supervisor.store._log import get_logger
from supervisor.store.base import (
    LocalFile,
    SourceProblem,
    Target,
    TargetError,
    UnitPut,
    Uploaded,
    check_unchanged,
    open_source,
    pread_exact,
    put_units,
    read_manifest,
)
from supervisor.sync import follow, retention
from supervisor.sync import manifest as mf
from supervisor.sync.ledger import Entry, Ledger
from supervisor.sync.scan import Selected, Unit, batches, files_synced, needs_manifest, wants_manifest
from supervisor.sync.scan import together as together_
from supervisor.sync.status import Board
from supervisor.sync.targethealth import AlertSink, Behind
from supervisor.training.checkpoints import checkpoint_step, named_step

if TYPE_CHECKING:
    from supervisor.config import SyncConfig

UNITS_PER_PUT = 32              # folders landed together at most (one commit on the Hub)
BYTES_PER_PUT = 8 << 30         # ... and at most this much new content, so progress is committed often

log = get_logger("sync")


class Uploader:
    def __init__(self, target: Target, ledger: Ledger, board: Board, clock: Clock, hostname: str,
                 keep: SyncConfig, closing: threading.Event, alerts: AlertSink | None = None, state_dir: str = "",
                 step_at: Callable[[float], int | None] | None = None):
        self.step_at = step_at  # the training's step at a wall time (the progress wing), for step_seen
        # a single file rewritten as it goes up is sent from a snapshot taken when it was whole
        self.snaps = Snapshots(state_dir, Behind(board, alerts, getattr(target, "display", "")))
        self.target = SnapshotTarget(target, self.snaps)
        self.ledger = ledger
        self.board = board
        self.clock = clock
        self.hostname = hostname
        self.keep_last = keep.keep_last
        self.follow_deletions = keep.follow_deletions  # the target follows the trainer's rotation (follow.py)
        self.closing = closing
        # folders go up whole, manifest in the same step (the Hub's commits), not file by file; a
        # target only says so when that step is atomic (rsync's put_units is two runs: it streams)
        self.whole_units = bool(getattr(target, "lands_units", False))
        self._finishing = threading.Lock()

    # --- what the target holds ------------------------------------------------------------------
    def synced(self, u: Unit) -> bool:
        """Every selected file of the unit is on the target, and the manifest it needs there
        describes exactly these files."""
        if not files_synced(u, self.ledger.current):
            return False
        if needs_manifest(u):
            m = self.ledger.manifest(u.key)
            return m is not None and m.get("digest") == self._digest(u)
        return True

    def held(self, u: Unit) -> bool:
        """The target holds the unit exactly as it is here: every selected file in this version
        (size, mtime and inode as sent) and, for a folder or a checkpoint file, its complete
        manifest of these files. Decided from the ledger alone: the scan then judges nothing and
        opens no file."""
        files = self._listed(u, same_inode=True)
        if files is None or not wants_manifest(u):
            return files is not None
        m = self.ledger.manifest(u.key)
        return m is not None and m.get("digest") == mf.digest(files)

    def _listed(self, u: Unit, same_inode: bool = False) -> list[mf.ManifestFile] | None:
        """The unit's files as the ledger records them on the target; None when one is not there
        in this version."""
        files = []
        for s in u.selected:
            e = self.ledger.current(s.key, s.size, s.mtime_ns, s.ino if same_inode else 0, s.ctime_ns)
            if e is None:
                return None
            files.append(mf.ManifestFile(s.rel, s.size, e.sha256))
        return files

    def _digest(self, u: Unit) -> str | None:
        """What the ledger records for the unit's manifest: a partial one never passes for complete."""
        files = self._listed(u)
        return None if files is None else _ledger_digest(files, u.verdict.complete)

    def _todo(self, selected: list[Selected]) -> list[Selected]:
        return [s for s in selected if self.ledger.current(s.key, s.size, s.mtime_ns, ctime_ns=s.ctime_ns) is None]

    # --- sending --------------------------------------------------------------------------------
    def batches(self, work: list[Unit], together: bool = True) -> list[list[Unit]]:
        """The pass's work in sending order (scan.batches, newest first). Folders that follow each
        other go in one batch: for a target that lands whole units, one commit (within
        UNITS_PER_PUT and BYTES_PER_PUT); for the others, one stream of files (scan.together).
        together=False (a spot notice): one folder at a time, so the newest is whole first."""
        plain = batches(work)
        if not together:
            return plain
        if not self.whole_units:
            return together_(plain)
        out: list[list[Unit]] = []
        size = 0
        for b in plain:
            dirs = out and out[-1][0].kind == "dir" and b[0].kind == "dir"
            new = sum(s.size for u in b for s in self._todo(u.selected))
            if dirs and len(out[-1]) + len(b) <= UNITS_PER_PUT and size + new <= BYTES_PER_PUT:
                out[-1].extend(b)
                size += new
            else:
                out.append(list(b))
                size = new
        return out

    def send(self, batch: list[Unit]) -> bool:
        """One batch of batches(); False when a source file had a problem (rescan soon). Single
        files rewritten in place or by rename go from a snapshot (snapshot.py), taken first."""
        self.snaps.take(batch, self.ledger.current)
        try:
            if batch[0].kind == "dir" and self.whole_units:
                return self.commit_units(batch)
            if len(batch) > 1 and all(u.kind == "file" for u in batch):
                return self.files(batch)
            return self.units(batch)
        finally:
            self.snaps.release()

    def commit_units(self, batch: list[Unit]) -> bool:
        """Folders landed together: their new files and their manifests in one step (one Hub
        commit), so a folder on the target is complete by construction. A folder with a problem
        file gets no manifest and waits for the next scan."""
        puts, plans = [], {}
        for u in batch:
            todo = self._todo(u.selected)
            if self.ledger.manifest(u.key) is not None and todo:
                # changed since its manifest: withdraw that first, so the Hub never shows the old
                # manifest over new files should this step stop half way
                self.target.delete_manifest(u.key)
                self.ledger.manifest_forget(u.key)
            if todo:
                log.info("sync_unit_upload", unit=u.label, files=len(todo), bytes=sum(s.size for s in todo),
                         forced=u.forced, partial=u.verdict.partial)
            builder = self._builder(u) if needs_manifest(u) else None
            plans[u.key] = u
            puts.append(UnitPut(u.key, [LocalFile(s.path, s.key, s.size, s.mtime_ns, s.ino, s.ctime_ns) for s in todo],
                                builder))
        sink = _Sink(self)
        res = put_units(self.target, puts, sink)
        for key in res.manifests:
            u = plans[key]
            d = self._digest(u)
            if d is None:
                continue  # cannot happen: the files it lists were reported done first
            self.ledger.manifest_done(u.key, d, self.clock.time(), commit=res.commits.get(key, ""))
            log.info("sync_unit_complete" if u.verdict.complete else "sync_unit_damaged_manifest", unit=u.label,
                     files=len(u.selected), bytes=sum(s.size for s in u.selected),
                     commit=res.commits.get(key) or None)
        self.ledger.sync()
        for u in batch:
            if u.verdict.partial and files_synced(u, self.ledger.current):
                self.board.add_partial(u.label)
                log.warning("sync_unit_partial", unit=u.label, reason=u.verdict.reason,
                            damaged=list(u.verdict.damaged))
            if sink.problems and not os.path.exists(u.abspath):
                log.info("sync_unit_vanished", unit=u.label, note="rotated away locally before it was whole "
                         "on the target; no manifest written")
        for key in res.manifests:
            u = plans[key]
            if u.verdict.complete and checkpoint_step(u.rel) is not None:
                self._keep_last(u)
            if u.verdict.complete:
                self._follow(u)
        return not sink.problems

    def _builder(self, u: Unit) -> Callable[[dict[str, Uploaded]], bytes | None]:
        """The unit's manifest from the sha256s the target reports for the files sent now and the
        ledger's for the ones it held already."""
        def build(results: dict[str, Uploaded]) -> bytes | None:
            files = []
            for s in u.selected:
                r = results.get(s.key)
                if r is not None:
                    files.append(mf.ManifestFile(s.rel, s.size, r.sha256))
                    continue
                e = self.ledger.current(s.key, s.size, s.mtime_ns, ctime_ns=s.ctime_ns)
                if e is None:
                    return None
                files.append(mf.ManifestFile(s.rel, s.size, e.sha256))
            return self._manifest_bytes(u, files)

        return build

    def _manifest_bytes(self, u: Unit, files: list[mf.ManifestFile]) -> bytes:
        v = u.verdict
        return mf.build(u.rel or os.path.basename(u.root.path), files, self.clock.time(), self.hostname,
                        source=u.abspath, damaged=v.damaged, partial="" if v.complete else v.reason,
                        trainer=(facts := sent_trainer_facts(u, files)), kind=u.kind,
                        links=links_to(u.abspath) if u.kind == "file" else (),
                        step_seen=self._step_seen(u) if facts is None else None)

    def _step_seen(self, u: Unit) -> int | None:
        """The training's step when the unit was saved (its newest file's mtime), as the progress
        wing read it, for a save whose name states none (`ckpt.pt`, `last.ckpt`, Accelerate's
        `checkpoint_7`): a restore then ranks it by a step, before any time. None when not known."""
        if self.step_at is None or named_step(os.path.basename(u.rel or u.root.path)) is not None:
            return None
        newest = max((s.mtime_ns for s in u.selected), default=0) / 1e9
        try:
            return self.step_at(newest) if newest else None
        except Exception:  # noqa: BLE001 - a figure for the manifest never fails the upload
            log.exception("sync_step_seen_failed", unit=u.label)
            return None

    def unit(self, u: Unit) -> bool:
        """Upload one folder unit (or one single-file unit); False when a source file had a
        problem (rescan soon)."""
        return self.units([u])

    def units(self, units: list[Unit]) -> bool:
        """Upload folder units (or single-file units) as one stream of files, unit after unit
        with no pause between them; each unit's manifest is written the moment its last file
        is on the target (from the target's thread), so the first unit is complete long before
        the last. False when a source file had a problem (rescan soon)."""
        plan: list[tuple[Unit, list[Selected]]] = []
        for u in units:
            todo = self._todo(u.selected)
            if u.kind == "dir" and self.ledger.manifest(u.key) is not None and todo:
                # the folder changed since its manifest: it is not complete on the target until
                # the new files and a new manifest are there. (A single file's new version replaces
                # its object whole: until then its manifest vouches for the old one, still there.)
                self.target.delete_manifest(u.key)
                self.ledger.manifest_forget(u.key)
            if todo:
                log.info("sync_unit_upload", unit=u.label, files=len(todo), bytes=sum(s.size for s in todo),
                         forced=u.forced, partial=u.verdict.partial)
            plan.append((u, sorted(todo, key=lambda s: -s.size)))  # the largest first: no long tail
        sink = _UnitsSink(self, plan)
        for u, todo in plan:
            if not todo:
                self._finish(u, maybe_there=True)
        files = [LocalFile(s.path, s.key, s.size, s.mtime_ns, s.ino, s.ctime_ns) for _u, todo in plan for s in todo]
        if files:
            self.target.put_files(files, sink)
        for u, _todo in plan:
            if u.label in sink.failed and not os.path.exists(u.abspath):
                log.info("sync_unit_vanished", unit=u.label, note="rotated away locally before it was whole "
                         "on the target; no manifest written")
        return not sink.problems

    def _finish(self, u: Unit, maybe_there: bool = False) -> None:
        """Every file of the unit is on the target: its manifest now (serialised: the target's
        threads may finish several units at once). maybe_there: every file was on the target
        before this pass, so a daemon killed between the manifest's write and its ledger record
        may have left exactly this manifest there."""
        with self._finishing:
            if u.verdict.partial:
                self.board.add_partial(u.label)
                log.warning("sync_unit_partial", unit=u.label, reason=u.verdict.reason,
                            damaged=list(u.verdict.damaged),
                            note="uploaded with a manifest naming its damaged files" if needs_manifest(u)
                            else "uploaded without a manifest")
            if needs_manifest(u):
                self._manifest(u, maybe_there)

    def files(self, units: list[Unit]) -> bool:
        """Single-file units of one root in one batch (one rsync run, one pool of puts); then the
        manifest beside each checkpoint file that is on the target now."""
        todo = self._todo([s for u in units for s in u.selected])
        sink = _Sink(self)
        if todo:
            log.info("sync_files_upload", files=len(todo), bytes=sum(s.size for s in todo), root=units[0].root.path)
            self.target.put_files([LocalFile(s.path, s.key, s.size, s.mtime_ns, s.ino, s.ctime_ns) for s in todo], sink)
        sent = {s.key for s in todo}
        for u in units:
            if (needs_manifest(u) or u.verdict.partial) and files_synced(u, self.ledger.current):
                self._finish(u, maybe_there=not any(s.key in sent for s in u.selected))
        return not sink.problems

    def _manifest(self, u: Unit, maybe_there: bool = False) -> None:
        """Write the folder's manifest (last), once every file is on the target."""
        files = self._listed(u)
        if files is None:
            return
        v = u.verdict
        d = _ledger_digest(files, v.complete)
        m = self.ledger.manifest(u.key)
        if m is not None and m.get("digest") == d:
            return
        kept = m is None and maybe_there and self._there_already(u, d)
        if not kept:
            self.target.write_manifest(u.key, self._manifest_bytes(u, files), u.kind)
        self.ledger.manifest_done(u.key, d, self.clock.time())
        self.ledger.sync()
        log.info("sync_unit_complete" if v.complete else "sync_unit_damaged_manifest", unit=u.label,
                 files=len(files), bytes=sum(f.size for f in files),
                 **({"note": "its manifest was on the target already"} if kept else {}))
        if v.complete and checkpoint_step(u.rel) is not None:
            self._keep_last(u)
        if v.complete:
            self._follow(u)

    def _there_already(self, u: Unit, d: str) -> bool:
        """The target holds a manifest for the unit that says exactly what this one would (same
        files and sha256s, same complete or damaged verdict): it need not be sent again."""
        try:
            data = read_manifest(self.target, u.key, u.kind)
            if data is None:
                return False
            doc, files = mf.parse_doc(data)
        except (TargetError, ValueError) as e:
            log.info("sync_manifest_not_kept", unit=u.label, reason=str(e))
            return False
        return (_ledger_digest(files, doc.get("complete") is True) == d
                and sorted(doc.get("damaged") or []) == sorted(u.verdict.damaged))

    def _keep_last(self, u: Unit) -> None:
        """Delete the checkpoint folders keep_last no longer keeps (only ones we uploaded)."""
        for unit_key in retention.to_delete(self.ledger.manifests_under(u.root.prefix), u.root.prefix,
                                            self.keep_last, u.key):
            log.info("sync_keep_last_delete", unit=unit_key, keep_last=self.keep_last)
            self.target.delete_prefix(unit_key)
            self.ledger.manifest_forget(unit_key)
            for k in self.ledger.keys_under(unit_key):
                self.ledger.forget(k)


    def _follow(self, u: Unit) -> None:
        """sync.follow_deletions: the units beside `u`, now complete on the target, that the trainer
        deleted here (follow.py says which); each one's manifest goes first, then its files."""
        if not self.follow_deletions:
            return
        parent = u.key.rsplit("/", 1)[0] if "/" in u.key else ""
        others = [(k, "file" if self.ledger.get(k) is not None else "dir")
                  for k in self.ledger.manifests_under(parent) if ("/" in k) == bool(parent)]
        for key in follow.to_follow(follow.Done(u.key, u.kind), others, self._gone):
            kind = "file" if self.ledger.get(key) is not None else "dir"
            log.info("sync_follow_delete", unit=key, after=u.label, why="deleted here by the training's rotation")
            self.target.delete_manifest(key, kind)
            self.ledger.manifest_forget(key)
            if kind == "file":
                self.target.delete_file(key)
                self.ledger.forget(key)
            else:
                self.target.delete_prefix(key)
                for k in self.ledger.keys_under(key):
                    self.ledger.forget(k)
        self.ledger.sync()

    def _gone(self, key: str, kind: str) -> bool:
        """Did the trainer delete this unit here? Every file the ledger holds of it had a path here
        and none is there now, while the folder that held the unit still is (a disk that went away
        is not a deletion)."""
        keys = [key] if kind == "file" else self.ledger.keys_under(key)
        held = [(k, e.src) for k in keys if (e := self.ledger.get(k)) is not None]
        if not held or not all(p for _k, p in held):
            return False
        k0, p0 = held[0]
        unit_path = p0 if kind == "file" else p0[: len(p0) - len(k0) + len(key)]  # .../unit/rel -> .../unit
        if not os.path.isdir(os.path.dirname(unit_path.rstrip("/"))):
            return False
        return not any(os.path.lexists(p) for _k, p in held)


def _ledger_digest(files: list[mf.ManifestFile], complete: bool) -> str:
    """What the ledger records for a manifest of these files: a partial one never passes for complete."""
    return mf.digest(files) if complete else f"damaged:{mf.digest(files)}"


class _Sink:
    """Where a target reports each file; runs on the target's threads."""

    def __init__(self, up: Uploader):
        self.up = up
        self.problems: list[SourceProblem] = []

    def begin(self, f: LocalFile, info: dict) -> None:
        self.up.ledger.begin(f.key, f.size, f.mtime_ns, info)
        self.up.board.uploading(f.key)

    def part(self, f: LocalFile, n: int, etag: str, checksum: str, size: int) -> None:
        self.up.ledger.part(f.key, n, etag, checksum, size)

    def done(self, f: LocalFile, result: Uploaded) -> None:
        self.up.ledger.done(f.key, Entry(f.size, f.mtime_ns, result.sha256, result.etag, f.path,
                                         self.up.clock.time(), f.ino, ctime_ns=f.ctime_ns))
        self.up.board.uploaded(result.sent)

    def problem(self, f: LocalFile, err: SourceProblem) -> None:
        self.problems.append(err)
        level = "info" if err.kind in ("vanished", "changed") else "warning"
        getattr(log, level)("sync_source_problem", path=f.path, kind=err.kind, detail=str(err))
        if err.kind == "unreadable":
            self.up.board.error(str(err), self.up.clock.time())

    def progress(self, f: LocalFile, nbytes: int) -> None:
        self.up.board.progress(nbytes, self.up.clock.monotonic())

    def in_flight(self, key: str) -> dict | None:
        return self.up.ledger.in_flight(key)

    def twin(self, f: LocalFile, sha256: str) -> tuple[str, str] | None:
        t = self.up.ledger.twin(sha256, f.size, besides=f.key)
        return (t[0], t[1].etag) if t is not None else None

    def cancelled(self) -> bool:
        return self.up.closing.is_set()


class _UnitsSink(_Sink):
    """A _Sink that knows which unit each file belongs to, and finishes a unit (its manifest)
    as soon as the target reported its last file done."""

    def __init__(self, up: Uploader, plan: list[tuple[Unit, list[Selected]]]):
        super().__init__(up)
        self._lock = threading.Lock()
        self._unit_of: dict[str, Unit] = {}
        self._left: dict[str, int] = {}
        self.failed: set[str] = set()
        for u, todo in plan:
            self._left[u.label] = len(todo)
            for s in todo:
                self._unit_of[s.key] = u

    def done(self, f: LocalFile, result: Uploaded) -> None:
        super().done(f, result)
        u = self._unit_of.get(f.key)
        if u is None:
            return
        with self._lock:
            self._left[u.label] -= 1
            last = self._left[u.label] == 0 and u.label not in self.failed
        if last:
            self.up._finish(u)

    def problem(self, f: LocalFile, err: SourceProblem) -> None:
        with self._lock:
            super().problem(f, err)
            u = self._unit_of.get(f.key)
            if u is not None:
                self.failed.add(u.label)


LINKS_SCAN_MAX = 4096  # entries of a folder looked at for links to a file (a checkpoints folder holds a few)


def links_to(path: str) -> tuple[str, ...]:
    """The symbolic links beside `path` that point at it by its name (Lightning's `last.ckpt` with
    save_last="link"): read as directory entries and link texts only, through a descriptor that
    follows no link to the folder; () when the folder cannot be read."""
    folder, name = os.path.split(path)
    out: list[str] = []
    try:
        fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ()
    try:
        with os.scandir(fd) as it:
            for i, e in enumerate(it):
                if i >= LINKS_SCAN_MAX or len(out) >= mf.LINKS_MAX:
                    break
                try:
                    if e.is_symlink() and os.readlink(e.name, dir_fd=fd) in (name, f"./{name}"):
                        out.append(e.name)
                except OSError:
                    continue
    except OSError:
        return ()
    finally:
        os.close(fd)
    return tuple(sorted(out))


def sent_trainer_facts(u: Unit, files: list[mf.ManifestFile]) -> tuple[int, int | None] | None:
    """(global_step, max_steps) of the unit's trainer_state.json for its manifest, read back as it
    went up (its sha256 must be the one the manifest lists; a file changed since is left out), so
    that a restore ranks the units on the target from their manifests alone. None when there is
    none, or it is too large to read for this, or it says no step."""
    listed = next((f for f in files if f.path == mf.STATE_NAME), None)
    s = next((s for s in u.selected if s.rel == mf.STATE_NAME), None)
    if listed is None or s is None or s.size > mf.STATE_MAX or s.size != listed.size:
        return None
    lf = LocalFile(s.path, s.key, s.size, s.mtime_ns, s.ino, s.ctime_ns)
    try:
        fd = open_source(lf)  # as the upload read it: no link followed, the version judged
        try:
            data = pread_exact(fd, lf, s.size, 0)
            check_unchanged(fd, lf)
        finally:
            os.close(fd)
    except SourceProblem:
        return None
    if hashlib.sha256(data).hexdigest() != listed.sha256:
        return None
    return mf.state_facts(data)
