"""What every target (S3, rsync over SSH, local folder) offers the engine, and shared helpers.

A target uploads a batch of files and reports each file back through an UploadSink as soon as it
is verified on the target (so the ledger grows file by file and a crash loses at most the files
in flight). It raises TargetError when the target itself fails (unreachable, refused, errors);
problems with one source file (vanished, changed while read, unreadable) are reported per file
and never abort the batch.

Optional capabilities (the engine asks through the functions at the end of this module, so a
target without them needs nothing): `put_units` lands several complete units, manifests included,
in one step (the Hub: one commit), and `describe` adds facts for status.

The read side (resume): every target kind is also a `Reader` (`list_keys`, `read_file`, `download`);
`read_manifest` builds on it; the restore's survey (resume/restore.py) reads manifests through it.

The store's interface in five verbs, for sync and resume alike: put verified (`put_files`, each file
reported once the target's own checksum proves it), put manifest (`write_manifest`), list (`missing`,
`list_keys`), get into (`read_file`, `download` into an `Into`), delete (`delete_file`,
`delete_manifest`, `delete_prefix`). The store imports neither wing: resume's Staging is an `Into`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from supervisor.store.keys import manifest_key
from supervisor.untrusted.fileopen import NotRegular, open_regular


class TargetError(Exception):
    """The target failed; the batch stops and is retried with backoff."""


class AccessDenied(TargetError):
    """The target refused our credentials (bad token, no write access): retrying will not help
    until a person fixes them, so an engine may alert at once."""


class NoCredentials(AccessDenied):
    """No credentials were found at all; the message says where the daemon looked."""


class PublicRepoRefused(AccessDenied):
    """The Hub repo is public and `sync.hf_allow_public` is not set: nothing is uploaded there (a
    typo or a reused name must not publish weights trained on private data)."""


class RateLimited(TargetError):
    """The target asks us to wait `retry_after` seconds; the next attempt should not come sooner."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class SourceProblem(Exception):
    """One source file cannot be uploaded now. kind: vanished | changed | unreadable."""

    def __init__(self, kind: str, path: str, detail: str = ""):
        self.kind = kind
        self.path = path
        super().__init__(f"{path}: {kind}{': ' + detail if detail else ''}")


@dataclass(frozen=True)
class LocalFile:
    path: str        # absolute path on this machine
    key: str         # where it goes, relative to the target's base
    size: int
    mtime_ns: int
    ino: int = 0     # the inode judged (0: unknown); another inode at the path is another file
    ctime_ns: int = 0  # the ctime judged (0: unknown): recorded with the upload, part of the version


@dataclass(frozen=True)
class Uploaded:
    sha256: str
    etag: str = ""
    sent: int = 0     # bytes sent for it this time (0 when the target already held it)


class UploadSink(Protocol):
    def begin(self, f: LocalFile, info: dict) -> None:
        """About to send f (persist before the first byte leaves)."""

    def part(self, f: LocalFile, n: int, etag: str, checksum: str, size: int) -> None:
        """One part of a multipart upload is on the target."""

    def done(self, f: LocalFile, result: Uploaded) -> None:
        """The target holds f, verified."""

    def problem(self, f: LocalFile, err: SourceProblem) -> None:
        """f could not be uploaded now (vanished, changed, unreadable)."""

    def progress(self, f: LocalFile, nbytes: int) -> None:
        """nbytes more of f went out."""

    def in_flight(self, key: str) -> dict | None:
        """What the ledger knows of an interrupted upload of key (begin info and parts)."""

    def twin(self, f: LocalFile, sha256: str) -> tuple[str, str] | None:
        """Another key the target verifiably holds with exactly f's content (this sha256, f's
        size), and the fingerprint (ETag) recorded for it; None when there is none. Optional:
        a target that can copy on the server side asks, others never do."""

    def cancelled(self) -> bool:
        """Stop soon (the engine is closing)."""


@dataclass(frozen=True)
class RemoteObject:
    size: int
    etag: str = ""
    mtime: float = 0.0


class Target(Protocol):
    display: str

    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None: ...

    def write_manifest(self, unit_key: str, data: bytes, kind: str = "dir") -> str | None:
        """The unit's manifest at policy.manifest_key(unit_key, kind) (kind "file": beside a
        single-file unit). Returns the commit that holds it, for targets with commits (the Hub);
        None otherwise."""
        ...

    def delete_manifest(self, unit_key: str, kind: str = "dir") -> None: ...

    def delete_file(self, key: str) -> None:
        """One file's object (a single-file unit, after its manifest); nothing when it is not there."""
        ...

    def missing(self, expected: dict[str, tuple[int, str]], deep: Collection[str] | None = None) -> list[str]:
        """Keys (of key -> (size, etag)) the target does not hold as expected (size -1: only
        that it exists; etag "": not compared). The keys in `deep` (all when None) are checked by
        content as this target can (a hash on the target where it computes one); the others by
        its cheap means (a listing's size, and the store's own checksum where a listing gives
        one): they were checked by content in an earlier final sync."""
        ...

    def delete_prefix(self, unit_key: str) -> None: ...

    def close(self) -> None: ...


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


# --- reading sources safely --------------------------------------------------------------------

def open_source(f: LocalFile) -> int:
    """Open a source file for reading without following a symlink, and check it is still the
    version that was judged complete. Raises SourceProblem."""
    try:
        fd = open_regular(f.path)  # a FIFO swapped in after the scan is refused, never waited on
    except FileNotFoundError:
        raise SourceProblem("vanished", f.path) from None
    except NotRegular as e:
        raise SourceProblem("unreadable", f.path, e.strerror or str(e)) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SourceProblem("unreadable", f.path, "became a symlink") from None
        raise SourceProblem("unreadable", f.path, e.strerror or str(e)) from None
    try:
        check_unchanged(fd, f)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_unchanged(fd: int, f: LocalFile) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SourceProblem("unreadable", f.path, "not a regular file")
    if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns or (f.ino and st.st_ino != f.ino):
        raise SourceProblem("changed", f.path, f"size {st.st_size} mtime_ns {st.st_mtime_ns} inode {st.st_ino}")


def pread_exact(fd: int, f: LocalFile, n: int, offset: int) -> bytes:
    try:
        data = os.pread(fd, n, offset)
    except OSError as e:
        raise SourceProblem("unreadable", f.path, e.strerror or str(e)) from None
    if len(data) != n:
        raise SourceProblem("changed", f.path, f"short read at {offset}")
    return data


def sha256_fd(fd: int, f: LocalFile, chunk: int = 8 << 20) -> str:
    """The sha256 of an open source file, read in pieces, checked unchanged at the end (the
    checksum recorded at upload must be of the version that went up)."""
    h = hashlib.sha256()
    off = 0
    while off < f.size:
        data = pread_exact(fd, f, min(chunk, f.size - off), off)
        h.update(data)
        off += len(data)
    check_unchanged(fd, f)
    return h.hexdigest()


# Files are written in slices of this size: on Linux 6.x ext4 (large folios) a write of W bytes
# makes the kernel allocate page-cache folios of up to W, and in a VM (most rented GPU servers)
# those most likely come from the large free blocks the guest reported back to the host, whose
# first touch costs the host's page faults. A 2 GiB restore measured 11-15 s of system time in 1 MiB writes
# against 1.6 s in 32 KiB ones. 256 KiB writes matched 32 KiB on a quiet machine and cost 8-11 s
# of CPU once other tools had churned the page cache (bench_restore's rotation). Go's io.Copy,
# as in s5cmd, writes 32 KiB.
WRITE_SLICE = 32 << 10


def write_all(fd: int, data: bytes | bytearray | memoryview, offset: int | None = None) -> int:
    """Every byte of data to fd (at offset with pwrite, else at the file position), in
    WRITE_SLICE pieces; returns the offset after the last byte (or the count written)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        piece = view[done:done + WRITE_SLICE]
        n = os.pwrite(fd, piece, offset + done) if offset is not None else os.write(fd, piece)
        done += n
    return (offset or 0) + done


class TokenBucket:
    """bandwidth_limit shared by every sending thread (bytes per second; 0 = unlimited)."""

    def __init__(self, rate: float, burst: float | None = None):
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 4, 64 * 1024))
        self._tokens = self.burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        while n > 0:
            chunk = min(n, self.burst)
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
                self._t = now
                if self._tokens >= chunk:
                    self._tokens -= chunk
                    n -= chunk
                    continue
                wait = (chunk - self._tokens) / self.rate
            time.sleep(min(wait, 0.5))


# --- optional capabilities -------------------------------------------------------------------

@dataclass
class UnitPut:
    """One unit for put_units: the files of it not on the target yet, and how to build its
    manifest once their sha256s are known (None: no manifest, for a partial unit or loose files)."""

    key: str                         # the unit's key on the target ("checkpoint-1200"; "" for loose files)
    files: list[LocalFile]
    manifest: Callable[[dict[str, Uploaded]], bytes | None] | None = None
    # manifest(results) gets key -> Uploaded for `files` and returns _MANIFEST.json (None: not now)


@dataclass
class UnitsPut:
    commits: dict[str, str] = field(default_factory=dict)  # unit key -> commit holding it ("" without commits)
    manifests: list[str] = field(default_factory=list)     # unit keys whose manifest is on the target now


def put_units(target: Target, units: list[UnitPut], sink: UploadSink) -> UnitsPut:
    """Upload several units, each with its manifest written last. A target that can land them
    together (the Hub: files and manifests of all units in one commit) does; for the others this
    is put_files then write_manifest, unit by unit. As with put_files, every file is reported to
    the sink (done only once it is on the target, verified); a unit with a problem file gets no
    manifest."""
    native = getattr(target, "put_units", None)
    if callable(native):
        return native(units, sink)
    out = UnitsPut()
    for u in units:
        if sink.cancelled():
            break
        rec = _Recording(sink)
        if u.files:
            target.put_files(u.files, rec)
        if rec.problems or len(rec.results) < len(u.files) or u.manifest is None:
            continue
        data = u.manifest(rec.results)
        if data is None:
            continue
        out.commits[u.key] = target.write_manifest(u.key, data) or ""
        out.manifests.append(u.key)
    return out


def describe(target: Target) -> dict:
    """Facts about the target for status (e.g. the Hub: repo, visibility, Xet or LFS); {} if none."""
    fn = getattr(target, "describe", None)
    return dict(fn()) if callable(fn) else {}


class _Recording:
    """An UploadSink that passes everything on and remembers results and problems."""

    def __init__(self, sink: UploadSink):
        self.sink = sink
        self.results: dict[str, Uploaded] = {}
        self.problems: list[SourceProblem] = []
        self._lock = threading.Lock()

    def begin(self, f: LocalFile, info: dict) -> None:
        self.sink.begin(f, info)

    def part(self, f: LocalFile, n: int, etag: str, checksum: str, size: int) -> None:
        self.sink.part(f, n, etag, checksum, size)

    def done(self, f: LocalFile, result: Uploaded) -> None:
        self.sink.done(f, result)
        with self._lock:
            self.results[f.key] = result

    def problem(self, f: LocalFile, err: SourceProblem) -> None:
        self.sink.problem(f, err)
        with self._lock:
            self.problems.append(err)

    def progress(self, f: LocalFile, nbytes: int) -> None:
        self.sink.progress(f, nbytes)

    def in_flight(self, key: str) -> dict | None:
        return self.sink.in_flight(key)

    def cancelled(self) -> bool:
        return self.sink.cancelled()


# --- the read side (resume) ------------------------------------------------------------------

class Into(Protocol):
    """Where a download writes (resume's staging folder, which the store does not know by name):
    `create` hands a descriptor on one file the unit lists, never a path joined from the target's
    names; `path` names the folder for a tool that takes a path (rsync)."""

    path: str

    def create(self, rel: str, size: int = 0) -> int: ...


class Reader(Protocol):
    """What a restore asks of a target: every key with its size, one small file's bytes, and a
    unit's files downloaded into a folder here. Every target kind implements it."""

    def list_keys(self) -> dict[str, int]:
        """Every file under the target's base (relative key -> size; -1 when the target does
        not say)."""
        ...

    def read_file(self, key: str) -> bytes | None:
        """A small file's bytes (a manifest, trainer_state.json); None when it is not there."""
        ...

    def download(self, unit_key: str, files: list[tuple[str, int]], into: Into,
                 progress: Callable[[int], None]) -> dict[str, str] | None:
        """`unit_key/rel` into the staging folder `into` for each (rel, size), every file created
        with `into.create` (never a path joined from the target's names), reporting bytes as they
        arrive. Raises TargetError. Returns rel -> sha256 of the bytes written when it hashed them
        on the way (S3), else None and the caller hashes the files; either way the caller checks
        them against the manifest."""
        ...


def reader(target: object) -> Reader:
    """The target's read side (its `reader`, or the target itself when it reads as it writes: a
    folder); TargetError naming the kind when it has none."""
    side = getattr(target, "reader", target)
    for name in ("list_keys", "read_file", "download"):
        if not callable(getattr(side, name, None)):
            raise TargetError(f"{getattr(target, 'display', type(target).__name__)}: this target cannot be "
                              "read back (no restore support)")
    return side  # type: ignore[no-any-return]


def read_manifest(target: object, unit_key: str, kind: str = "dir") -> bytes | None:
    return reader(target).read_file(manifest_key(unit_key, kind))
