"""A single checkpoint file held still while it goes up.

nanoGPT-style training saves with `torch.save(ckpt, out_dir/'ckpt.pt')` at every eval: it truncates
and rewrites the same inode in place. On a slow uplink nearly every upload of it was cut short (the
target checks the file is unchanged as it reads it and aborts: no torn object is ever published) and
the target fell 45 iterations behind. Lightning's `last.ckpt` is replaced by rename at each save: the
inode an upload reads stays whole, but the path moves on between the scan and the upload's open.

So a single-file unit seen to change (a second version at its path, or an upload of it aborted as
changed) goes up from a snapshot of the version the scan judged whole:
- replaced by rename (its last change brought a new inode): a hard link to the judged inode, made
  from the descriptor that checked it. It costs no space while the path holds that inode, so it is
  kept until the path moves on (then swept): removing it sooner would move the inode's ctime, which
  is part of the version the ledger records (the ledger records the ctime the link left).
- rewritten in place (the same inode): a copy (snapdir.copy_into: a reflink, else copy_file_range,
  else read and write), kept only when the source's (size, mtime, inode, ctime) did not move while it
  was copied and the copy is whole by its format check; else it is discarded and the unit waits for
  the next scan. A copy is removed when its upload ends, sent or not (a retry copies again: no stale
  copy waits on the disk).
A file never seen to change gets none: written once, it cannot change under its upload, and a copy
would double its disk use for nothing (a 10 GB final model). Its first abort marks it.

The snapshot goes up under the original file's key, and the ledger records the source's path and
version as they were when it was taken (SnapshotTarget hands the sink the source, not the snapshot).
Snapshots live in a folder of the daemon's on the source's file system (snapdir.py), one slot per
source path: at most one snapshot per file. A copy needs the file's size plus a margin free (the
training's next save must not find the disk full); without it there is no snapshot, said once and
in status, and the file goes up as before. The saves the target lacks are counted in counts.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from supervisor.durations import format_bytes
from supervisor.saves.complete import checkable
from supervisor.saves.counts import Saves, Teller, Unit, whole_fd
from supervisor.saves.snapdir import (
    DIR_FLAGS,
    MARGIN_MIN,
    MARGIN_SHARE,
    STATE_SUBDIR,
    SnapDir,
    clear,
    copy_into,
    mount_top,
    open_mount_dir,
    open_state_dir,
    room,
)
from supervisor.store._log import Once, get_logger
from supervisor.store.base import (
    LocalFile,
    SourceProblem,
    Target,
    Uploaded,
    UploadSink,
    open_source,
)

log = get_logger("sync")


# --- decisions (pure) ------------------------------------------------------------------------------

def snapshot_mode(in_place: bool | None, aborted: bool) -> str | None:
    """How a single file goes up: "copy" when its last change kept its inode (rewritten in place)
    or when it changed under an upload before a scan saw how; "link" when its last change brought a
    new inode (replaced by rename: that inode's bytes never change); None when never seen to change."""
    if in_place is True:
        return "copy"
    if in_place is False:
        return "link"
    return "copy" if aborted else None


def slot(path: str) -> str:
    """The folder of a source path's snapshot (one per path: at most one snapshot per file)."""
    return hashlib.sha256(os.fsencode(path)).hexdigest()[:24]


# --- taking, sending and sweeping snapshots --------------------------------------------------------

@dataclass
class Snap:
    key: str
    read: LocalFile            # what the target reads: the snapshot
    source: LocalFile          # what the ledger records: the source as it was when taken
    dir: SnapDir | None
    slot: str
    mode: str                  # "copy" | "link"
    problem: SourceProblem | None = None  # taken badly: the file is not sent this pass


class Snapshots:
    """Owned by the Uploader; the sync worker takes (send) and releases them; SnapshotTarget reads
    them; the scan's look sweeps what is no longer needed."""

    def __init__(self, state_dir: str, behind: Teller, margin_min: int = MARGIN_MIN,
                 on_piece: Callable[[LocalFile, int], None] | None = None):
        self.state_dir = state_dir
        self.saves = Saves(behind)  # told to targethealth.Behind: status and the "target behind" alerts
        self.margin_min = margin_min
        self.on_piece = on_piece           # after each piece of a copy (tests change the source there)
        # st_dev -> where our folder on that file system is (None: none can be): opened for a
        # pass and closed after it, so an engine holds no descriptor between passes
        self._where: dict[int, str | None] = {}
        self._open: dict[int, SnapDir] = {}
        self._why: dict[int, str] = {}     # st_dev -> why no folder of ours can be there
        self.live: dict[str, Snap] = {}    # key -> the snapshot this pass sends
        self._once = Once(log)
        self.taken = {"copy": 0, "link": 0, "discarded": 0, "skipped": 0}
        with contextlib.suppress(OSError):  # an earlier daemon's leftovers there are swept at the first scan
            mine = os.path.join(state_dir, "sync", STATE_SUBDIR)
            self._where[os.stat(mine).st_dev] = mine

    # the scan's side
    def look(self, units: Iterable[Unit], synced: Callable[[Unit], bool]) -> None:
        units = list(units)
        self.saves.look(units, synced)
        self.sweep(units)

    def hint(self, path: str) -> None:
        self.saves.hint(path)

    # the sender's side
    def take(self, batch: list[Unit], current: Callable[..., object]) -> None:
        """Snapshots of the batch's single files that need one (snapshot_mode), before they are sent."""
        for u in batch:
            if u.kind != "file" or not u.verdict.complete or len(u.selected) != 1:
                continue
            s = u.selected[0]
            t = self.saves.track(u.key)
            whole = any(f.whole is True for f in u.files)
            mode = snapshot_mode(t.in_place, t.aborted) if t is not None and whole else None
            if mode is None or current(s.key, s.size, s.mtime_ns, ctime_ns=s.ctime_ns) is not None:
                continue
            lf = LocalFile(s.path, s.key, s.size, s.mtime_ns, s.ino, s.ctime_ns)
            snap = self._take(u, lf, mode)
            if snap is not None and snap.mode == "link" and snap.problem is None:
                s.ctime_ns = snap.source.ctime_ns  # the link moved the inode's ctime: that is the version now
            if snap is not None:
                self.live[u.key] = snap

    def release(self) -> None:
        """The batch is done (sent or not): its copies go; a link stays while its inode is the file."""
        for snap in self.live.values():
            if snap.mode == "copy" and snap.dir is not None and snap.problem is None:
                clear(snap.dir, snap.slot)
        self.live.clear()
        for d in self._open.values():
            os.close(d.fd)
        self._open.clear()

    def reads(self, f: LocalFile) -> Snap | None:
        """The snapshot to send for f, when this pass took one of exactly this version."""
        snap = self.live.get(f.key)
        if snap is None or (snap.source.size, snap.source.mtime_ns, snap.source.ino, snap.source.ctime_ns) != \
                (f.size, f.mtime_ns, f.ino, f.ctime_ns):
            return None
        return snap

    def _dir(self, u: Unit, dev: int) -> SnapDir | None:
        """Our folder on the file system `dev`, open until release(); None (and why, in _why) when
        there can be none there."""
        if dev in self._open:
            return self._open[dev]
        d = None
        if dev not in self._where:
            d = open_state_dir(self.state_dir, dev) if self.state_dir else None
            top = mount_top(os.path.dirname(u.selected[0].path), dev) if d is None else None
            try:
                d = d or (open_mount_dir(top, dev) if top else None)
            except OSError as e:
                self._why[dev] = str(e)
                self._once.warning(f"snapdir:{dev}", "sync_snapshot_folder_refused", error=str(e))
            self._where[dev] = d.where if d is not None else None
            if d is not None:
                log.info("sync_snapshot_folder", folder=d.where)
        elif self._where[dev] is not None:
            d = self._reopen(dev)
        if d is not None:
            self._open[dev] = d
        return d

    def _reopen(self, dev: int) -> SnapDir | None:
        where = self._where.get(dev)
        if where is None:
            return None
        try:
            if where == os.path.join(self.state_dir, "sync", STATE_SUBDIR):
                return open_state_dir(self.state_dir, dev)
            return open_mount_dir(os.path.dirname(where), dev)
        except OSError as e:
            self._once.warning(f"snapdir:{dev}", "sync_snapshot_folder_refused", error=str(e))
            return None

    def _take(self, u: Unit, lf: LocalFile, mode: str) -> Snap | None:
        try:
            src = open_source(lf)  # no link followed, and still the version the scan judged
        except SourceProblem:
            return None            # the upload's own open says so, as it always did
        d: SnapDir | None = None
        name = ""
        try:
            st = os.fstat(src)
            if lf.ctime_ns and st.st_ctime_ns != lf.ctime_ns:
                raise _Changed("its bytes were rewritten since the scan")  # the mtime set back, the ctime not
            d = self._dir(u, st.st_dev)
            if d is None:
                return self._skip(u, lf, self._why.get(st.st_dev) or "no folder of the daemon's on its file system")
            name, base = slot(lf.path), os.path.basename(lf.path)
            old = self._slot_ino(d, name, base)
            if mode == "link" and old == lf.ino:
                return self._snap(d, name, base, lf, mode, src)  # this version's link is there already
            clear(d, name)  # superseded: at most one snapshot per file
            if mode == "copy":
                vfs = os.fstatvfs(d.fd)
                free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
                if not room(lf.size, free, total, self.margin_min):
                    margin = max(self.margin_min, int(total * MARGIN_SHARE))
                    return self._skip(u, lf, f"{format_bytes(free)} free, a copy needs {format_bytes(lf.size)} "
                                             f"and a margin of {format_bytes(margin)}")
            os.mkdir(name, 0o700, dir_fd=d.fd)
            hfd = os.open(name, DIR_FLAGS, dir_fd=d.fd)
            try:
                if mode == "link":
                    try:
                        os.link(f"/proc/self/fd/{src}", base, dst_dir_fd=hfd)  # exactly the inode checked
                    except FileNotFoundError:
                        raise _Changed("the file was replaced as it was linked") from None
                else:
                    self._copy(src, hfd, base, lf)
            finally:
                os.close(hfd)
            self.saves.mark(u.key, note="")
            return self._snap(d, name, base, lf, mode, src)
        except _Changed as e:
            if d is not None:
                clear(d, name)
            self.taken["discarded"] += 1
            log.info("sync_snapshot_discarded", path=lf.path, reason=str(e), note="sent after the next scan")
            problem = SourceProblem("changed", lf.path, f"while its snapshot was taken ({e})")
            return Snap(lf.key, lf, lf, d, name, mode, problem)
        except OSError as e:
            self._once.warning(f"snap:{lf.path}:{e.errno}", "sync_snapshot_failed", path=lf.path,
                               error=e.strerror or str(e), note="sent from the file itself")
            return None
        finally:
            os.close(src)

    def _copy(self, src: int, hfd: int, base: str, lf: LocalFile) -> None:
        before = os.fstat(src)
        # made under another name and named for the file once checked: a copy under way is never taken for one
        part = f".{base}.copying"
        dst = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=hfd)
        try:
            how = copy_into(src, dst, lf.size,
                            (lambda n: self.on_piece(lf, n)) if self.on_piece is not None else None)
            after = os.fstat(src)
            if _ident(before) != _ident(after):
                raise _Changed("the file changed while it was copied")
            if os.fstat(dst).st_size != lf.size:
                raise _Changed("the copy is short")
            os.utime(dst, ns=(before.st_atime_ns, before.st_mtime_ns))  # the version's mtime, as sent
            if whole_fd(dst, checkable(base) or "", lf.size) is not True:
                raise _Changed("the copy fails its format check")
            os.rename(part, base, src_dir_fd=hfd, dst_dir_fd=hfd)
            log.info("sync_snapshot_taken", path=lf.path, mode="copy", how=how, bytes=lf.size)
        finally:
            os.close(dst)

    def _snap(self, d: SnapDir, name: str, base: str, lf: LocalFile, mode: str, src: int) -> Snap:
        st = os.fstat(src)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (lf.size, lf.mtime_ns, lf.ino):
            raise _Changed("the file changed while it was linked")  # an in-place writer after all
        if mode == "link":
            lf = replace(lf, ctime_ns=st.st_ctime_ns)  # what the link left: the version the next scan sees
            log.info("sync_snapshot_taken", path=lf.path, mode="link", bytes=lf.size)
        sst = _stat_in(d, name, base)
        self.taken[mode] += 1
        read = LocalFile(f"{d.path}/{name}/{base}", lf.key, lf.size, lf.mtime_ns, sst.st_ino, sst.st_ctime_ns)
        return Snap(lf.key, read, lf, d, name, mode)

    def _skip(self, u: Unit, lf: LocalFile, why: str) -> Snap | None:
        self.taken["skipped"] += 1
        self.saves.mark(u.key, note=f"no snapshot ({why})")
        self._once.warning(f"snapskip:{lf.path}:{why.split(',')[0]}", "sync_snapshot_skipped", path=lf.path,
                           reason=why, note="sent from the file itself, as before: a rewrite during the upload "
                                            "stops it")
        return None

    @staticmethod
    def _slot_ino(d: SnapDir, name: str, base: str) -> int:
        try:
            return _stat_in(d, name, base).st_ino
        except OSError:
            return 0

    def sweep(self, units: Iterable[Unit]) -> None:
        """Remove what no file needs: a slot of no single file found now, a leftover copy (a
        daemon stopped mid-send), a link whose file has moved on (a new inode at its path)."""
        files = {slot(u.selected[0].path): u.selected[0] for u in units if u.kind == "file" and u.selected}
        for dev in [dev for dev, where in self._where.items() if where is not None]:
            d = self._open.get(dev) or self._reopen(dev)
            if d is None:
                continue
            try:
                for name in os.listdir(d.fd):
                    if any(s.slot == name and s.dir is d for s in self.live.values()):
                        continue
                    s = files.get(name)
                    try:
                        st = _stat_in(d, name, os.path.basename(s.path)) if s is not None else None
                    except OSError:
                        st = None
                    if st is not None and s is not None and st.st_nlink > 1 and st.st_ino == s.ino:
                        continue  # the link to the inode the file still is
                    clear(d, name)
            except OSError:
                pass
            finally:
                if d is not self._open.get(dev):
                    os.close(d.fd)


class _Changed(Exception):
    """The source moved while its snapshot was taken: discarded, the unit waits for the next scan."""


def _ident(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def _stat_in(d: SnapDir, name: str, base: str) -> os.stat_result:
    fd = os.open(name, DIR_FLAGS, dir_fd=d.fd)
    try:
        return os.stat(base, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)




# --- the target as the uploader sees it: snapshots sent in their files' place ----------------------

class SnapshotTarget:
    """The target, with put_files sending each file's snapshot where this pass took one, and the
    sink told of the source (the ledger records the file as it was when its snapshot was taken).
    Everything else is the target's own."""

    def __init__(self, target: Target, snaps: Snapshots):
        self._target = target
        self._snaps = snaps

    def __getattr__(self, name: str) -> object:
        return getattr(self._target, name)

    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None:
        send: list[LocalFile] = []
        source: dict[str, LocalFile] = {}
        for f in files:
            snap = self._snaps.reads(f)
            if snap is not None and snap.problem is not None:
                sink.problem(f, snap.problem)
                continue
            if snap is not None:
                source[f.key] = f
                f = snap.read
            send.append(f)
        if send:
            self._target.put_files(send, _SourceSink(sink, source, self._snaps.saves))


class _SourceSink:
    """The uploader's sink, told of the source file in place of its snapshot; a save of a file
    seen while its snapshot goes up is counted (the worker does not scan meanwhile)."""

    def __init__(self, sink: UploadSink, source: dict[str, LocalFile], saves: Saves):
        self.sink, self.source, self.saves = sink, source, saves

    def _src(self, f: LocalFile) -> LocalFile:
        return self.source.get(f.key, f)

    def begin(self, f: LocalFile, info: dict) -> None:
        self.sink.begin(self._src(f), info)

    def part(self, f: LocalFile, n: int, etag: str, checksum: str, size: int) -> None:
        self.sink.part(self._src(f), n, etag, checksum, size)

    def done(self, f: LocalFile, result: Uploaded) -> None:
        src = self._src(f)
        self.sink.done(src, result)
        self.saves.sent(src.key, (src.size, src.mtime_ns, src.ino))

    def problem(self, f: LocalFile, err: SourceProblem) -> None:
        if err.kind == "changed" and f.key not in self.source:
            self.saves.mark(f.key, aborted=True)  # rewritten under its upload: a snapshot next time
        self.sink.problem(self._src(f), err)

    def progress(self, f: LocalFile, nbytes: int) -> None:
        self.sink.progress(self._src(f), nbytes)
        if f.key in self.source:
            self.saves.hint(self.source[f.key].path)

    def in_flight(self, key: str) -> dict | None:
        return self.sink.in_flight(key)

    def twin(self, f: LocalFile, sha256: str) -> tuple[str, str] | None:
        fn = getattr(self.sink, "twin", None)  # optional in UploadSink
        return fn(self._src(f), sha256) if callable(fn) else None

    def cancelled(self) -> bool:
        return self.sink.cancelled()
