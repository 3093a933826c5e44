"""A local folder as the target (a mounted network volume, a second disk).

Each file is copied to a temporary name beside its final place, fsynced, read back and
compared by sha256, then renamed into place: a reader never sees a half-copied file under its
real name, and what is there was verified after it hit the destination. `missing` (the final
sync's check) hashes every copy again and compares it with the sha256 recorded at upload.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.store._log import get_logger
from supervisor.store.base import (
    LocalFile,
    SourceProblem,
    TargetError,
    TokenBucket,
    Uploaded,
    UploadSink,
    check_unchanged,
    open_source,
    write_all,
)
from supervisor.store.keys import manifest_key
from supervisor.untrusted.fileopen import open_regular

if TYPE_CHECKING:
    from supervisor.store.base import Into

log = get_logger("sync.local")

CHUNK = 4 << 20


class LocalTarget:
    def __init__(self, path: str, bandwidth_limit: int = 0):
        self.base = Path(path)
        self.display = str(self.base)
        self.bucket = TokenBucket(bandwidth_limit) if bandwidth_limit else None

    def _dest(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise TargetError(f"refusing key outside the target: {key!r}")
        return self.base / key

    def _check_base(self) -> None:
        try:
            self.base.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TargetError(f"{self.base}: cannot create target folder: {e.strerror or e}") from None
        if not os.access(self.base, os.W_OK):
            raise TargetError(f"{self.base}: target folder is not writable")

    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None:
        self._check_base()
        for f in files:
            if sink.cancelled():
                return
            try:
                res = self._put(f, sink)
            except SourceProblem as e:
                sink.problem(f, e)
                continue
            sink.done(f, res)

    def _put(self, f: LocalFile, sink: UploadSink) -> Uploaded:
        dest = self._dest(f.key)
        fd = open_source(f)
        tmp = dest.with_name(f".{dest.name}.tsync-{secrets.token_hex(4)}")
        try:
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise TargetError(f"{dest.parent}: {e.strerror or e}") from None
            sink.begin(f, {"mode": "copy"})
            h = hashlib.sha256()
            off = 0
            try:
                while off < f.size:
                    try:
                        chunk = os.pread(fd, min(CHUNK, f.size - off), off)
                    except OSError as e:
                        raise SourceProblem("unreadable", f.path, e.strerror or str(e)) from None
                    if not chunk:
                        raise SourceProblem("changed", f.path, "shrank while copying")
                    if self.bucket:
                        self.bucket.take(len(chunk))
                    h.update(chunk)
                    try:
                        write_all(out, chunk)
                    except OSError as e:
                        raise TargetError(f"{dest}: write failed: {e.strerror or e}") from None
                    off += len(chunk)
                    sink.progress(f, len(chunk))
                check_unchanged(fd, f)
                try:
                    os.fsync(out)
                except OSError as e:
                    raise TargetError(f"{dest}: fsync failed: {e.strerror or e}") from None
            finally:
                os.close(out)
            sha = h.hexdigest()
            got = _sha256_file(tmp)
            if got != sha:
                raise TargetError(f"{dest}: read-back differs from what was written")
            try:
                os.replace(tmp, dest)
                _fsync_dir(dest.parent)
            except OSError as e:
                raise TargetError(f"{dest}: {e.strerror or e}") from None
            return Uploaded(sha256=sha, etag=sha, sent=f.size)
        finally:
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            except OSError:
                pass

    def write_manifest(self, unit_key: str, data: bytes, kind: str = "dir") -> None:
        self.write_object(manifest_key(unit_key, kind), data, "manifest")

    def write_object(self, key: str, data: bytes, what: str = "object") -> None:
        """A small object written whole (a manifest, a cluster heartbeat): readers see the old
        bytes or the new ones, never a part."""
        self._check_base()
        dest = self._dest(key)
        tmp = dest.with_name(f".{dest.name}.tsync-{secrets.token_hex(4)}")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, dest)
            _fsync_dir(dest.parent)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise TargetError(f"{dest}: cannot write {what}: {e.strerror or e}") from None

    def delete_manifest(self, unit_key: str, kind: str = "dir") -> None:
        self._unlink(manifest_key(unit_key, kind), "manifest")

    def missing(self, expected: dict[str, tuple[int, str]], deep: Collection[str] | None = None) -> list[str]:
        """By content for the keys in `deep` (all when None): the etag this target records at
        upload is the file's sha256, and each such copy is hashed again here (a copy damaged in
        place keeps its size and mtime). The others, checked by content before, by size."""
        if not self.base.is_dir():
            raise TargetError(f"{self.base}: target folder is missing")
        out = []
        for key, (size, etag) in expected.items():
            dest = self._dest(key)
            try:
                st = os.stat(dest, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or (size >= 0 and st.st_size != size):
                    out.append(key)
                elif etag and (deep is None or key in deep) and _sha256_file(dest) != etag:
                    log.warning("sync_target_content_differs", key=key)
                    out.append(key)
            except FileNotFoundError:
                out.append(key)
            except OSError as e:
                raise TargetError(f"{self.base / key}: {e.strerror or e}") from None
        return out

    def delete_file(self, key: str) -> None:
        self._unlink(key)

    def _unlink(self, key: str, what: str = "") -> None:
        """One object gone, its folder synced; nothing when it is not there."""
        dest = self._dest(key)
        try:
            os.unlink(dest)
            _fsync_dir(dest.parent)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise TargetError(f"{dest}: cannot remove{' ' + what if what else ''}: {e.strerror or e}") from None

    def delete_prefix(self, unit_key: str) -> None:
        if not unit_key:
            raise TargetError("refusing to delete the whole target")
        try:
            shutil.rmtree(self._dest(unit_key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise TargetError(f"{self.base / unit_key}: {e.strerror or e}") from None

    def close(self) -> None:
        pass

    # --- the read side (resume) -----------------------------------------------------------------
    def list_keys(self) -> dict[str, int]:
        if not self.base.is_dir():
            raise TargetError(f"{self.base}: target folder is missing")
        out: dict[str, int] = {}
        for dirpath, _dirs, names in os.walk(self.base):
            for n in names:
                if ".tsync-" in n:
                    continue  # a copy in progress (or left by a crash): never a file of the unit
                p = os.path.join(dirpath, n)
                try:
                    st = os.stat(p, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out[os.path.relpath(p, self.base).replace(os.sep, "/")] = st.st_size
        return out

    def list_versions(self) -> dict[str, tuple[int, str]]:
        """key -> (size, mtime in ns): what changed since a last look (the run ledger's records)."""
        if not self.base.is_dir():
            raise TargetError(f"{self.base}: target folder is missing")
        out: dict[str, tuple[int, str]] = {}
        for dirpath, _dirs, names in os.walk(self.base):
            for n in names:
                if ".tsync-" in n:
                    continue
                p = os.path.join(dirpath, n)
                try:
                    st = os.stat(p, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out[os.path.relpath(p, self.base).replace(os.sep, "/")] = (st.st_size, f"{st.st_mtime_ns}:{st.st_ino}")
        return out

    def read_file(self, key: str) -> bytes | None:
        try:
            with open(self._dest(key), "rb") as fh:
                return fh.read(64 << 20)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TargetError(f"{self.base / key}: {e.strerror or e}") from None

    def download(self, unit_key: str, files: list[tuple[str, int]], into: Into, progress) -> dict[str, str]:
        """Copies, hashing the bytes as they are written (rel -> sha256); each file created
        through `into`, each source opened as a regular file only (a FIFO planted in the target
        folder holds nothing up)."""
        sums: dict[str, str] = {}
        for rel, _size in files:
            src = self._dest(f"{unit_key}/{rel}")
            h = hashlib.sha256()
            try:
                with os.fdopen(open_regular(str(src)), "rb") as fi, os.fdopen(into.create(rel), "wb") as fo:
                    while chunk := fi.read(CHUNK):
                        if self.bucket:
                            self.bucket.take(len(chunk))
                        h.update(chunk)
                        write_all(fo.fileno(), chunk)
                        progress(len(chunk))
            except FileNotFoundError:
                raise TargetError(f"{src}: not on the target") from None
            except OSError as e:
                raise TargetError(f"{src}: {e.strerror or e}") from None
            sums[rel] = h.hexdigest()
        return sums


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
