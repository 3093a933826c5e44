"""S3 and S3-compatible stores, through the one S3 client (s3_light.py, over s3_client.py's connection).

Integrity: every request carries a checksum of its body that the store verifies before accepting
it (CRC32 with `request_checksum_calculation = "when_supported"`, Content-MD5 with
"when_required" for stores that reject the newer checksum headers). A single PUT is verified by
the checksum (or ETag) the store echoes; a multipart upload by the composite checksum (or
multipart ETag) the store computes on completion, compared with ours, and the object's size.

Resumable: the multipart upload id and every finished part are journalled in the ledger; after a
crash the upload continues with the parts the store still lists (same ETag and size), and an
upload that was completed just before the crash is recognised by its size and checksum instead
of being sent again.

Speed: files up to `multipart_threshold` go in one PUT each, concurrently (a 16-50 MiB LoRA
optimizer in 4-6 part requests costs more than it saves); larger ones in `part_size` parts over
`concurrency` connections while this thread hashes the file (sha256 for the manifest) in
parallel. A single PUT above BUFFER_MAX is streamed from the file (its checksum computed in a
first read, the sha256 of the bytes as they go out), so 16 of them in flight hold no more memory
than 16 parts do. The client is built at the first request, so a pass with nothing to send never
pays for it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, wait
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
    sha256_fd,
)
from supervisor.store.s3_client import S3Connection
from supervisor.store.s3_multipart import MultipartPut
from supervisor.store.s3_read import S3Reader
from supervisor.store.s3_wire import (
    BUFFER_MAX,
    COPY_MIN,
    HASH_CHUNK,
    MD5_HEX,
    Abandoned,
    FileBody,
    NotFound,
    Refused,
    crc32_b64,
    etag_of,
    md5_b64,
)

if TYPE_CHECKING:
    from supervisor.config import SyncConfig
    from supervisor.config.target import TargetURL
    from supervisor.store.credentials import CredentialWatch

log = get_logger("sync.s3")


class S3Target(S3Connection):
    """Uploads: small files in one PUT (or a server-side copy of a twin the store holds), large
    ones by its MultipartPut; the connection and listings are S3Connection's, the read side (a
    restore) its S3Reader."""

    def __init__(self, url: TargetURL, cfg: SyncConfig, creds: CredentialWatch | None = None):
        super().__init__(url, cfg, creds)
        self.multipart = MultipartPut(self)
        self.reader = S3Reader(self)

    # --- uploads -------------------------------------------------------------------------------
    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None:
        """Files in the caller's order, several in flight at once (a window of 2 x concurrency):
        large ones go in parts that share the request pool with the small files, and each file
        is reported (to the ledger) the moment the store has it, so a crash re-sends nothing
        that was finished. The window keeps the order: the caller's first folder completes
        first instead of all of them at the end."""
        self.pools()  # the client is built by the first request (s3_client.py)
        assert self.pool is not None and self._files is not None
        queue = list(reversed(files))
        running: set[Future] = set()
        window = max(2, 2 * self.cfg.concurrency)
        failure: TargetError | None = None
        while queue or running:
            while queue and len(running) < window and failure is None and not sink.cancelled():
                f = queue.pop()
                if f.size > self.single_put_max:
                    running.add(self._files.submit(self._report, self.multipart.put, f, sink))
                else:
                    running.add(self.pool.submit(self._report, self._put_small, f, sink))
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                try:
                    fut.result()
                except TargetError as e:
                    if failure is None or isinstance(failure, Abandoned):
                        failure = e
        if failure:
            raise failure

    def _report(self, fn, f: LocalFile, sink: UploadSink) -> None:
        if sink.cancelled():
            return
        try:
            res = fn(f, sink)
        except SourceProblem as e:
            sink.problem(f, e)
            return
        except (TargetError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - anything else on the way is a failed upload
            raise TargetError(f"S3 upload of {f.key}: {type(e).__name__}: {e}") from None
        if res is not None:
            sink.done(f, res)

    def _put_small(self, f: LocalFile, sink: UploadSink) -> Uploaded | None:
        if sink.cancelled():
            return None
        fd = open_source(f)
        try:
            return self._put_single(fd, f, sink)
        finally:
            os.close(fd)

    def _put_single(self, fd: int, f: LocalFile, sink: UploadSink) -> Uploaded | None:
        body: bytes | FileBody
        if f.size <= BUFFER_MAX:
            data = pread_exact(fd, f, f.size, 0) if f.size else b""
            check_unchanged(fd, f)
            sha: str | None = hashlib.sha256(data).hexdigest()
            cs = crc32_b64(data) if self.crc else md5_b64(data)
            body = data
        else:
            sha, cs = None, self._checksum_file(fd, f)
            body = FileBody(fd, f, self.limiter)
        key = self.full_key(f.key)
        prior = sink.in_flight(f.key)
        if prior and prior.get("size") == f.size and prior.get("mtime_ns") == f.mtime_ns:
            held = self._holds_single(key, f.size, cs)
            if held is not None:
                log.info("s3_adopted", key=key, why="finished before a crash")
                return Uploaded(sha or self.hash_only(fd, f, sink), held, 0)
        if sha is not None and f.size >= COPY_MIN and self._copies:
            copied = self._copy_twin(f, key, sha, cs, sink)
            if copied is not None:
                return copied
        sink.begin(f, {"mode": "put"})
        if self.limiter and isinstance(body, bytes):
            self.limiter.take(len(body))  # a FileBody takes its share as it is read
        resp = self.call("put_object", key, body, {"x-amz-checksum-crc32": cs} if self.crc else {"Content-MD5": cs})
        etag = etag_of(resp.get("ETag"))
        if self.crc:
            echoed = resp.get("ChecksumCRC32")
            if echoed is not None and echoed != cs:
                raise TargetError(f"S3 put {key}: store reports checksum {echoed}, sent {cs}")
        elif etag != base64.b64decode(cs).hex():
            raise TargetError(f"S3 put {key}: ETag {etag} is not the MD5 of what was sent")
        if isinstance(body, FileBody):
            # the store checked the body against `cs`; this names the file as it still is
            check_unchanged(fd, f)
            sha = body.sha256()
        sink.progress(f, f.size)
        assert sha is not None
        return Uploaded(sha, etag, f.size)

    def _copy_twin(self, f: LocalFile, key: str, sha: str, cs: str, sink: UploadSink) -> Uploaded | None:
        """The target already holds these exact bytes under another key (the same tokenizer.json
        in every checkpoint): a server-side copy sends none of them. Accepted only when the
        store's own fingerprint of the copy proves the content: the CRC32 it computed equal to
        ours, or (a store that returns none) its MD5 ETag equal to the one it gave the source
        when the source was verified, whose sha256 is this file's. No twin, a copy refused (a
        key allowed PutObject but not GetObject), a source gone, a fingerprint that differs:
        the caller PUTs the bytes instead."""
        twin = getattr(sink, "twin", None)
        found = twin(f, sha) if twin is not None else None
        if found is None:
            return None
        src, src_etag = found
        if not self.crc:
            want = base64.b64decode(cs).hex()  # the MD5 of our bytes
        elif MD5_HEX.fullmatch(src_etag):
            want = src_etag
        else:
            return None  # a multipart or encrypted source's ETag is no MD5: it would prove nothing
        sink.begin(f, {"mode": "copy"})
        try:
            res = self.call("copy_object", key, self.full_key(src), self.crc)
        except NotFound:
            return None  # keep_last (or someone) deleted the source meanwhile
        except Refused as e:
            self._copies = False  # a permission does not come back by itself: not tried again this run
            log.info("s3_copy_refused", key=key, error=str(e), note="sending the bytes; no more copies this run")
            return None
        except TargetError as e:
            log.info("s3_copy_failed", key=key, error=str(e), note="sending the bytes")
            return None
        etag, crc = etag_of(res.get("ETag")), res.get("ChecksumCRC32")
        if (crc == cs) if (self.crc and crc) else (etag == want):
            return Uploaded(sha, etag, 0)  # no bytes went out: no progress to report
        log.warning("s3_copy_mismatch", key=key, source=src, etag=etag, expected=want, checksum=crc,
                    note="sending the bytes instead")
        return None

    def _checksum_file(self, fd: int, f: LocalFile) -> str:
        """The request checksum of a whole file, read in HASH_CHUNK pieces."""
        crc, md5 = 0, hashlib.md5()
        off = 0
        while off < f.size:
            chunk = pread_exact(fd, f, min(HASH_CHUNK, f.size - off), off)
            if self.crc:
                crc = zlib.crc32(chunk, crc)
            else:
                md5.update(chunk)
            off += len(chunk)
        if self.crc:
            return base64.b64encode(struct.pack(">I", crc & 0xFFFFFFFF)).decode()
        return base64.b64encode(md5.digest()).decode()

    def _holds_single(self, key: str, size: int, cs: str) -> str | None:
        try:
            h = self.call("head_object", key, checksum=True)
        except NotFound:
            return None
        if int(h.get("ContentLength", -1)) != size:
            return None
        etag = etag_of(h.get("ETag"))
        if self.crc and h.get("ChecksumCRC32") == cs:
            return etag
        if not self.crc and etag == base64.b64decode(cs).hex():
            return etag
        return None

    def hash_only(self, fd: int, f: LocalFile, sink: UploadSink) -> str:
        return sha256_fd(fd, f, HASH_CHUNK)
