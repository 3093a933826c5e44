"""S3 and S3-compatible stores through boto3.

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
than 16 parts do. boto3 is imported on first use, so a pass with nothing to send never pays for it.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
import struct
import threading
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any
from urllib.parse import urlparse

from ...config import SyncConfig
from ...syncurl import TargetURL
from .._log import get_logger
from ..policy import MANIFEST_NAME
from .base import (
    LocalFile,
    RemoteObject,
    SourceProblem,
    TargetError,
    TokenBucket,
    Uploaded,
    UploadSink,
    check_unchanged,
    join_key,
    open_source,
    pread_exact,
    sha256_fd,
)

log = get_logger("sync.s3")

MAX_PARTS = 10000
HASH_CHUNK = 8 << 20
BUFFER_MAX = 8 << 20  # a single PUT up to this is read into memory whole; above, streamed
COPY_MIN = 256 << 10  # below this a copy request saves too little over the PUT it replaces
_MD5_HEX = re.compile(r"[0-9a-f]{32}")
_AUTH_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
               "ExpiredToken", "AuthorizationHeaderMalformed"}
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def part_size_for(size: int, configured: int) -> int:
    """At most 10,000 parts: grow the part size (in whole MiB) for very large files."""
    need = math.ceil(size / MAX_PARTS)
    ps = max(configured, need)
    mib = 1024 * 1024
    return ((ps + mib - 1) // mib) * mib


def crc32_b64(data: bytes | memoryview) -> str:
    return base64.b64encode(struct.pack(">I", zlib.crc32(data) & 0xFFFFFFFF)).decode()


def md5_b64(data: bytes | memoryview) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def composite_crc32(part_checksums: list[str]) -> str:
    raw = b"".join(base64.b64decode(c) for c in part_checksums)
    return f"{crc32_b64(raw)}-{len(part_checksums)}"


def multipart_etag(part_md5_b64: list[str]) -> str:
    raw = b"".join(base64.b64decode(c) for c in part_md5_b64)
    return f"{hashlib.md5(raw).hexdigest()}-{len(part_md5_b64)}"


def _etag(v: str | None) -> str:
    return (v or "").strip('"')


class S3Target:
    def __init__(self, url: TargetURL, cfg: SyncConfig):
        self.bucket = url.bucket
        self.prefix = url.prefix
        self.cfg = cfg
        self.display = url.display()
        self.crc = cfg.request_checksum_calculation == "when_supported"
        self.single_put_max = cfg.multipart_threshold
        self.limiter = TokenBucket(cfg.bandwidth_limit) if cfg.bandwidth_limit else None
        self._client: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._files: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._prep_lock = threading.Lock()
        self._preparing = False
        self._copies = True  # server-side copies of content the target holds; off once refused

    # --- plumbing -------------------------------------------------------------------------------
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
                self._pool = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="s3-put")
                # large files: one thread each to create, hash and complete; parts go to _pool
                self._files = ThreadPoolExecutor(min(4, self.cfg.concurrency), thread_name_prefix="s3-file")
            return self._client

    def prepare(self) -> None:
        """Build the client on a thread of its own (importing boto3 takes a CPU-tenth of a
        second) while the scan still runs; the first request then finds it ready."""
        # not self._lock: client() holds it while the client is built, and the scan calling
        # this for every unit must not wait for that
        with self._prep_lock:
            if self._client is not None or self._preparing:
                return
            self._preparing = True
        threading.Thread(target=self._prepare, name="s3-prepare", daemon=True).start()

    def _prepare(self) -> None:
        try:
            self.client()
        except Exception as e:  # noqa: BLE001 - the first real request reports it
            log.debug("s3_prepare_failed", error=str(e))

    def _make_client(self) -> Any:
        import boto3
        import botocore.session
        from botocore.config import Config

        bs = botocore.session.Session()
        if self.cfg.credentials_file:
            bs.set_config_variable("credentials_file", self.cfg.credentials_file)
        session = boto3.Session(botocore_session=bs)
        s3cfg: dict[str, Any] = {}
        ep = self.cfg.endpoint_url
        if ep:
            s3cfg["addressing_style"] = "path"
            host = urlparse(ep).hostname or ""
            if host in _LOOPBACK:
                # Payload signing guards bytes in transit; loopback has no transit, and the body
                # checksum the store verifies still covers integrity.
                s3cfg["payload_signing_enabled"] = False
        conf = Config(
            region_name=self.cfg.region or None,
            max_pool_connections=self.cfg.concurrency * 2 + 4,
            retries={"total_max_attempts": 3, "mode": "standard"},
            connect_timeout=10,
            read_timeout=120,
            tcp_keepalive=True,
            request_checksum_calculation=self.cfg.request_checksum_calculation,
            response_checksum_validation="when_required",
            s3=s3cfg,
        )
        kw: dict[str, Any] = {"config": conf}
        if ep:
            kw["endpoint_url"] = ep
        if not self.cfg.region and not session.region_name:
            kw["region_name"] = "us-east-1"
        client = session.client("s3", **kw)
        client.meta.events.register("before-sign.s3.PutObject", _no_expect_for_small_bodies)
        client.meta.events.register("before-sign.s3.UploadPart", _no_expect_for_small_bodies)
        return client

    def _key(self, k: str) -> str:
        return join_key(self.prefix, k)

    def _call(self, op: str, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client(), op)(**kw)
        except ClientError as e:
            err = e.response.get("Error", {})
            code = err.get("Code", "?")
            if code in ("NoSuchUpload", "NoSuchKey", "404", "NotFound"):
                raise _NotFound(code) from None
            msg = err.get("Message", "") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
            if code in _AUTH_CODES:
                raise _Refused(f"S3 {op} {kw.get('Key', '')}: {code}: {msg} (check the credentials and the "
                               "bucket's permissions)".strip()) from None
            raise TargetError(f"S3 {op} {kw.get('Key', '')}: {code}: {msg}".strip()) from None
        except BotoCoreError as e:
            raise TargetError(f"S3 {op}: {e}") from None

    # --- uploads -------------------------------------------------------------------------------
    def put_files(self, files: list[LocalFile], sink: UploadSink) -> None:
        """Files in the caller's order, several in flight at once (a window of 2 x concurrency):
        large ones go in parts that share the request pool with the small files, and each file
        is reported (to the ledger) the moment the store has it, so a crash re-sends nothing
        that was finished. The window keeps the order: the caller's first folder completes
        first instead of all of them at the end."""
        self.client()
        assert self._pool is not None and self._files is not None
        queue = list(reversed(files))
        running: set[Future] = set()
        window = max(2, 2 * self.cfg.concurrency)
        failure: TargetError | None = None
        while queue or running:
            while queue and len(running) < window and failure is None and not sink.cancelled():
                f = queue.pop()
                if f.size > self.single_put_max:
                    running.add(self._files.submit(self._report, self._put_large, f, sink))
                else:
                    running.add(self._pool.submit(self._report, self._put_small, f, sink))
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                try:
                    fut.result()
                except TargetError as e:
                    if failure is None or isinstance(failure, _Abandoned):
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
        except Exception as e:  # noqa: BLE001 - anything else from boto/urllib3 is a failed upload
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
        body: bytes | _FileBody
        if f.size <= BUFFER_MAX:
            data = pread_exact(fd, f, f.size, 0) if f.size else b""
            check_unchanged(fd, f)
            sha: str | None = hashlib.sha256(data).hexdigest()
            cs = crc32_b64(data) if self.crc else md5_b64(data)
            body = data
        else:
            sha, cs = None, self._checksum_file(fd, f)
            body = _FileBody(fd, f, self.limiter)
        key = self._key(f.key)
        prior = sink.in_flight(f.key)
        if prior and prior.get("size") == f.size and prior.get("mtime_ns") == f.mtime_ns:
            held = self._holds_single(key, f.size, cs)
            if held is not None:
                log.info("s3_adopted", key=key, why="finished before a crash")
                return Uploaded(sha or self._hash_only(fd, f, sink), held, 0)
        if sha is not None and f.size >= COPY_MIN and self._copies:
            copied = self._copy_twin(f, key, sha, cs, sink)
            if copied is not None:
                return copied
        sink.begin(f, {"mode": "put"})
        if self.limiter and isinstance(body, bytes):
            self.limiter.take(len(body))  # a _FileBody takes its share as it is read
        extra = {"ChecksumCRC32": cs} if self.crc else {"ContentMD5": cs}
        resp = self._call("put_object", Bucket=self.bucket, Key=key, Body=body, **extra)
        etag = _etag(resp.get("ETag"))
        if self.crc:
            echoed = resp.get("ChecksumCRC32")
            if echoed is not None and echoed != cs:
                raise TargetError(f"S3 put {key}: store reports checksum {echoed}, sent {cs}")
        elif etag != base64.b64decode(cs).hex():
            raise TargetError(f"S3 put {key}: ETag {etag} is not the MD5 of what was sent")
        if isinstance(body, _FileBody):
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
        elif _MD5_HEX.fullmatch(src_etag):
            want = src_etag
        else:
            return None  # a multipart or encrypted source's ETag is no MD5: it would prove nothing
        sink.begin(f, {"mode": "copy"})
        extra = {"ChecksumAlgorithm": "CRC32"} if self.crc else {}
        try:
            resp = self._call("copy_object", Bucket=self.bucket, Key=key,
                              CopySource={"Bucket": self.bucket, "Key": self._key(src)}, **extra)
        except _NotFound:
            return None  # keep_last (or someone) deleted the source meanwhile
        except _Refused as e:
            self._copies = False  # a permission does not come back by itself: not tried again this run
            log.info("s3_copy_refused", key=key, error=str(e), note="sending the bytes; no more copies this run")
            return None
        except TargetError as e:
            log.info("s3_copy_failed", key=key, error=str(e), note="sending the bytes")
            return None
        res = resp.get("CopyObjectResult") or {}
        etag, crc = _etag(res.get("ETag")), res.get("ChecksumCRC32")
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
            h = self._call("head_object", Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        except _NotFound:
            return None
        if int(h.get("ContentLength", -1)) != size:
            return None
        etag = _etag(h.get("ETag"))
        if self.crc and h.get("ChecksumCRC32") == cs:
            return etag
        if not self.crc and etag == base64.b64decode(cs).hex():
            return etag
        return None

    def _put_large(self, f: LocalFile, sink: UploadSink) -> Uploaded:
        key = self._key(f.key)
        psize = part_size_for(f.size, self.cfg.part_size)
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
                        sha = self._hash_only(fd, f, sink)
                        return Uploaded(sha, finished, 0)
                else:
                    self._abort(key, info.get("upload_id"))
            if upload_id is None:
                # recorded before the create: after a crash in between, the upload it made is
                # found by its key and aborted, not left behind on the store
                sink.begin(f, {"mode": "mp", "upload_id": "", "part_size": psize})
                extra = {"ChecksumAlgorithm": "CRC32"} if self.crc else {}
                resp = self._call("create_multipart_upload", Bucket=self.bucket, Key=key, **extra)
                upload_id = resp["UploadId"]
                sink.begin(f, {"mode": "mp", "upload_id": upload_id, "part_size": psize})
            else:
                log.info("s3_resume", key=key, parts_kept=len(have), parts=nparts)
            assert self._pool is not None
            failed = threading.Event()
            futs = {n: self._pool.submit(self._put_part, fd, f, key, upload_id, n, psize, sink, failed)
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
                        if first_err is None or isinstance(first_err, _Abandoned):
                            first_err = e
            if first_err is not None:
                raise first_err
            have.update(results)
            check_unchanged(fd, f)
            parts = []
            for n in range(1, nparts + 1):
                etag, cs = have[n]
                p = {"PartNumber": n, "ETag": f'"{etag}"'}
                if self.crc:
                    p["ChecksumCRC32"] = cs
                parts.append(p)
            resp = self._call("complete_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id,
                              MultipartUpload={"Parts": parts})
            checks = [have[n][1] for n in range(1, nparts + 1)]
            etag = _etag(resp.get("ETag"))
            self._verify_complete(key, f.size, checks, resp.get("ChecksumCRC32"), etag)
            return Uploaded(h.hexdigest(), etag, sum(min(psize, f.size - (n - 1) * psize) for n in results))
        except SourceProblem:
            if upload_id:
                self._abort(key, upload_id)
            raise
        finally:
            os.close(fd)

    def _hash_only(self, fd: int, f: LocalFile, sink: UploadSink) -> str:
        return sha256_fd(fd, f, HASH_CHUNK)

    def _verify_complete(self, key: str, size: int, checks: list[str], echoed: str | None, etag: str) -> None:
        if self.crc:
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
        h = self._call("head_object", Bucket=self.bucket, Key=key)
        if int(h.get("ContentLength", -1)) != size:
            raise TargetError(f"S3 {key}: store holds {h.get('ContentLength')} bytes, expected {size}")

    def _resume(self, key: str, upload_id: str, prior: dict, nparts: int,
                size: int) -> tuple[str | None, dict[int, tuple[str, str]], str | None]:
        """(upload id to continue or None, parts to keep, ETag when the upload had completed)."""
        journal = {int(n): (e, c, s) for n, (e, c, s) in (prior.get("parts") or {}).items()}
        try:
            listed = self._list_parts(key, upload_id)
        except _NotFound:
            # Gone: completed just before the crash, or aborted. Completed if the object has
            # the size and checksum all journalled parts add up to.
            if len(journal) == nparts:
                checks = [journal[n][1] for n in range(1, nparts + 1)]
                try:
                    h = self._call("head_object", Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
                except _NotFound:
                    return None, {}, None
                if int(h.get("ContentLength", -1)) == size:
                    etag = _etag(h.get("ETag"))
                    if self.crc and (h.get("ChecksumCRC32") or "").split()[0] == composite_crc32(checks):
                        return None, {}, etag
                    if not self.crc and etag == multipart_etag(checks):
                        return None, {}, etag
            return None, {}, None
        keep = {}
        for n, (etag, cs, psz) in journal.items():
            got = listed.get(n)
            if got is not None and _etag(got[0]) == _etag(etag) and got[1] == psz:
                keep[n] = (_etag(etag), cs)
        return upload_id, keep, None

    def _list_parts(self, key: str, upload_id: str) -> dict[int, tuple[str, int]]:
        out: dict[int, tuple[str, int]] = {}
        marker = 0
        while True:
            resp = self._call("list_parts", Bucket=self.bucket, Key=key, UploadId=upload_id,
                              PartNumberMarker=marker, MaxParts=1000)
            for p in resp.get("Parts") or []:
                out[int(p["PartNumber"])] = (_etag(p.get("ETag")), int(p.get("Size", -1)))
            if not resp.get("IsTruncated"):
                return out
            marker = int(resp.get("NextPartNumberMarker") or 0)
            if not marker:
                return out

    def _abort_unrecorded(self, key: str) -> None:
        """Abort the multipart uploads of exactly `key` (one was created, its id never recorded)."""
        try:
            resp = self._call("list_multipart_uploads", Bucket=self.bucket, Prefix=key)
        except (_NotFound, TargetError) as e:
            log.debug("s3_list_uploads_failed", key=key, error=str(e))
            return
        for u in resp.get("Uploads") or []:
            if u.get("Key") == key:
                self._abort(key, u.get("UploadId"))

    def _abort(self, key: str, upload_id: str | None) -> None:
        if not upload_id:
            return
        try:
            self._call("abort_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id)
        except (_NotFound, TargetError) as e:
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
            raise _Abandoned("upload abandoned")
        off = (n - 1) * psize
        ln = min(psize, f.size - off)
        data = pread_exact(fd, f, ln, off)
        cs = crc32_b64(data) if self.crc else md5_b64(data)
        if self.limiter:
            self.limiter.take(ln)
        extra = {"ChecksumCRC32": cs} if self.crc else {"ContentMD5": cs}
        resp = self._call("upload_part", Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=n,
                          Body=data, **extra)
        etag = _etag(resp.get("ETag"))
        if self.crc:
            echoed = resp.get("ChecksumCRC32")
            if echoed is not None and echoed != cs:
                raise TargetError(f"S3 part {n} of {key}: store reports checksum {echoed}, sent {cs}")
        elif etag != base64.b64decode(cs).hex():
            raise TargetError(f"S3 part {n} of {key}: ETag {etag} is not the MD5 of what was sent")
        sink.part(f, n, etag, cs, ln)
        sink.progress(f, ln)
        return etag, cs

    # --- manifests, checks, deletes ------------------------------------------------------------
    def write_manifest(self, unit_key: str, data: bytes) -> None:
        key = self._key(join_key(unit_key, MANIFEST_NAME))
        extra = {"ChecksumCRC32": crc32_b64(data)} if self.crc else {"ContentMD5": md5_b64(data)}
        self._call("put_object", Bucket=self.bucket, Key=key, Body=data, ContentType="application/json", **extra)

    def delete_manifest(self, unit_key: str) -> None:
        key = self._key(join_key(unit_key, MANIFEST_NAME))
        try:
            self._call("delete_object", Bucket=self.bucket, Key=key)
        except _NotFound:
            pass

    def listing(self, prefix: str) -> dict[str, RemoteObject]:
        """Every object under prefix (relative keys)."""
        full = self._key(prefix)
        out: dict[str, RemoteObject] = {}
        token = None
        base = (self.prefix.strip("/") + "/") if self.prefix.strip("/") else ""
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                kw["ContinuationToken"] = token
            try:
                resp = self._call("list_objects_v2", **kw)
            except _NotFound as e:
                raise TargetError(f"S3 list {full}: {e}") from None
            for o in resp.get("Contents") or []:
                k = o["Key"]
                rel = k[len(base):] if base and k.startswith(base) else k
                out[rel] = RemoteObject(int(o.get("Size", -1)), _etag(o.get("ETag")))
            if not resp.get("IsTruncated"):
                return out
            token = resp.get("NextContinuationToken")

    def missing(self, expected: dict[str, tuple[int, str]]) -> list[str]:
        groups: dict[str, list[str]] = {}
        for k in expected:
            top = k.split("/", 1)[0]
            groups.setdefault(top + "/" if "/" in k else k, []).append(k)
        out = []
        for prefix, keys in groups.items():
            have = self.listing(prefix)
            for k in keys:
                size, etag = expected[k]
                o = have.get(k)
                if o is None or (size >= 0 and o.size != size) or (etag and o.etag and o.etag != etag):
                    out.append(k)
        return out

    def delete_prefix(self, unit_key: str) -> None:
        if not unit_key.strip("/"):
            raise TargetError("refusing to delete the whole target")
        self.delete_manifest(unit_key)
        keys = sorted(self.listing(unit_key.rstrip("/") + "/"))
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            self._call("delete_objects", Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def close(self) -> None:
        with self._lock:
            for pool in (self._pool, self._files):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._files = None
            if self._client is not None:
                try:
                    self._client.close()  # its keep-alive connections
                except Exception:  # noqa: BLE001 - closing must not raise
                    pass
                self._client = None


def _no_expect_for_small_bodies(request: Any, **_kw: Any) -> None:
    """botocore asks for `100-continue` on every PUT: a round trip per file or part before the
    body goes out, for nothing (a refused body of some MiB costs less than that wait on every
    accepted one). Bodies above 64 MiB keep it."""
    if "Expect" not in request.headers:
        return
    try:
        n = len(request.body)
    except TypeError:
        return
    if n <= 64 * 1024 * 1024:
        del request.headers["Expect"]


class _FileBody:
    """A file as a request body that botocore reads as it sends: never more than one read in
    memory, the bandwidth limit taken as it goes, and the sha256 of the bytes read once in
    order (a retry that seeks back re-reads without hashing twice)."""

    def __init__(self, fd: int, f: LocalFile, limiter: TokenBucket | None):
        self.fd, self.f, self.limiter = fd, f, limiter
        self.pos = 0
        self._hashed = 0
        self._h = hashlib.sha256()

    def __len__(self) -> int:
        return self.f.size

    def read(self, n: int = -1) -> bytes:
        left = self.f.size - self.pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        data = pread_exact(self.fd, self.f, n, self.pos)
        if self.pos == self._hashed:
            self._h.update(data)
            self._hashed += n
            if self.limiter:
                self.limiter.take(n)
        self.pos += n
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.f.size}[whence]
        self.pos = max(0, min(self.f.size, base + offset))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def sha256(self) -> str:
        while self._hashed < self.f.size:  # botocore stopped short: hash the rest from the file
            self.seek(self._hashed)
            self.read(HASH_CHUNK)
        return self._h.hexdigest()


class _Refused(TargetError):
    """The store refused the request for its credentials or permissions (403 and the like)."""


class _NotFound(Exception):
    pass


class _Abandoned(TargetError):
    """A part not sent because another part of the same file failed first."""
