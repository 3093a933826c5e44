"""The S3 target's read side (resume): listing, small reads, and downloads by parallel ranged GETs,
through the connection's client (s3_light.py).

A file larger than one part is fetched in `part_size` ranges (at least RANGE_MIN) written in place
with pwrite (base.write_all) into a file of its final size, all files of the unit sharing one pool
of `concurrency` threads, so a 2 GiB checkpoint and a LoRA folder of 40 small files both keep every
connection busy. Each file is hashed while the download runs (_OrderedHash), for the caller to
check against the manifest's sha256 without a second pass."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

from supervisor.store.base import TargetError, write_all
from supervisor.store.s3_wire import NotFound

if TYPE_CHECKING:
    from supervisor.store.base import Into
    from supervisor.store.s3_client import S3Connection
    from supervisor.store.s3_light import LightS3

RANGE_MIN = 16 << 20
READ_BUF = 256 << 10
SMALL_MAX = 64 << 20


class S3Reader:
    """The read side of S3Target (a restore): keys, small files, ranged downloads hashed on the way."""

    def __init__(self, c: S3Connection):
        self.c = c  # the connection: its client, pools, keys and listings

    def list_keys(self) -> dict[str, int]:
        self.c.renew()  # each survey reads static keys afresh (a credentials file fixed meanwhile)
        keys = {k: o.size for k, o in self.c.listing("").items()}
        self.c.release()  # for the survey's first thread
        return keys

    def list_versions(self) -> dict[str, tuple[int, str]]:
        """key -> (size, ETag): a reader that polls small records (the run ledger) reads again only
        those whose ETag changed."""
        self.c.renew()
        out = {k: (o.size, o.etag) for k, o in self.c.listing("").items()}
        self.c.release()
        return out

    def read_file(self, key: str) -> bytes | None:
        light = self.c.client()
        try:
            data = light.read(self.c.full_key(key), SMALL_MAX)
        except NotFound:
            light.release()  # a 404's short body was read: the connection is fit for another
            return None
        light.release()
        return data

    def download(self, unit_key: str, files: list[tuple[str, int]], into: Into,
                 progress: Callable[[int], None]) -> dict[str, str]:
        """Returns rel -> sha256 of what was written, hashed while the download runs (each file's
        ranges in order as they complete), so the caller's check needs no second pass. Each file
        is created once through `into` (no path is joined here) and its ranges are written to
        that one descriptor."""
        part = max(RANGE_MIN, int(self.c.cfg.part_size))
        jobs: list[tuple[str, int, int, int, _OrderedHash]] = []  # key, fd, start, end (inclusive; -1: whole)
        hashes: dict[str, _OrderedHash] = {}
        fds: list[int] = []
        try:
            for rel, size in files:
                fd = into.create(rel, size)
                fds.append(fd)
                key = self.c.full_key(f"{unit_key}/{rel}")
                oh = hashes[rel] = _OrderedHash(fd, rel)
                if size <= part:
                    jobs.append((key, fd, 0, -1, oh))
                else:
                    jobs += [(key, fd, s, min(s + part, size) - 1, oh) for s in range(0, size, part)]
            with ThreadPoolExecutor(max(1, int(self.c.cfg.concurrency)), thread_name_prefix="s3-get") as pool:
                futs = [pool.submit(self._get_range, *j, progress) for j in jobs]
                try:
                    for f in as_completed(futs):
                        f.result()
                except BaseException:
                    for f in futs:
                        f.cancel()
                    raise
            return {rel: oh.hexdigest() for rel, oh in hashes.items()}
        finally:
            for fd in fds:
                os.close(fd)

    def _get_range(self, key: str, fd: int, start: int, end: int, oh: _OrderedHash,
                   progress: Callable[[int], None]) -> None:
        try:
            body, light = self._open(key, start, end)
        except NotFound:
            raise TargetError(f"S3 get {key}: not on the target") from None
        whole_body = False
        off = start
        whole = hashlib.sha256() if end < 0 else None  # one GET for the whole file: hashed as it arrives
        buf = _buffer()
        try:
            while True:
                try:
                    got = body.readinto(buf)
                except Exception as e:  # noqa: BLE001 - a connection dropped mid-body
                    raise TargetError(f"S3 get {key}: {type(e).__name__}: {e}") from None
                if not got:
                    whole_body = True
                    break
                if self.c.limiter:
                    self.c.limiter.take(got)
                if whole is not None:
                    whole.update(buf[:got])
                off = write_all(fd, buf[:got], off)
                progress(got)
        finally:
            body.close()
            if whole_body:
                light.release()
            else:
                light.drop()  # a body left half read must not meet the connection's next request
        if end >= 0 and off != end + 1:
            raise TargetError(f"S3 get {key}: range {start}-{end} came back short ({off - start} bytes)")
        if whole is not None:
            oh.whole(whole, off)
        else:
            oh.done(start, off)

    def _open(self, key: str, start: int, end: int) -> tuple[Any, LightS3]:
        """The body of a GET of key (the range start..end, inclusive, when end >= 0)."""
        light = self.c.client()
        return light.get(key, start, end), light


_local = threading.local()


def _buffer() -> memoryview:
    """This thread's receive buffer: small enough that what is hashed as it arrives is still in the
    CPU's cache, kept for the thread's next GET (a new one would be zeroed each time)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(READ_BUF))
    return buf


class _OrderedHash:
    """The sha256 of a file whose ranges arrive out of order: the thread that completes the range
    at the front hashes every contiguous range now complete (read back from the page cache);
    others only register theirs, so no download thread waits for another's hashing."""

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.h = hashlib.sha256()
        self.next = 0
        self.ready: dict[int, int] = {}
        self.busy = False
        self.lock = threading.Lock()
        self.final: str | None = None

    def whole(self, h: Any, size: int) -> None:
        self.final, self.next = h.hexdigest(), size

    def done(self, start: int, end: int) -> None:
        with self.lock:
            self.ready[start] = end
            if self.busy:
                return
            self.busy = True
        try:
            while True:
                with self.lock:
                    e = self.ready.pop(self.next, None)
                    if e is None:
                        self.busy = False
                        return
                self._hash(self.next, e)
                self.next = e
        except BaseException:
            with self.lock:
                self.busy = False
            raise

    def _hash(self, start: int, end: int) -> None:
        """Read back into this thread's small buffer, hashed while it is in the CPU's cache:
        measured against a map of the file (its page faults cost more than the copy) and 8 MiB
        reads (a new buffer each time, each one faulted in afresh)."""
        view = _buffer()  # this thread's receive buffer: its GET is done by now
        at = start
        while at < end:
            got = os.preadv(self.fd, [view[:min(len(view), end - at)]], at)
            if not got:
                raise TargetError(f"{self.path}: shorter than the ranges written")
            self.h.update(view[:got])
            at += got

    def hexdigest(self) -> str:
        if self.final is not None:
            return self.final
        with self.lock:
            if self.ready or self.busy:
                raise TargetError(f"{self.path}: not every range was hashed")
        return self.h.hexdigest()
