"""The restore: the target's units surveyed, the newest complete one downloaded into its original
place under the watched folder, every file checked against the manifest's sha256, and recorded in
the sync ledger as on the target (so nothing restored is uploaded again and keep_last counts the
restored units with the new ones).

The files land in a hidden staging folder beside the destination (a temp name the sync never
uploads) and are renamed into place only once all of them matched the manifest, so the training
and the sync never see half a checkpoint. A file that does not match (same size, other bytes) makes
the unit unusable: its staging folder is removed and the unit before it is tried, and the result
says so.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import islice

from supervisor.resume.ahead import Ahead, Cancelled, Declined, from_listing
from supervisor.resume.choose import (
    COMPLETE,
    UnitInfo,
    choose,
    judge,
    kind_of,
    local_rel,
    unit_keys,
    with_state,
)
from supervisor.resume.place import Staging, open_inside, owner_of
from supervisor.resume.place import hand_over as _hand_over
from supervisor.resume.wholerun import RunParts, whole_run
from supervisor.saves.manifest_doc import STATE_NAME
from supervisor.store._log import get_logger
from supervisor.store.base import Reader, TargetError, join_key, reader
from supervisor.sync.ledger import Entry, Ledger
from supervisor.sync.policy import manifest_key
from supervisor.sync.scan import Root
from supervisor.training.checkpoints import checkpoint_step
from supervisor.training.safeopen import UnsafeLog, open_folder
from supervisor.untrusted.names import problem

log = get_logger("resume")

LAST_CKPT = re.compile(r"^last(?:-v\d+)?\.ckpt$")  # Lightning's save_last copy (ModelCheckpoint.CHECKPOINT_NAME_LAST)
HASH_CHUNK = 8 << 20
SURVEY_THREADS = 8
SURVEY_WINDOW = 2 * SURVEY_THREADS  # folders read ahead of the one being judged
KEEP_LISTS = 4          # complete units whose file lists a survey keeps (the restore's first choices)
VERIFY_THREADS = 4


class NothingToRestore(Exception):
    """The target is reachable and holds no complete unit (or not the one asked for)."""


class AllDamaged(NothingToRestore):
    """Complete units are on the target, but none of them matched its manifest when downloaded:
    there is work to resume from, so this is never a quiet fresh start."""


@dataclass
class Survey:
    units: list[UnitInfo]                 # every unit on the target, newest first
    order: list[UnitInfo]                 # the complete ones to try, newest first
    skipped: list[UnitInfo]               # newer than the first complete one, and why not usable
    keys: dict[str, int] = field(default_factory=dict, repr=False)   # the listing they were judged by


@dataclass
class Result:
    unit: UnitInfo
    path: str
    bytes: int
    seconds: float
    skipped: list[UnitInfo] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (unit, why it was not used)
    already_here: bool = False
    dry_run: bool = False
    companions: list[str] = field(default_factory=list)  # restored beside it (Lightning's last.ckpt)

    def to_json(self) -> dict:
        return {"unit": self.unit.key, "step": self.unit.step, "max_steps": self.unit.max_steps,
                "path": self.path, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "saved_at": self.unit.saved_at, "saved_on": self.unit.host,
                "skipped": [{"unit": u.key, "why": u.why} for u in self.skipped],
                "fallbacks": [{"unit": k, "why": w} for k, w in self.fallbacks],
                "already_here": self.already_here, "dry_run": self.dry_run, "companions": self.companions}


class Progress:
    """Bytes of the current restore, for status (rate and ETA over the whole restore)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.unit = ""
        self.total = 0
        self.done = 0
        self.t0 = 0.0

    def begin(self, unit: str, total: int) -> None:
        with self._lock:
            self.unit, self.total, self.done, self.t0 = unit, total, 0, time.monotonic()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n

    def to_json(self) -> dict:
        with self._lock:
            el = max(1e-6, time.monotonic() - self.t0) if self.t0 else 0.0
            rate = self.done / el if el else 0.0
            left = max(0, self.total - self.done)
            return {"unit": self.unit, "bytes_done": self.done, "bytes_total": self.total,
                    "rate_bps": round(rate), "eta_s": round(left / rate, 1) if rate > 0 else None}


class Restorer:
    """target: built from sync.target; ledger: the sync engine's (None: record nothing, a dry run
    or a one-shot list); roots: the watched folders with their key prefixes; user: training.user."""

    def __init__(self, target: object, ledger: Ledger | None, roots: list[Root], now: Callable[[], float],
                 etag_is_sha: bool = False, progress: Progress | None = None, user: str | None = None,
                 run: RunParts | tuple[object, int] | None = None):
        self.target = target
        # a run of several nodes: one unit for the whole run (its parts all complete, or its record)
        self.run = RunParts(run[0], run[1]) if isinstance(run, tuple) else run
        self.user = user or None            # training.user: the restored folders and files become theirs
        self.owner = owner_of(self.user)
        self.ledger = ledger
        self.roots = roots
        self.now = now
        self.etag_is_sha = etag_is_sha
        self.progress = progress or Progress()

    # --- what the target holds -----------------------------------------------------------------
    def survey(self, name: str | None = None, on_listed: Callable[[dict[str, int], list[str]], None] | None = None,
               on_judged: Callable[[UnitInfo], None] | None = None) -> Survey:
        """Every unit on the target, judged. The manifests are read newest first (by folder name),
        SURVEY_THREADS at a time, each judged as it arrives and let go in that order: the memory
        held is the file lists of SURVEY_WINDOW folders and those of the KEEP_LISTS newest complete units
        (the ones a restore may use; another is read again if the restore falls back that far).
        on_listed(keys, folders) is called once the target is listed (the unit folders newest first
        by name), on_judged(unit) for each unit as soon as it is judged."""
        rd = reader(self.target)
        keys = rd.list_keys()
        folders = sorted(unit_keys(keys), key=lambda k: checkpoint_step(k.rsplit("/", 1)[-1]) or -1, reverse=True)
        if on_listed is not None:
            on_listed(keys, folders)
        units: list[UnitInfo] = []
        kept = 0
        for u in self._judged(rd, keys, folders):
            if on_judged is not None:
                on_judged(u)
            if u.state == COMPLETE and (kept < KEEP_LISTS or (name and name in (u.key, u.name))):
                kept += 1
            else:
                u = u.summary()
            units.append(u)
        ch = choose(units, name)
        if self.run is not None:
            ch.order, ch.skipped = self._whole_run(ch.order, ch.skipped, name)
        ranked = sorted(units, key=lambda u: (u.step if u.step is not None else -1, u.saved_at), reverse=True)
        return Survey(ranked, ch.order, ch.skipped, keys)

    def _whole_run(self, order: list[UnitInfo], skipped: list[UnitInfo],
                   name: str | None = None) -> tuple[list[UnitInfo], list[UnitInfo]]:
        """One unit for the whole run, the same on every node (resume/wholerun.py)."""
        assert self.run is not None
        return whole_run(self.run, order, skipped, name)

    def _judged(self, rd: Reader, keys: dict[str, int], folders: list[str]) -> Iterator[UnitInfo]:
        """The units of `folders` in their order, each judged from its manifest (and its
        trainer_state.json when the manifest predates carrying the step), in the reading thread.
        A folder's reads start as soon as a thread is free (no round waits for its slowest GET:
        with hundreds of checkpoints on the target, rounds of SURVEY_THREADS cost one GET's
        latency each); at most SURVEY_WINDOW folders are read ahead of the one being judged."""
        def read(k: str) -> UnitInfo:
            manifest = None
            kind = kind_of(k, keys)
            if not problem(k) and manifest_key(k, kind) in keys:  # nothing is read under a refused key
                manifest = rd.read_file(manifest_key(k, kind))
            u = judge(k, manifest, keys, kind)
            if (u.state == COMPLETE and not u.step_known and kind == "dir" and join_key(k, STATE_NAME) in keys
                    and any(f.path == STATE_NAME for f in u.files)):
                u = with_state(u, rd.read_file(join_key(k, STATE_NAME)))  # a manifest older than its step
            return u

        with ThreadPoolExecutor(max(1, min(SURVEY_THREADS, len(folders))), thread_name_prefix="resume-survey") as pool:
            ahead: deque[Future[UnitInfo]] = deque()
            todo = iter(folders)
            for k in islice(todo, SURVEY_WINDOW):
                ahead.append(pool.submit(read, k))
            try:
                while ahead:
                    u = ahead.popleft().result()
                    nxt = next(todo, None)
                    if nxt is not None:
                        ahead.append(pool.submit(read, nxt))
                    yield u
            finally:
                for f in ahead:  # a read failed (or the caller stopped): the ones not started never are
                    f.cancel()

    def _listed(self, u: UnitInfo, keys: dict[str, int]) -> UnitInfo:
        """The unit with its file list, judged again from its manifest when the survey let the list
        go; a manifest changed meanwhile is judged as it is now."""
        if u.files or not u.count:
            return u
        again = list(self._judged(reader(self.target), keys, [u.key]))[0]
        return again if again.state == COMPLETE else replace(u, state=again.state, why=again.why)

    # --- the restore ---------------------------------------------------------------------------
    def restore(self, name: str | None = None, dry_run: bool = False) -> Result:
        """The newest complete unit (or `name`) into its place; the unit before it when one of its
        files is damaged. Raises NothingToRestore, TargetError.

        The newest unit's download starts from the listing while the survey goes on (ahead.py);
        a run of several nodes waits for the whole-run check instead, and a reader that cannot
        stop a download midway (rsync's one run per unit) for the choice."""
        ahead_ok = not dry_run and self.run is None and getattr(reader(self.target), "stops_midway", True)
        guess = [Ahead(self._fetch) if ahead_ok else None]
        try:
            return self._restore(name, dry_run, guess)
        finally:
            if guess[0] is not None:
                guess[0].drop()

    def _restore(self, name: str | None, dry_run: bool, guess: list[Ahead | None]) -> Result:
        def wanted(key: str) -> bool:
            return not name or name in (key, key.rsplit("/", 1)[-1])

        def listed(keys: dict[str, int], folders: list[str]) -> None:
            ahead = guess[0]
            if ahead is None:
                return
            for k in folders:
                u = from_listing(k, keys) if wanted(k) else None
                if u is not None:
                    dest, _why = self._dest(u)
                    if dest:
                        ahead.offer(u, dest)
                    return  # only the newest: an older one is the choice only when a manifest says so

        def judged(u: UnitInfo) -> None:
            ahead = guess[0]
            if ahead is None:
                return
            if ahead.waiting and ahead.unit is not None and ahead.unit.key == u.key:
                if ahead.confirm(u):
                    return
                ahead = guess[0] = Ahead(self._fetch)  # not complete as listed: the next complete one
            if not ahead.started and u.state == COMPLETE and u.kind == "dir" and wanted(u.key):
                dest, _why = self._dest(u)
                if dest:
                    ahead.offer(u, dest)

        sv = self.survey(name, on_listed=listed, on_judged=judged)
        for u in sv.skipped:
            log.warning("resume_unit_skipped", unit=u.key, state=u.state, why=u.why)
        fallbacks: list[tuple[str, str]] = []
        for u in sv.order:
            u = self._listed(u, sv.keys)
            if u.state != COMPLETE:
                fallbacks.append((u.key, u.why))
                continue
            dest, why = self._dest(u)
            if not dest:
                fallbacks.append((u.key, why))
                continue
            if dry_run:
                return Result(u, dest, u.total_bytes, 0.0, sv.skipped, fallbacks, dry_run=True)
            t0 = time.monotonic()
            ahead = guess[0]
            try:
                already = None
                if ahead is not None and ahead.holds(u, dest):
                    t0 = ahead.t0
                    try:
                        already = ahead.take()
                    except Declined:
                        pass
                elif ahead is not None:
                    ahead.drop()  # not the choice: stopped before anything of it is placed
                if already is None:
                    already = self._fetch(u, dest)
            except Damaged as e:
                log.error("resume_unit_damaged", unit=u.key, why=str(e), note="trying the unit before it")
                fallbacks.append((u.key, str(e)))
                continue
            self._record(u, dest, sv.units)
            self._links(u, dest)
            res = Result(u, dest, 0 if already else u.total_bytes, time.monotonic() - t0, sv.skipped, fallbacks,
                         already_here=already, companions=self._companions(u, sv))
            log.info("resume_restored", unit=u.key, path=dest, bytes=res.bytes, seconds=round(res.seconds, 2),
                     fallbacks=len(fallbacks))
            return res
        why = "; ".join(f"{k}: {w}" for k, w in fallbacks) or "; ".join(f"{u.key}: {u.why}" for u in sv.skipped)
        raise (AllDamaged if fallbacks else NothingToRestore)(f"no complete checkpoint{' named ' + name if name else ''} on the target"
                               + (f" ({why})" if why else ""))

    def _links(self, u: UnitInfo, dest: str) -> None:
        """The links its manifest lists beside a restored file, made again to point at it by its
        name (Lightning's save_last="link" keeps `last.ckpt` as one). A link already there is
        replaced; a file or folder under that name is left as it is, and named in the log."""
        if u.kind != "file" or not u.links:
            return
        name = os.path.basename(dest)
        parent = open_folder(os.path.dirname(dest), self.user)
        try:
            for link in u.links:
                if link == name:
                    continue
                try:
                    st = os.stat(link, dir_fd=parent, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None and not stat.S_ISLNK(st.st_mode):
                    log.warning("resume_link_not_made", link=link, to=name, why="a file or folder has that name here")
                    continue
                if st is not None:
                    if os.readlink(link, dir_fd=parent) == name:
                        continue
                    os.unlink(link, dir_fd=parent)
                os.symlink(name, link, dir_fd=parent)
                if self.owner is not None:
                    os.chown(link, *self.owner, dir_fd=parent, follow_symlinks=False)
                log.info("resume_link_made", link=link, to=name)
        except OSError as e:
            log.warning("resume_link_not_made", unit=u.key, why=str(e))
        finally:
            os.close(parent)

    def _companions(self, u: UnitInfo, sv: Survey) -> list[str]:
        """Lightning resumes with `ckpt_path="last"`: it looks for `last.ckpt` beside the step-named
        files, and a restore of `epoch=2-step=300.ckpt` alone would leave it starting from step 0.
        So the `last*.ckpt` of the restored file's folder comes too: Lightning rewrites it at every
        save, so it is as new as the newest step-named file, or newer (a save top-k did not keep).
        One that fails to come is named in the log; the restore of the unit itself stands."""
        if u.kind != "file" or sv is None:
            return []
        out = []
        for v in sv.units:
            if (v.kind != "file" or v.state != COMPLETE or v.key == u.key or v.folder != u.folder
                    or not LAST_CKPT.match(v.name)):
                continue
            v = self._listed(v, sv.keys)
            dest, _why = self._dest(v)
            if v.state != COMPLETE or not dest:
                continue
            try:
                self._fetch(v, dest)
                self._record(v, dest, [])
                out.append(v.key)
            except (Damaged, TargetError, OSError) as e:
                log.warning("resume_companion_failed", unit=v.key, why=str(e), restored=u.key)
        return out

    def _dest(self, u: UnitInfo) -> tuple[str, str]:
        """(the unit's place here, "") or ("", why it has none)."""
        where = local_rel(u.key, [(r.path, r.prefix) for r in self.roots])
        if where is None:
            return "", "belongs to no watched folder"
        if problem(where[1]):  # judge() refused such keys already; a second look costs nothing
            return "", f"its key is refused: {problem(where[1])}"
        return os.path.join(where[0], where[1]), ""

    def _fetch(self, u: UnitInfo, dest: str, hold: Ahead | None = None) -> bool:
        """Download and verify into dest; True when dest already held exactly this unit.

        The watched folder may belong to the training user, so nothing here follows a path there:
        its folder is reached by open_folder's guarded walk, and every step after works relative
        to that descriptor. The staging folder is root's own (0700) until its files are checked;
        the readers write into it through /proc/PID/fd/N, which names that folder whatever is
        renamed around it. Then it is given to the training user (whose Trainer later deletes old
        checkpoints) and renamed into place. `hold`: a download begun ahead of the choice
        (ahead.py), placed only when the restore takes it."""
        try:
            parent = open_folder(os.path.dirname(dest), self.user, make_dirs=True)
        except UnsafeLog as e:
            raise UnsafeLog(f"the restored checkpoint cannot be put in {os.path.dirname(dest)}: {e}") from None
        try:
            return self._fetch_in(u, parent, os.path.basename(dest), dest, hold)
        finally:
            os.close(parent)

    def _fetch_in(self, u: UnitInfo, parent: int, name: str, dest: str, hold: Ahead | None) -> bool:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            if hold is not None:
                raise Declined(dest)
            if u.kind == "file" and stat.S_ISREG(st.st_mode):
                if not _verify(parent, u):  # the one file, by its name beside the others
                    return True
            elif u.kind == "dir" and stat.S_ISDIR(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
                try:
                    if not _verify(fd, u):
                        return True
                finally:
                    os.close(fd)
            aside = f".{u.name}.resume-aside-{secrets.token_hex(3)}.partial"
            os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=parent)  # kept, under a name the sync never uploads
            log.warning("resume_set_aside", path=dest, aside=aside, note="differs from the target's copy")
        for old in os.listdir(parent):  # a restore cut short (the daemon stopped, the machine went) left these
            if old.startswith(f".{u.name}.tsync-"):
                shutil.rmtree(old, dir_fd=parent, ignore_errors=True)
        stage = f".{u.name}.tsync-{secrets.token_hex(4)}"
        os.mkdir(stage, 0o700, dir_fd=parent)
        sfd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            into = Staging(sfd, {f.path for f in u.files})
            self.progress.begin(u.key, u.total_bytes)
            add = self.progress.add if hold is None else hold.progress(self.progress.add)
            sums = reader(self.target).download(u.folder, [(f.path, f.size) for f in u.files], into, add)
            if hold is not None:
                u = hold.checked()  # begun from the listing: the bytes are checked against the manifest
            bad = _compare(sfd, u, sums) if isinstance(sums, dict) else _verify(sfd, u)
            extra = into.extras()
            if extra:
                bad.append(f"the target sent what the manifest does not list: {', '.join(extra[:3])}")
            if bad:
                raise Damaged("; ".join(bad[:3]))
            if hold is not None and not hold.place():
                raise Cancelled(u.key)
            # handed over before it is recorded: a chown moves the ctime, part of a file's version
            _hand_over(sfd, self.owner)
            self._record_files(u, sfd, dest)
            if u.kind == "file":  # the one checked file into its place; its staging folder goes.
                os.rename(name, name, src_dir_fd=sfd, dst_dir_fd=parent)
                os.rmdir(stage, dir_fd=parent)
                self._record_files(u, parent, dest)  # a rename moves a file's ctime (a folder's files keep theirs)
            else:
                os.rename(stage, name, src_dir_fd=parent, dst_dir_fd=parent)
            os.fsync(parent)
        except BaseException:
            shutil.rmtree(stage, dir_fd=parent, ignore_errors=True)
            raise
        finally:
            os.close(sfd)
        return False

    def _record_files(self, u: UnitInfo, folder: int, dest: str) -> None:
        """Before the rename (which keeps inode and mtime): the sync never sees these files unrecorded."""
        if self.ledger is None:
            return
        at = self.now()
        here = dest if u.kind == "dir" else os.path.dirname(dest)
        for f in u.files:
            st = _stat_inside(folder, f.path)
            self.ledger.done(u.file_key(f.path), Entry(st.st_size, st.st_mtime_ns, f.sha256,
                                                       f.sha256 if self.etag_is_sha else "",
                                                       os.path.join(here, f.path), at, st.st_ino,
                                                       ctime_ns=st.st_ctime_ns))

    def _record(self, u: UnitInfo, dest: str, units: list[UnitInfo]) -> None:
        """The restored unit's files (when already here) and every complete unit's manifest: the
        sync treats them as its own uploads (keep_last counts them; nothing is sent again)."""
        if self.ledger is None:
            return
        if self.ledger.get(u.file_key(u.files[0].path)) is None:
            fd = open_folder(dest if u.kind == "dir" else os.path.dirname(dest), self.user)
            try:
                self._record_files(u, fd, dest)
            finally:
                os.close(fd)
        at = self.now()
        for other in units:
            if other.state == COMPLETE and self.ledger.manifest(other.key) is None:
                self.ledger.manifest_done(other.key, other.digest, _epoch(other.saved_at) or at)
        self.ledger.sync()


class Damaged(Exception):
    """A downloaded file does not match the manifest."""


def _verify(folder: int, u: UnitInfo) -> list[str]:
    """Every file's size and sha256 against the manifest, read through the descriptor `folder`
    without following a link (open_inside); the problems found ([] when it matches). Files are
    hashed on several threads (hashlib lets go of the GIL), the largest first."""
    def check(f) -> str | None:
        h = hashlib.sha256()
        n = 0
        buf = bytearray(HASH_CHUNK)
        try:
            fd = open_inside(folder, f.path)
            try:
                while got := os.readv(fd, [buf]):
                    h.update(memoryview(buf)[:got])
                    n += got
            finally:
                os.close(fd)
        except OSError as e:
            return f"{f.path}: {e.strerror or e}"
        if n != f.size:
            return f"{f.path}: size {n}, manifest says {f.size}"
        if h.hexdigest() != f.sha256:
            return f"{f.path}: sha256 differs from the manifest"
        return None

    files = sorted(u.files, key=lambda f: -f.size)
    with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="resume-verify") as pool:
        found = list(pool.map(check, files))
    order = {f.path: i for i, f in enumerate(u.files)}
    return [p for _, p in sorted((order[f.path], p) for f, p in zip(files, found, strict=True) if p)]


def _stat_inside(folder: int, rel: str) -> os.stat_result:
    fd = open_inside(folder, rel)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _compare(folder: int, u: UnitInfo, sums: dict[str, str]) -> list[str]:
    """Sizes here and the sha256s the reader computed while writing, against the manifest; each
    file reached through the folder's descriptor (a link in its place is a problem, not followed)."""
    bad = []
    for f in u.files:
        try:
            n = _stat_inside(folder, f.path).st_size
        except OSError as e:
            bad.append(f"{f.path}: {e.strerror or e}")
            continue
        if n != f.size:
            bad.append(f"{f.path}: size {n}, manifest says {f.size}")
        elif sums.get(f.path) != f.sha256:
            bad.append(f"{f.path}: sha256 differs from the manifest")
    return bad


def _epoch(iso: str) -> float | None:
    try:
        return dt.datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return None


def saved_epoch(u: UnitInfo) -> float | None:
    return _epoch(u.saved_at)


__all__ = ["AllDamaged", "Damaged", "NothingToRestore", "Progress", "Restorer", "Result", "Survey", "TargetError", "saved_epoch"]
