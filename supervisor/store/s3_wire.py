"""S3 on the wire: the checksums and ETags a store computes, part sizing, a file as a streamed
request body, and the errors the target tells apart. No client here: s3_light.py is the client, s3_client.py the connection."""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
import zlib

from supervisor.store.base import (
    AccessDenied,
    LocalFile,
    TargetError,
    TokenBucket,
    pread_exact,
)

MAX_PARTS = 10000
HASH_CHUNK = 8 << 20
BUFFER_MAX = 8 << 20  # a single PUT up to this is read into memory whole; above, streamed
COPY_MIN = 256 << 10  # below this a copy request saves too little over the PUT it replaces
MD5_HEX = re.compile(r"[0-9a-f]{32}")
AUTH_CODES = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
               "ExpiredToken", "AuthorizationHeaderMalformed"}
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}



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


def etag_of(v: str | None) -> str:
    return (v or "").strip('"')


class FileBody:
    """A file as a request body that the client reads as it sends: never more than one read in
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
        while self._hashed < self.f.size:  # the sender stopped short: hash the rest from the file
            self.seek(self._hashed)
            self.read(HASH_CHUNK)
        return self._h.hexdigest()


class Refused(AccessDenied):
    """The store refused the request for its credentials or permissions (403 and the like): no
    retry fixes that, so the engine alerts at once (sync/targethealth.py)."""


class NotFound(Exception):
    pass


class Abandoned(TargetError):
    """A part not sent because another part of the same file failed first."""
