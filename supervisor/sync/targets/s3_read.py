"""The S3 target's read side (resume): listing, small reads, and downloads by parallel ranged GETs
over the connection's one boto3 client (its pool holds concurrency*2+4 connections).

A file larger than one part is fetched in `part_size` ranges (at least 8 MiB) written in place
with pwrite into a file of its final size, all files of the unit sharing one pool of `concurrency`
threads, so a 2 GiB checkpoint and a LoRA folder of 40 small files both keep every connection
busy. The content is verified by the caller against the manifest's sha256."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from supervisor.sync.targets.base import TargetError
from supervisor.sync.targets.s3_wire import NotFound

RANGE_MIN = 8 << 20
SMALL_MAX = 64 << 20


class S3Reader:
    """Mixed into S3Target; uses S3Connection's `_call`, `_key`, `listing`, `cfg`, `limiter`."""

    _call: Callable[..., Any]
    _key: Callable[[str], str]
    listing: Callable[[str], dict]
    cfg: Any
    limiter: Any
    bucket: str

    def list_keys(self) -> dict[str, int]:
        return {k: o.size for k, o in self.listing("").items()}

    def read_file(self, key: str) -> bytes | None:
        try:
            resp = self._call("get_object", Bucket=self.bucket, Key=self._key(key))
        except NotFound:
            return None
        body = resp["Body"]
        try:
            return body.read(SMALL_MAX)
        except Exception as e:  # noqa: BLE001 - a connection dropped mid-body
            raise TargetError(f"S3 get {key}: {type(e).__name__}: {e}") from None
        finally:
            body.close()

    def download(self, unit_key: str, files: list[tuple[str, int]], dest_dir: str,
                 progress: Callable[[int], None]) -> None:
        part = max(RANGE_MIN, int(self.cfg.part_size))
        jobs: list[tuple[str, str, int, int]] = []  # key, dest, start, end (inclusive; -1: whole)
        for rel, size in files:
            dest = os.path.join(dest_dir, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as fh:
                if size > 0:
                    fh.truncate(size)
            key = self._key(f"{unit_key}/{rel}")
            if size <= part:
                jobs.append((key, dest, 0, -1))
            else:
                jobs += [(key, dest, s, min(s + part, size) - 1) for s in range(0, size, part)]
        with ThreadPoolExecutor(max(1, int(self.cfg.concurrency)), thread_name_prefix="s3-get") as pool:
            futs = [pool.submit(self._get_range, *j, progress) for j in jobs]
            try:
                for f in as_completed(futs):
                    f.result()
            except BaseException:
                for f in futs:
                    f.cancel()
                raise

    def _get_range(self, key: str, dest: str, start: int, end: int, progress: Callable[[int], None]) -> None:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if end >= 0:
            kw["Range"] = f"bytes={start}-{end}"
        try:
            resp = self._call("get_object", **kw)
        except NotFound:
            raise TargetError(f"S3 get {key}: not on the target") from None
        body = resp["Body"]
        fd = os.open(dest, os.O_WRONLY | os.O_CLOEXEC)
        off = start
        try:
            while True:
                try:
                    chunk = body.read(1 << 20)
                except Exception as e:  # noqa: BLE001 - a connection dropped mid-body
                    raise TargetError(f"S3 get {key}: {type(e).__name__}: {e}") from None
                if not chunk:
                    break
                if self.limiter:
                    self.limiter.take(len(chunk))
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(fd, view, off)
                    view = view[n:]
                    off += n
                progress(len(chunk))
        finally:
            os.close(fd)
            body.close()
        if end >= 0 and off != end + 1:
            raise TargetError(f"S3 get {key}: range {start}-{end} came back short ({off - start} bytes)")
