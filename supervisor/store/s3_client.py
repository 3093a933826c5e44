"""The S3 connection: the boto3 client built once (on a thread of its own while the scan runs),
every call's errors turned into the target's, and the listing, manifest and delete requests. The
plain requests of a pass (PUT, server-side copy, list) go through s3_light.py instead when the
setup allows it, so a pass of small files never imports boto3."""

from __future__ import annotations

import os
import threading
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from supervisor.config import SyncConfig
from supervisor.config.target import TargetURL
from supervisor.store._log import get_logger
from supervisor.store.base import (
    NoCredentials,
    RemoteObject,
    TargetError,
    TokenBucket,
    join_key,
)
from supervisor.store.credentials import CredentialWatch
from supervisor.store.keys import manifest_key
from supervisor.store.s3_wire import (
    AUTH_CODES,
    LOOPBACK,
    NotFound,
    Refused,
    crc32_b64,
    etag_of,
    md5_b64,
    no_expect_for_small_bodies,
)

if TYPE_CHECKING:
    from supervisor.store.s3_light import LightS3

log = get_logger("sync.s3")

LIST_WHOLE_AFTER = 4  # folders in one missing() above which the whole target is listed once
LIGHT_OPS = frozenset({"put_object", "copy_object", "list_objects_v2", "delete_object"})


class S3Connection:
    """The bucket and prefix, the client and its pools; the upload paths build on it (s3.py)."""

    def __init__(self, url: TargetURL, cfg: SyncConfig, creds: CredentialWatch | None = None):
        # where the keys come from; the engine asks it what changed and calls reload_credentials
        self.creds = creds or CredentialWatch(cfg.credentials_file, kind="s3")
        self.bucket = url.bucket
        self.prefix = url.prefix
        self.cfg = cfg
        self.display = url.display()
        self.crc = cfg.request_checksum_calculation == "when_supported"
        self.single_put_max = cfg.multipart_threshold
        self.limiter = TokenBucket(cfg.bandwidth_limit) if cfg.bandwidth_limit else None
        self._client: Any = None
        self.pool: ThreadPoolExecutor | None = None
        self._files: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._prep_lock = threading.Lock()
        self._preparing = False
        self._copies = True  # server-side copies of content the target holds; off once refused

    # --- plumbing -------------------------------------------------------------------------------
    _light_client: LightS3 | bool | None = None  # None: not decided yet; False: boto3 for good

    def _light(self) -> LightS3 | None:
        """The boto3-less client when this setup allows it (s3_light.py says when)."""
        if self._light_client is None:
            # imported here: a pass with nothing to send needs no client of either kind
            from supervisor.store.s3_light import LightS3

            self._light_client = LightS3.for_target(self.cfg.endpoint_url, self.bucket, self.cfg.region,
                                                    self.cfg.credentials_file, self.creds.env()) or False
        return self._light_client or None

    def _not_light(self, why: Exception) -> None:
        if self._light_client:
            log.info("s3_with_boto3", why=str(why))
        self._light_client = False

    def pools(self) -> None:
        with self._lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="s3-put")
                # large files: one thread each to create, hash and complete; parts go to pool
                self._files = ThreadPoolExecutor(min(4, self.cfg.concurrency), thread_name_prefix="s3-file")

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            client = self._client
        self.pools()
        return client

    def reload_credentials(self, why: str) -> None:
        """Build both clients again at the next request, from the credential sources as they are
        then (boto3 reads its chain once, when the client is made): after a refusal, when a
        source changed, or when the user asks for a sync, keys written down later must work
        without a daemon restart."""
        reread = self._light_client is not None
        self._light_client = None  # the light client's keys too, at its next request
        with self._lock:
            if self._client is not None:
                self._client = None
                reread = True
        if reread:
            log.info("s3_credentials_reread", why=why)

    def prepare(self) -> None:
        """Build the client on a thread of its own (importing boto3 takes a CPU-tenth of a
        second) while the scan still runs; the first request then finds it ready."""
        # not self._lock: client() holds it while the client is built, and the scan calling
        # this for every unit must not wait for that
        if self._light():
            return  # the requests a pass makes go without boto3; it is built only if one needs it
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
        over = self.creds.overrides()  # the environment file's word wins over the inherited one
        for var, name in (("AWS_SHARED_CREDENTIALS_FILE", "credentials_file"), ("AWS_CONFIG_FILE", "config_file"),
                          ("AWS_PROFILE", "profile")):
            if over.get(var):
                bs.set_config_variable(name, os.path.expanduser(over[var]))
        if self.cfg.credentials_file:
            bs.set_config_variable("credentials_file", self.cfg.credentials_file)
        if over.get("AWS_ACCESS_KEY_ID") and over.get("AWS_SECRET_ACCESS_KEY"):
            bs.set_credentials(over["AWS_ACCESS_KEY_ID"], over["AWS_SECRET_ACCESS_KEY"],
                               over.get("AWS_SESSION_TOKEN") or over.get("AWS_SECURITY_TOKEN") or None)
        region = over.get("AWS_REGION") or over.get("AWS_DEFAULT_REGION")
        if region and not self.cfg.region:
            bs.set_config_variable("region", region)
        # Timestamps stay the strings the store sent (as the AWS CLI does for its own listings):
        # botocore parses each LastModified with dateutil, 45 us an object, most of a listing's
        # cost, and no decision here reads them.
        bs.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
        session = boto3.Session(botocore_session=bs)
        s3cfg: dict[str, Any] = {}
        ep = self.cfg.endpoint_url
        if ep:
            s3cfg["addressing_style"] = "path"
            host = urlparse(ep).hostname or ""
            if host in LOOPBACK:
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
        client.meta.events.register("before-sign.s3.PutObject", no_expect_for_small_bodies)
        client.meta.events.register("before-sign.s3.UploadPart", no_expect_for_small_bodies)
        return client

    def full_key(self, k: str) -> str:
        return join_key(self.prefix, k)

    def call(self, op: str, **kw: Any) -> Any:
        light = self._light() if op in LIGHT_OPS else None
        if light:
            from supervisor.store.s3_light import Unsupported

            try:
                return self._light_call(light, op, kw)
            except Unsupported as e:
                self._not_light(e)
            except Refused:
                if op != "copy_object":
                    self.reload_credentials(f"{op} refused")
                raise
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        try:
            return getattr(self.client(), op)(**kw)
        except ClientError as e:
            err = e.response.get("Error", {})
            code = err.get("Code", "?")
            if code in ("NoSuchUpload", "NoSuchKey", "404", "NotFound"):
                raise NotFound(code) from None
            msg = err.get("Message", "") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
            if code in AUTH_CODES:
                if op != "copy_object":  # a key that may not copy is refused that for good (s3.py)
                    self.reload_credentials(f"{op} refused: {code}")
                raise Refused(f"S3 {op} {kw.get('Key', '')}: {code}: {msg} (check the credentials and the "
                               "bucket's permissions)".strip()) from None
            raise TargetError(f"S3 {op} {kw.get('Key', '')}: {code}: {msg}".strip()) from None
        except (NoCredentialsError, PartialCredentialsError) as e:
            self.reload_credentials(f"{op}: {e}")
            raise NoCredentials(f"no S3 credentials for {self.display} ({e}): "
                                f"{self.creds.looks().words('s3')}") from None
        except BotoCoreError as e:
            raise TargetError(f"S3 {op}: {e}") from None

    def _light_call(self, light: LightS3, op: str, kw: dict[str, Any]) -> Any:
        """The operation through the light client, answered in boto3's shape."""
        if op == "put_object":
            cs = {"x-amz-checksum-crc32": kw["ChecksumCRC32"]} if "ChecksumCRC32" in kw else {}
            if "ContentMD5" in kw:
                cs["Content-MD5"] = kw["ContentMD5"]
            return light.put_object(kw["Key"], kw["Body"], cs, kw.get("ContentType", ""))
        if op == "copy_object":
            src = kw["CopySource"]
            if src["Bucket"] != self.bucket:
                from supervisor.store.s3_light import Unsupported

                raise Unsupported("a copy from another bucket")
            return light.copy_object(kw["Key"], src["Key"], self.bucket, kw.get("ChecksumAlgorithm") == "CRC32")
        if op == "delete_object":
            return light.delete_object(kw["Key"])
        return light.list_page(kw["Prefix"], kw.get("ContinuationToken"))

    # --- manifests, checks, deletes ------------------------------------------------------------
    def write_manifest(self, unit_key: str, data: bytes, kind: str = "dir") -> None:
        self.write_object(manifest_key(unit_key, kind), data)

    def write_object(self, rel: str, data: bytes) -> None:
        """A small object in one PUT the store checks by its checksum (a manifest, a heartbeat)."""
        key = self.full_key(rel)
        extra = {"ChecksumCRC32": crc32_b64(data)} if self.crc else {"ContentMD5": md5_b64(data)}
        self.call("put_object", Bucket=self.bucket, Key=key, Body=data, ContentType="application/json", **extra)

    def delete_manifest(self, unit_key: str, kind: str = "dir") -> None:
        key = self.full_key(manifest_key(unit_key, kind))
        try:
            self.call("delete_object", Bucket=self.bucket, Key=key)
        except NotFound:
            pass

    def listing(self, prefix: str) -> dict[str, RemoteObject]:
        """Every object under prefix (relative keys; "" for the whole target)."""
        full = self.full_key(prefix)
        if not prefix and full:
            full += "/"  # the target's own folder, not every key that starts with its name
        out: dict[str, RemoteObject] = {}
        token = None
        base = (self.prefix.strip("/") + "/") if self.prefix.strip("/") else ""
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                kw["ContinuationToken"] = token
            try:
                resp = self.call("list_objects_v2", **kw)
            except NotFound as e:
                raise TargetError(f"S3 list {full}: {e}") from None
            for o in resp.get("Contents") or []:
                k = o["Key"]
                rel = k[len(base):] if base and k.startswith(base) else k
                out[rel] = RemoteObject(int(o.get("Size", -1)), etag_of(o.get("ETag")))
            if not resp.get("IsTruncated"):
                return out
            token = resp.get("NextContinuationToken")

    def missing(self, expected: dict[str, tuple[int, str]], deep: Collection[str] | None = None) -> list[str]:
        """By the listing: size and the store's own checksum (the ETag it computed, or the
        composite checksum's ETag) against the one it returned at upload. That is the check by
        content S3 offers without reading every object back, for `deep` keys and others alike."""
        groups: dict[str, list[str]] = {}
        for k in expected:
            top = k.split("/", 1)[0]
            groups.setdefault(top + "/" if "/" in k else k, []).append(k)
        if len(groups) > LIST_WHOLE_AFTER:
            # a list request per folder costs a round trip each; past a few folders one listing
            # of the whole target (1,000 keys a page) is fewer requests
            groups = {"": list(expected)}
        out = []
        for prefix, keys in groups.items():
            have = self.listing(prefix)
            for k in keys:
                size, etag = expected[k]
                o = have.get(k)
                if o is None or (size >= 0 and o.size != size) or (etag and o.etag and o.etag != etag):
                    out.append(k)
        return out

    def delete_file(self, key: str) -> None:
        """One object (a single-file unit the trainer deleted, sync.follow_deletions)."""
        try:
            self.call("delete_object", Bucket=self.bucket, Key=self.full_key(key))
        except NotFound:
            pass

    def delete_prefix(self, unit_key: str) -> None:
        if not unit_key.strip("/"):
            raise TargetError("refusing to delete the whole target")
        self.delete_manifest(unit_key)
        keys = sorted(self.listing(unit_key.rstrip("/") + "/"))
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self.full_key(k)} for k in keys[i:i + 1000]]
            self.call("delete_objects", Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def close(self) -> None:
        with self._lock:
            for pool in (self.pool, self._files):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
            self.pool = self._files = None
            if self._client is not None:
                try:
                    self._client.close()  # its keep-alive connections
                except Exception:  # noqa: BLE001 - closing must not raise
                    pass
                self._client = None
