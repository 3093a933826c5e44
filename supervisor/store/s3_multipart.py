"""Large files in parts: create, send over the pool while the sha256 is computed, resume from the
parts the store still lists after a crash, complete and verify by the composite checksum."""

from __future__ import annotations

import base64
import hashlib
import math
import os
import threading
from typing import TYPE_CHECKING

from supervisor.store._log import get_logger
from supervisor.store.base import (
    LocalFile,
    SourceProblem,
    TargetError,
    Uploaded,
    UploadSink,
    check_unchanged,
    open_source,
    pread_exact,
)
from supervisor.store.s3_wire import (
    HASH_CHUNK,
    Abandoned,
    NotFound,
    composite_crc32,
    crc32_b64,
    etag_of,
    md5_b64,
    multipart_etag,
    part_size_for,
)

if TYPE_CHECKING:
    from supervisor.store.s3_client import S3Connection


log = get_logger("sync.s3")


class MultipartPut:
    """The multipart path of S3Target, over its connection's client and pools."""

    def __init__(self, c: S3Connection):
        self.c = c  # the connection: its client, pools, checksum and keys

    def put(self, f: LocalFile, sink: UploadSink) -> Uploaded:
        key = self.c.full_key(f.key)
        psize = part_size_for(f.size, self.c.cfg.part_size)
        nparts = math.ceil(f.size / psize)
        fd = open_source(f)
        upload_id: str | None = None
        try:
            have: dict[int, tuple[str, str]] = {}
            prior = sink.in_flight(f.key)
            info = (prior or {}).get("info") or {}
            if prior and info.get("mode") == "mp":
                same = (prior.get("size") == f.size and prior.get("mtime_ns") == f.mtime_ns
                        and info.get("part_size") == psize)
                if not info.get("upload_id"):
                    self._abort_unrecorded(key)  # the crash came between create and its record
                elif same:
                    upload_id, have, finished = self._resume(key, info["upload_id"], prior, nparts, f.size)
                    if finished is not None:
                        log.info("s3_adopted", key=key, why="completed before a crash")
                        sha = self.c.hash_only(fd, f, sink)
                        return Uploaded(sha, finished, 0)
                else:
                    self._abort(key, info.get("upload_id"))
            if upload_id is None:
                # recorded before the create: after a crash in between, the upload it made is
                # found by its key and aborted, not left behind on the store
                sink.begin(f, {"mode": "mp", "upload_id": "", "part_size": psize})
                upload_id = self.c.call("create_multipart_upload", key, self.c.crc)
                sink.begin(f, {"mode": "mp", "upload_id": upload_id, "part_size": psize})
            else:
                log.info("s3_resume", key=key, parts_kept=len(have), parts=nparts)
            assert self.c.pool is not None
            failed = threading.Event()
            futs = {n: self.c.pool.submit(self._put_part, fd, f, key, upload_id, n, psize, sink, failed)
                    for n in range(1, nparts + 1) if n not in have}
            try:
                h = hashlib.sha256()
                off = 0
                while off < f.size and not failed.is_set():
                    chunk = pread_exact(fd, f, min(HASH_CHUNK, f.size - off), off)
                    h.update(chunk)
                    off += len(chunk)
            finally:
                results = {}
                first_err: BaseException | None = None
                for n, fut in futs.items():
                    try:
                        results[n] = fut.result()
                    except BaseException as e:  # noqa: BLE001 - collected, re-raised below
                        if first_err is None or isinstance(first_err, Abandoned):
                            first_err = e
            if first_err is not None:
                raise first_err
            have.update(results)
            check_unchanged(fd, f)
            parts = [(n, have[n][0], have[n][1] if self.c.crc else "") for n in range(1, nparts + 1)]
            resp = self.c.call("complete_multipart_upload", key, upload_id, parts)
            checks = [have[n][1] for n in range(1, nparts + 1)]
            etag = etag_of(resp.get("ETag"))
            self._verify_complete(key, f.size, checks, resp.get("ChecksumCRC32"), etag)
            return Uploaded(h.hexdigest(), etag, sum(min(psize, f.size - (n - 1) * psize) for n in results))
        except SourceProblem:
            if upload_id:
                self._abort(key, upload_id)
            raise
        finally:
            os.close(fd)

    def _verify_complete(self, key: str, size: int, checks: list[str], echoed: str | None, etag: str) -> None:
        if self.c.crc:
            want = composite_crc32(checks)
            if echoed is not None:
                if echoed.split()[0] != want:
                    raise TargetError(f"S3 complete {key}: store reports checksum {echoed}, expected {want}")
                return  # the store's checksum of the whole names exactly our parts, sizes included
        else:
            want = multipart_etag(checks)
            if etag != want:
                raise TargetError(f"S3 complete {key}: ETag {etag}, expected {want}")
            return  # likewise: the multipart ETag is made of our parts' MD5s
        h = self.c.call("head_object", key)
        if int(h.get("ContentLength", -1)) != size:
            raise TargetError(f"S3 {key}: store holds {h.get('ContentLength')} bytes, expected {size}")

    def _resume(self, key: str, upload_id: str, prior: dict, nparts: int,
                size: int) -> tuple[str | None, dict[int, tuple[str, str]], str | None]:
        """(upload id to continue or None, parts to keep, ETag when the upload had completed)."""
        journal = {int(n): (e, c, s) for n, (e, c, s) in (prior.get("parts") or {}).items()}
        try:
            listed = self._list_parts(key, upload_id)
        except NotFound:
            # Gone: completed just before the crash, or aborted. Completed if the object has
            # the size and checksum all journalled parts add up to.
            if len(journal) == nparts:
                checks = [journal[n][1] for n in range(1, nparts + 1)]
                try:
                    h = self.c.call("head_object", key, checksum=True)
                except NotFound:
                    return None, {}, None
                if int(h.get("ContentLength", -1)) == size:
                    etag = etag_of(h.get("ETag"))
                    if self.c.crc and (h.get("ChecksumCRC32") or "").split()[0] == composite_crc32(checks):
                        return None, {}, etag
                    if not self.c.crc and etag == multipart_etag(checks):
                        return None, {}, etag
            return None, {}, None
        keep = {}
        for n, (etag, cs, psz) in journal.items():
            got = listed.get(n)
            if got is not None and etag_of(got[0]) == etag_of(etag) and got[1] == psz:
                keep[n] = (etag_of(etag), cs)
        return upload_id, keep, None

    def _list_parts(self, key: str, upload_id: str) -> dict[int, tuple[str, int]]:
        out: dict[int, tuple[str, int]] = {}
        marker = 0
        while True:
            page, marker = self.c.call("list_parts", key, upload_id, marker)
            out.update(page)
            if not marker:
                return out

    def _abort_unrecorded(self, key: str) -> None:
        """Abort the multipart uploads of exactly `key` (one was created, its id never recorded)."""
        try:
            uploads = self.c.call("list_multipart_uploads", key)
        except (NotFound, TargetError) as e:
            log.debug("s3_list_uploads_failed", key=key, error=str(e))
            return
        for k, upload_id in uploads:
            if k == key:
                self._abort(key, upload_id)

    def _abort(self, key: str, upload_id: str | None) -> None:
        if not upload_id:
            return
        try:
            self.c.call("abort_multipart_upload", key, upload_id)
        except (NotFound, TargetError) as e:
            log.debug("s3_abort_failed", key=key, error=str(e))

    def _put_part(self, fd: int, f: LocalFile, key: str, upload_id: str, n: int, psize: int,
                  sink: UploadSink, failed: threading.Event) -> tuple[str, str]:
        try:
            return self._send_part(fd, f, key, upload_id, n, psize, sink, failed)
        except BaseException:
            failed.set()
            raise

    def _send_part(self, fd: int, f: LocalFile, key: str, upload_id: str, n: int, psize: int,
                   sink: UploadSink, failed: threading.Event) -> tuple[str, str]:
        if sink.cancelled() or failed.is_set():
            raise Abandoned("upload abandoned")
        off = (n - 1) * psize
        ln = min(psize, f.size - off)
        data = pread_exact(fd, f, ln, off)
        cs = crc32_b64(data) if self.c.crc else md5_b64(data)
        if self.c.limiter:
            self.c.limiter.take(ln)
        resp = self.c.call("upload_part", key, upload_id, n, data,
                           {"x-amz-checksum-crc32": cs} if self.c.crc else {"Content-MD5": cs})
        etag = etag_of(resp.get("ETag"))
        if self.c.crc:
            echoed = resp.get("ChecksumCRC32")
            if echoed is not None and echoed != cs:
                raise TargetError(f"S3 part {n} of {key}: store reports checksum {echoed}, sent {cs}")
        elif etag != base64.b64decode(cs).hex():
            raise TargetError(f"S3 part {n} of {key}: ETag {etag} is not the MD5 of what was sent")
        sink.part(f, n, etag, cs, ln)
        sink.progress(f, ln)
        return etag, cs
