"""The S3 connection: the one client (s3_light.py) built at the first request from the credential
sources as they are then, every call's refusal turned into a fresh look at the keys, and the
listing, manifest and delete requests."""

from __future__ import annotations

import threading
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

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
    NotFound,
    Refused,
    crc32_b64,
    etag_of,
    md5_b64,
)

if TYPE_CHECKING:
    from supervisor.store.credentials import KeysUnavailable
    from supervisor.store.s3_light import LightS3

log = get_logger("sync.s3")

LIST_WHOLE_AFTER = 4  # folders in one missing() above which the whole target is listed once


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
        self._client: LightS3 | None = None
        self.pool: ThreadPoolExecutor | None = None
        self._files: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._preparing = False
        self._static = True  # the client's keys are static ones (renew() reads them again)
        self._copies = True  # server-side copies of content the target holds; off once refused

    # --- plumbing -------------------------------------------------------------------------------
    def pools(self) -> None:
        with self._lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="s3-put")
                # large files: one thread each to create, hash and complete; parts go to pool
                self._files = ThreadPoolExecutor(min(4, self.cfg.concurrency), thread_name_prefix="s3-file")

    def client(self) -> LightS3:
        """The client, built at the first request after a (re)load from the credential sources as
        they are then: static keys read here, any other setup through botocore's chain (a
        profile, SSO, a role), whose keys are asked for at every request so they refresh."""
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> LightS3:
        from supervisor.store.credentials import KeysUnavailable, s3_keys
        from supervisor.store.s3_endpoint import region_of
        from supervisor.store.s3_light import LightS3

        env = self.creds.env()
        try:
            found = s3_keys(self.cfg.credentials_file, env, self.creds.overrides())
        except KeysUnavailable as e:
            raise self._no_keys(e) from None  # no client made: the next request looks again

        def keys() -> tuple[str, str, str]:
            try:
                return found.get()
            except KeysUnavailable as e:  # a role's refresh failed: look at the sources afresh
                self.reload_credentials(f"credentials: {e}")
                raise self._no_keys(e) from None

        region = region_of(self.cfg.region, env, found.config)
        self._static = found.source == "static"
        return LightS3(self.cfg.endpoint_url, self.bucket, region, keys, env, found.config)

    def _no_keys(self, e: KeysUnavailable) -> TargetError:
        if e.missing:
            return NoCredentials(f"no S3 credentials for {self.display}: {self.creds.looks().words('s3')}")
        return NoCredentials(f"no usable S3 credentials for {self.display} ({e}): {self.creds.looks().words('s3')}")

    def reload_credentials(self, why: str) -> None:
        """Build the client again at the next request, from the credential sources as they are
        then: after a refusal, when a source changed, or when the user asks for a sync, keys
        written down later must work without a daemon restart."""
        with self._lock:
            old, self._client = self._client, None
        if old is not None:
            old.close()
            log.info("s3_credentials_reread", why=why)

    def renew(self) -> None:
        """Static keys read afresh at the next request (a credentials file fixed meanwhile), for a
        restore's survey; the chain's keys refresh by themselves and keep their client."""
        with self._lock:
            old = self._client if self._static else None
            if old is not None:
                self._client = None
        if old is not None:
            old.close()

    def release(self) -> None:
        """This thread's connection to the next thread that needs one (LightS3.release)."""
        c = self._client
        if c is not None:
            c.release()

    def prepare(self) -> None:
        """Build the client on a thread of its own while the scan still runs: with keys from the
        chain, importing botocore and asking an instance's metadata service take their time; the
        first request then finds it ready."""
        with self._lock:
            if self._client is not None or self._preparing:
                return
            self._preparing = True
        threading.Thread(target=self._prepare, name="s3-prepare", daemon=True).start()

    def _prepare(self) -> None:
        try:
            self.client()
        except Exception as e:  # noqa: BLE001 - the first real request reports it
            log.debug("s3_prepare_failed", error=str(e))
        finally:
            self._preparing = False

    def full_key(self, k: str) -> str:
        return join_key(self.prefix, k)

    def call(self, op: str, *args: Any, **kw: Any) -> Any:
        """One operation of the client; a refusal has the keys read again at the next request
        (not a refused copy: a key that may not copy is refused that for good, s3.py)."""
        try:
            return getattr(self.client(), op)(*args, **kw)
        except Refused:
            if op != "copy_object":
                self.reload_credentials(f"{op} refused")
            raise

    # --- manifests, checks, deletes ------------------------------------------------------------
    def write_manifest(self, unit_key: str, data: bytes, kind: str = "dir") -> None:
        self.write_object(manifest_key(unit_key, kind), data)

    def write_object(self, rel: str, data: bytes) -> None:
        """A small object in one PUT the store checks by its checksum (a manifest, a heartbeat)."""
        key = self.full_key(rel)
        cs = {"x-amz-checksum-crc32": crc32_b64(data)} if self.crc else {"Content-MD5": md5_b64(data)}
        self.call("put_object", key, data, cs, "application/json")

    def delete_manifest(self, unit_key: str, kind: str = "dir") -> None:
        key = self.full_key(manifest_key(unit_key, kind))
        try:
            self.call("delete_object", key)
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
            try:
                resp = self.call("list_page", full, token)
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
            self.call("delete_object", self.full_key(key))
        except NotFound:
            pass

    def delete_prefix(self, unit_key: str) -> None:
        if not unit_key.strip("/"):
            raise TargetError("refusing to delete the whole target")
        self.delete_manifest(unit_key)
        keys = sorted(self.listing(unit_key.rstrip("/") + "/"))
        for i in range(0, len(keys), 1000):
            self.call("delete_objects", [self.full_key(k) for k in keys[i:i + 1000]])

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
