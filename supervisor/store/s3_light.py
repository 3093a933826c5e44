"""S3 without boto3: SigV4-signed requests over http.client for the plain operations, GET and list
(the restore) and PUT, server-side copy and list (an upload pass of files below the multipart
threshold; multipart and the rest stay boto3's).

Why: importing boto3 and building its client costs a quarter second of CPU, and each request
through botocore another 1-3 ms (its event hooks, models and parsers): 3x `s5cmd cp` for a 50 MiB
LoRA restore, and a third of our CPU for a LoRA run's upload. Integrity does not rest on this
client: a PUT carries the checksum (CRC32 or Content-MD5) that the store verifies before accepting
it and echoes back for the caller to compare, and a restore checks every byte against the
manifest's sha256. It only has to be fast and to step aside when the setup is not one it knows.

It is used only when the setup is plain: static keys from the environment or from
`sync.credentials_file`, no profile, proxy or endpoint from the environment (AWS_CA_BUNDLE is
honoured). Any other setup, and any answer it does not expect (a redirect to another region, a
malformed listing), raises `Unsupported` and the caller uses boto3 for the rest of the run.
"""

from __future__ import annotations

import configparser
import datetime as dt
import hashlib
import hmac
import http.client
import os
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from typing import Any

from supervisor.store._log import get_logger
from supervisor.store.base import TargetError
from supervisor.store.s3_wire import AUTH_CODES, NotFound, Refused

log = get_logger("sync.s3")

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED = "UNSIGNED-PAYLOAD"
SEND_CHUNK = 1 << 20
NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
UNRESERVED = "-_.~"
ATTEMPTS = 3
CONNECT_TIMEOUT = 10   # as the boto3 client's (s3_client.py)
READ_TIMEOUT = 120
IDLE_KEPT = 16         # connections released for another thread's next request (release())
# The environment settings boto3 honours that this client does not: with any of them set, boto3 it is.
NOT_HANDLED_ENV = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HTTPS_PROXY",
                   "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "AWS_USE_FIPS_ENDPOINT",
                   "AWS_USE_DUALSTACK_ENDPOINT")


class Unsupported(Exception):
    """This setup or answer is for boto3: the caller switches to it."""


def static_keys(credentials_file: str, env: dict[str, str] | None = None) -> tuple[str, str, str] | None:
    """(access key, secret, session token) when they are static and found the way botocore finds
    them (the environment first, then the configured file's [default]); None otherwise."""
    env = os.environ if env is None else env
    if any(env.get(k) for k in NOT_HANDLED_ENV):
        return None
    ak, sk = env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", "")
    if ak and sk:
        return ak, sk, env.get("AWS_SESSION_TOKEN", "") or env.get("AWS_SECURITY_TOKEN", "")
    if ak or sk or not credentials_file:
        return None
    cp = configparser.RawConfigParser()
    try:
        with open(credentials_file, encoding="utf-8") as fh:
            cp.read_file(fh)
        sec = cp["default"]
    except (OSError, configparser.Error, KeyError, UnicodeDecodeError):
        return None  # boto3 says what is wrong with it, in its words
    ak, sk = sec.get("aws_access_key_id", "").strip(), sec.get("aws_secret_access_key", "").strip()
    if not ak or not sk or set(sec) - {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}:
        return None
    return ak, sk, sec.get("aws_session_token", "").strip()


def quote(s: str, safe: str = "/") -> str:
    return urllib.parse.quote(s, safe=UNRESERVED + safe)


def signing_key(secret: str, date: str, region: str) -> bytes:
    k = hmac.new(f"AWS4{secret}".encode(), date.encode(), hashlib.sha256).digest()
    for part in (region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    return k


def sign(method: str, host: str, path: str, query: dict[str, str], keys: tuple[str, str, str], region: str,
         when: dt.datetime, extra: dict[str, str] | None = None, payload: str = EMPTY_SHA256) -> dict[str, str]:
    """The headers of a SigV4-signed request (AWS's "Signature Version 4" for S3): `extra` headers
    are sent and signed (every x-amz-* one must be); `payload` is the body's sha256 or
    UNSIGNED-PAYLOAD (the body is covered by the checksum header the store verifies)."""
    amz = when.strftime("%Y%m%dT%H%M%SZ")
    date = amz[:8]
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz}
    if keys[2]:
        headers["x-amz-security-token"] = keys[2]
    for k, v in (extra or {}).items():
        headers[k.lower()] = v
    names = sorted(headers)
    canonical = "\n".join([
        method, quote(path), "&".join(f"{quote(k, '')}={quote(v, '')}" for k, v in sorted(query.items())),
        "".join(f"{n}:{headers[n].strip()}\n" for n in names), ";".join(names), payload])
    scope = f"{date}/{region}/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{amz}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    sig = hmac.new(signing_key(keys[1], date, region), to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={keys[0]}/{scope}, SignedHeaders={';'.join(names)}, "
                                f"Signature={sig}")
    return headers


def parse_listing(body: bytes) -> tuple[list[tuple[str, int, str]], str | None]:
    """(key, size, etag) of a ListObjectsV2 page (keys url-encoded, as asked) and the next token."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as e:
        raise Unsupported(f"listing not XML: {e}") from None
    url = (root.findtext(f"{NS}EncodingType") or "") == "url"
    out = []
    for c in root.iter(f"{NS}Contents"):
        k = c.findtext(f"{NS}Key") or ""
        out.append((urllib.parse.unquote(k) if url else k, int(c.findtext(f"{NS}Size") or -1),
                    (c.findtext(f"{NS}ETag") or "").strip('"')))
    more = (root.findtext(f"{NS}IsTruncated") or "").lower() == "true"
    return out, (root.findtext(f"{NS}NextContinuationToken") if more else None)


class LightS3:
    """One bucket: GET (whole or a range) and list, a keep-alive connection per thread; a thread
    done with its connection may release() it to the next thread that needs one."""

    def __init__(self, endpoint_url: str, bucket: str, region: str, keys: tuple[str, str, str]):
        if endpoint_url:
            u = urllib.parse.urlsplit(endpoint_url)
            if u.scheme not in ("http", "https") or not u.hostname or u.path.strip("/"):
                raise Unsupported(f"endpoint {endpoint_url}")
            self.scheme, self.netloc, self.base = u.scheme, u.netloc, f"/{bucket}"
        else:
            if "." in bucket or bucket.lower() != bucket:
                raise Unsupported("bucket name not usable as a host name")
            self.scheme, self.netloc, self.base = "https", f"{bucket}.s3.{region}.amazonaws.com", ""
        self.region, self.keys = region, keys
        self._local = threading.local()
        self._idle: list[http.client.HTTPConnection] = []
        self._idle_lock = threading.Lock()

    @classmethod
    def for_target(cls, endpoint_url: str, bucket: str, region: str, credentials_file: str,
                   env: dict[str, str] | None = None) -> LightS3 | None:
        env = dict(os.environ) if env is None else env
        keys = static_keys(credentials_file, env)
        if keys is None:
            return None
        region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        try:
            return cls(endpoint_url, bucket, region, keys)
        except Unsupported:
            return None

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None and self._idle:
            with self._idle_lock:
                c = self._idle.pop() if self._idle else None
            self._local.conn = c
        if c is None:
            if self.scheme == "https":
                import ssl

                ctx = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
                c = http.client.HTTPSConnection(self.netloc, timeout=CONNECT_TIMEOUT, context=ctx)
            else:
                c = http.client.HTTPConnection(self.netloc, timeout=CONNECT_TIMEOUT)
            self._local.conn = c
        if c.sock is None:  # new, or closed by an answer that said so: connect with the short timeout
            c.connect()
            c.sock.settimeout(READ_TIMEOUT)
        return c

    def release(self) -> None:
        """This thread's connection, its last answer read to the end, to the next thread that has
        none: a restore's survey, then its download, each run a pool of threads, and a thread that
        connects anew pays a round trip (and on https a handshake) before its first byte."""
        c = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is None or c.sock is None:
            return
        with self._idle_lock:
            if len(self._idle) < IDLE_KEPT:
                self._idle.append(c)
                return
        c.close()

    def drop(self) -> None:
        c = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is not None:
            c.close()

    def request(self, key: str | None, query: dict[str, str] | None = None,
                headers: dict[str, str] | None = None, method: str = "GET", body: Any = None,
                signed: dict[str, str] | None = None, what: str = "get") -> http.client.HTTPResponse:
        """A request for `key` (None: the bucket) whose answer is 2xx; the caller reads the body.
        `signed`: headers sent and signed; `body`: bytes, or a file-like with len(), seek and read
        (sent again from its start on a retry). NotFound for 404, Refused for the credentials'
        refusals, TargetError once the attempts are spent, Unsupported for anything else."""
        path = self.base + ("/" + key if key is not None else ("" if self.base else "/"))
        query = query or {}
        target = quote(path) + ("?" + "&".join(f"{quote(k, '')}={quote(v, '')}" for k, v in sorted(query.items()))
                                if query else "")
        name = f"S3 {what} {key or 'listing'}"
        last = ""
        for attempt in range(ATTEMPTS):
            h = sign(method, self.netloc, path, query, self.keys, self.region, dt.datetime.now(dt.UTC), signed,
                     UNSIGNED if body is not None else EMPTY_SHA256)
            if headers:
                h.update(headers)
            try:
                c = self._conn()
                if body is None:
                    c.request(method, target, headers=h)
                else:
                    _send(c, method, target, h, body)
                r = c.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self.drop()  # a kept-alive connection the server closed meanwhile: again at once
                last = f"{type(e).__name__}: {e}"
                log.info("s3_light_retry", request=name, attempt=attempt + 1, error=last)
                time.sleep(0.1 * (2 ** attempt - 1))
                continue
            if 200 <= r.status < 300:
                return r
            try:
                err = r.read(64 << 10)
            except (OSError, http.client.HTTPException):
                err = b""
            if not r.isclosed():
                self.drop()  # an error body longer than read: the connection is not reusable
            code, msg = _error_code(err)
            if r.status == 404:
                raise NotFound(code or "404")
            if r.status == 403 and code in AUTH_CODES | {""}:
                raise Refused(f"{name}: {code or 403}: {msg} (check the credentials and the bucket's "
                              "permissions)")
            if r.status in (500, 502, 503, 504) or code in ("SlowDown", "RequestTimeout", "InternalError"):
                last = f"{r.status} {code}"
                log.info("s3_light_retry", request=name, attempt=attempt + 1, error=last)
                time.sleep(0.1 * 2 ** attempt)
                continue
            if r.status == 400 and code in ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch",
                                            "XAmzContentSHA256Mismatch"):
                raise TargetError(f"{name}: {code}: {msg} (the bytes changed on the way)")
            raise Unsupported(f"{r.status} {code}")
        raise TargetError(f"{name}: {last}")

    # --- the operations the upload path uses, answered as boto3 answers them -------------------
    def put_object(self, key: str, body: Any, checksum: dict[str, str], content_type: str = "") -> dict:
        signed = dict(checksum)
        if content_type:
            signed["Content-Type"] = content_type
        r = self.request(key, method="PUT", body=body, signed=signed, what="put")
        r.read()
        out = {"ETag": r.getheader("ETag") or ""}
        crc = r.getheader("x-amz-checksum-crc32")
        if crc is not None:
            out["ChecksumCRC32"] = crc
        return out

    def copy_object(self, key: str, source_key: str, bucket: str, crc: bool) -> dict:
        signed = {"x-amz-copy-source": quote(f"{bucket}/{source_key}")}
        if crc:
            signed["x-amz-checksum-algorithm"] = "CRC32"
        r = self.request(key, method="PUT", body=b"", signed=signed, what="copy")
        body = r.read()
        try:
            root = ET.fromstring(body)
        except ET.ParseError as e:
            raise Unsupported(f"copy answer not XML: {e}") from None
        if root.tag.endswith("Error"):  # S3 may fail a copy after its 200 is sent
            raise TargetError(f"S3 copy {key}: {root.findtext('Code')}: {root.findtext('Message')}")
        res = {"ETag": root.findtext(f"{NS}ETag") or root.findtext("ETag") or ""}
        crc_v = root.findtext(f"{NS}ChecksumCRC32") or root.findtext("ChecksumCRC32")
        if crc_v:
            res["ChecksumCRC32"] = crc_v
        return {"CopyObjectResult": res}

    def delete_object(self, key: str) -> dict:
        self.request(key, method="DELETE", what="delete").read()
        return {}

    def list_page(self, prefix: str, token: str | None) -> dict:
        q = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
        if token:
            q["continuation-token"] = token
        r = self.request(None, q, what="list")
        try:
            page, nxt = parse_listing(r.read())
        except (OSError, http.client.HTTPException) as e:
            self.drop()
            raise TargetError(f"S3 list {prefix}: {type(e).__name__}: {e}") from None
        out: dict[str, Any] = {"Contents": [{"Key": k, "Size": size, "ETag": etag} for k, size, etag in page],
                               "IsTruncated": nxt is not None}
        if nxt:
            out["NextContinuationToken"] = nxt
        return out

    def get(self, key: str, start: int = 0, end: int = -1) -> http.client.HTTPResponse:
        return self.request(key, headers={"Range": f"bytes={start}-{end}"} if end >= 0 else None)

    def read(self, key: str, limit: int) -> bytes:
        r = self.get(key)
        try:
            data = r.read(limit)
        except (OSError, http.client.HTTPException) as e:
            self.drop()
            raise TargetError(f"S3 get {key}: {type(e).__name__}: {e}") from None
        if not r.isclosed():
            self.drop()  # more than limit: what is left of the body must not meet the next request
        return data

    def list(self, prefix: str) -> list[tuple[str, int, str]]:
        out: list[tuple[str, int, str]] = []
        token: str | None = None
        while True:
            page = self.list_page(prefix, token)
            out += [(o["Key"], o["Size"], o["ETag"]) for o in page["Contents"]]
            token = page.get("NextContinuationToken")
            if not token:
                return out


def _send(c: http.client.HTTPConnection, method: str, target: str, headers: dict[str, str], body: Any) -> None:
    """A request with a body: bytes at once, a file-like in SEND_CHUNK reads (from its start)."""
    n = len(body)
    c.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
    for k, v in headers.items():
        c.putheader(k, v)
    c.putheader("Content-Length", str(n))
    if isinstance(body, bytes | bytearray | memoryview):
        c.endheaders(body if n else None)
        return
    c.endheaders()
    body.seek(0)
    left = n
    while left > 0:
        chunk = body.read(min(SEND_CHUNK, left))
        if not chunk:
            raise OSError("the body ended short")
        c.send(chunk)
        left -= len(chunk)


def _error_code(body: bytes) -> tuple[str, str]:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return "", ""
    return root.findtext("Code") or "", root.findtext("Message") or ""


__all__ = ["LightS3", "Unsupported", "parse_listing", "sign", "static_keys"]
