"""The one S3 client in the setups beyond static keys on a plain endpoint, against the real SeaweedFS:
a multipart upload verified by the store's composite checksum, keys from a profile and from an
instance role (an IMDSv2 stand-in, through botocore's credential chain: botocore finds keys, it is
never an S3 client), an http proxy, a wrong-region redirect; and, pure, where requests go for each
endpoint setting (FIPS, dual-stack, AWS_ENDPOINT_URL*, NO_PROXY) and the settings it refuses by name."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from pathlib import Path

import pytest

from supervisor.config import from_dict
from supervisor.config.target import parse_target
from supervisor.store import make_target
from supervisor.store.base import LocalFile, NoCredentials, TargetError
from supervisor.store.credentials import CredentialWatch
from supervisor.store.s3_endpoint import aws_host, proxy_for, resolve
from supervisor.store.s3_wire import composite_crc32, crc32_b64
from tests.fixtures.metadata import FakeMetadata
from tests.fixtures.s3 import ACCESS_KEY, ROLE_KEY, ROLE_SECRET, SECRET_KEY
from tests.fixtures.s3_relay import Relay

MiB = 1 << 20


class Sink:
    def __init__(self) -> None:
        self.results: dict[str, object] = {}
        self.parts: dict[str, list[str]] = {}

    def begin(self, f, info): pass  # noqa: E704
    def part(self, f, n, etag, checksum, size): self.parts.setdefault(f.key, []).append(checksum)  # noqa: E704
    def done(self, f, res): self.results[f.key] = res  # noqa: E704
    def problem(self, f, err): raise AssertionError(err)  # noqa: E704
    def progress(self, f, n): pass  # noqa: E704
    def in_flight(self, key): return None  # noqa: E704
    def cancelled(self): return False  # noqa: E704


def _target(tmp_path: Path, s3, prefix: str, env: dict[str, str], **sync):
    cfg = from_dict({"state_dir": str(tmp_path / "state"),
                     "sync": {**s3.sync_config(prefix), "watch": [str(tmp_path / "out")], **sync}})
    creds = CredentialWatch(cfg.sync.credentials_file, kind="s3", base=lambda: env)
    return make_target(parse_target(cfg.sync.target), cfg.sync, tmp_path / "state", creds)


def _file(tmp_path: Path, name: str, data: bytes) -> LocalFile:
    p = tmp_path / "src" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    st = p.stat()
    return LocalFile(str(p), f"checkpoint-1/{name}", st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine with no keys anywhere (no ~/.aws, no AWS_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and "PROXY" not in k.upper()}
    env.update(HOME=str(tmp_path / "home"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none-credentials"),
               AWS_CONFIG_FILE=str(tmp_path / "none-config"), AWS_EC2_METADATA_DISABLED="true")
    return env


def _as_os_environ(monkeypatch, env: dict[str, str]) -> None:
    """botocore's session reads os.environ itself: the test's environment is the process's."""
    for k in list(os.environ):
        if k.startswith("AWS_") or "PROXY" in k.upper():
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("mode", ["when_supported", "when_required"])
def test_a_file_over_the_multipart_threshold_lands_verified_by_the_stores_own_checksum(
        s3_server, s3_prefix, tmp_path, mode):
    t = _target(tmp_path, s3_server, s3_prefix, dict(os.environ), multipart_threshold="5M", part_size="5M",
                request_checksum_calculation=mode)
    data = os.urandom(13 * MiB)
    f = _file(tmp_path, "model.safetensors", data)
    sink = Sink()
    t.put_files([f], sink)
    res = sink.results[f.key]
    assert res.sha256 == hashlib.sha256(data).hexdigest() and res.etag.endswith("-3") and res.sent == len(data)
    assert s3_server.get(f"{s3_prefix}/{f.key}") == data and s3_server.uploads(s3_prefix) == []
    if mode == "when_supported":  # the store's checksum of the whole is made of the parts' CRC32s
        parts = [crc32_b64(data[i:i + 5 * MiB]) for i in range(0, len(data), 5 * MiB)]
        assert sorted(sink.parts[f.key]) == sorted(parts)
        head = t.call("head_object", t.full_key(f.key), checksum=True)
        assert head["ContentLength"] == len(data)
        assert head.get("ChecksumCRC32", composite_crc32(parts)).split()[0] == composite_crc32(parts)
    t.close()


def test_a_checksum_the_store_echoes_wrong_fails_the_upload(s3_server, s3_prefix, tmp_path):
    """Verified means a checksum the store returned matched ours, never the size alone."""
    relay = Relay(s3_server.endpoint, tamper_crc=True)
    try:
        t = _target(tmp_path, s3_server, s3_prefix, dict(os.environ), endpoint_url=relay.url)
        f = _file(tmp_path, "config.json", b'{"a": 1}')
        with pytest.raises(TargetError, match="store reports checksum"):
            t.put_files([f], Sink())
        t.close()
    finally:
        relay.stop()


def test_keys_from_a_named_profile(s3_server, s3_prefix, tmp_path, monkeypatch):
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = nobody\naws_secret_access_key = wrong\n"
                     f"[tsup]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    env = {**_clean_env(tmp_path), "AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_PROFILE": "tsup"}
    _as_os_environ(monkeypatch, env)
    t = _target(tmp_path, s3_server, s3_prefix, env, credentials_file="")
    f = _file(tmp_path, "a.json", b"{}")
    sink = Sink()
    t.put_files([f], sink)
    assert f.key in sink.results and t.listing("")[f.key].size == 2
    assert t.client().keys()[0] == ACCESS_KEY
    t.close()
    monkeypatch.setenv("AWS_PROFILE", "nope")
    t = _target(tmp_path, s3_server, s3_prefix, {**env, "AWS_PROFILE": "nope"}, credentials_file="")
    with pytest.raises(NoCredentials, match="ProfileNotFound.*nope"):
        t.listing("")


def test_keys_from_an_instance_role_through_imdsv2(s3_server, s3_prefix, tmp_path, monkeypatch):
    imds = FakeMetadata("ec2")
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ")
    # SeaweedFS takes a session token for one of its own STS sessions only: the stand-in's role keys
    # are an identity of its config (ROLE_KEY) with an empty token; AWS's carry one, sent as given
    imds.role = ("tsup-role", {"AccessKeyId": ROLE_KEY, "SecretAccessKey": ROLE_SECRET, "Token": "",
                               "Expiration": later})
    try:
        env = {**_clean_env(tmp_path), "AWS_EC2_METADATA_DISABLED": "false",
               "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds.url + "/"}
        _as_os_environ(monkeypatch, env)
        t = _target(tmp_path, s3_server, s3_prefix, env, credentials_file="")
        f = _file(tmp_path, "a.json", b"{}")
        sink = Sink()
        t.put_files([f], sink)
        assert f.key in sink.results and t.reader.read_file(f.key) == b"{}"
        assert t.client().keys() == (ROLE_KEY, ROLE_SECRET, "")
        paths = [(m, p, tok) for m, p, tok in imds.requests]
        assert ("PUT", "/latest/api/token", True) in paths  # IMDSv2: a session token first...
        assert ("GET", "/latest/meta-data/iam/security-credentials/tsup-role", True) in paths  # ...carried
        t.close()
    finally:
        imds.stop()


def test_no_keys_anywhere_is_told_with_where_it_looked(s3_server, s3_prefix, tmp_path, monkeypatch):
    env = _clean_env(tmp_path)
    _as_os_environ(monkeypatch, env)
    t = _target(tmp_path, s3_server, s3_prefix, env, credentials_file="")
    with pytest.raises(NoCredentials, match="no S3 credentials .*AWS_ACCESS_KEY_ID"):
        t.listing("")


def test_every_request_goes_through_the_http_proxy_unless_no_proxy_names_the_host(s3_server, s3_prefix, tmp_path):
    proxy = Relay(s3_server.endpoint)
    try:
        env = {**_clean_env(tmp_path), "HTTP_PROXY": proxy.url}
        t = _target(tmp_path, s3_server, s3_prefix, env)
        f = _file(tmp_path, "a.json", b"{}")
        t.put_files([f], Sink())
        assert t.reader.read_file(f.key) == b"{}"
        t.delete_file(f.key)
        assert [m for m, _, _ in proxy.requests] == ["PUT", "GET", "DELETE"]
        assert all(target.startswith(s3_server.endpoint + "/") for _, target, _ in proxy.requests)
        t.close()
        t = _target(tmp_path, s3_server, s3_prefix, {**env, "NO_PROXY": "localhost,127.0.0.1"})
        assert t.listing("") == {} and len(proxy.requests) == 3
        t.close()
    finally:
        proxy.stop()


def test_a_wrong_region_is_asked_again_once_in_the_region_the_store_names(s3_server, s3_prefix, tmp_path):
    store = Relay(s3_server.endpoint, redirect_region="eu-west-1")
    try:
        t = _target(tmp_path, s3_server, s3_prefix, dict(os.environ), endpoint_url=store.url, region="us-east-1")
        f = _file(tmp_path, "a.json", b"{}")
        t.put_files([f], Sink())
        assert [r for _, _, r in store.requests] == ["us-east-1", "eu-west-1"]
        assert t.client().region == "eu-west-1" and t.listing("")[f.key].size == 2
        t.close()
    finally:
        store.stop()


def test_where_requests_go_for_each_endpoint_setting():
    assert aws_host("eu-west-1", False, False) == "s3.eu-west-1.amazonaws.com"
    assert aws_host("us-gov-west-1", True, False) == "s3-fips.us-gov-west-1.amazonaws.com"
    assert aws_host("us-east-1", False, True) == "s3.dualstack.us-east-1.amazonaws.com"
    assert aws_host("us-east-1", True, True) == "s3-fips.dualstack.us-east-1.amazonaws.com"
    assert aws_host("cn-north-1", False, False) == "s3.cn-north-1.amazonaws.com.cn"
    ep = resolve("", "ckpts", "eu-west-1", {}, {})
    assert (ep.scheme, ep.netloc, ep.base) == ("https", "ckpts.s3.eu-west-1.amazonaws.com", "")
    assert ep.in_region("ap-south-1").netloc == "ckpts.s3.ap-south-1.amazonaws.com"
    assert resolve("", "ckpts", "us-east-1", {"AWS_USE_FIPS_ENDPOINT": "true"}, {}).netloc == \
        "ckpts.s3-fips.us-east-1.amazonaws.com"
    assert resolve("", "ckpts", "us-east-1", {}, {"use_dualstack_endpoint": "true"}).netloc == \
        "ckpts.s3.dualstack.us-east-1.amazonaws.com"
    dotted = resolve("", "my.ckpts", "us-east-1", {}, {})  # not a host label: in the path
    assert (dotted.netloc, dotted.base) == ("s3.us-east-1.amazonaws.com", "/my.ckpts")
    env = {"AWS_ENDPOINT_URL": "http://general:9000", "AWS_ENDPOINT_URL_S3": "https://s3only:9000/base/"}
    assert (resolve("", "b", "r", env, {}).netloc, resolve("", "b", "r", env, {}).base) == ("s3only:9000", "/base/b")
    assert resolve("http://mine:1", "b", "r", env, {}).netloc == "mine:1"  # sync.endpoint_url wins
    assert resolve("", "b", "r", {**env, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}, {}).aws
    assert resolve("", "b", "r", {}, {"endpoint_url": "http://prof:2"}).netloc == "prof:2"
    assert resolve("", "b", "r", {"AWS_CA_BUNDLE": "/etc/ca.pem"}, {}).ca_bundle == "/etc/ca.pem"


def test_proxies_as_botocore_reads_them_and_what_is_refused_by_name():
    p = proxy_for("https", "b.s3.us-east-1.amazonaws.com", {"HTTPS_PROXY": "http://u:p%40ss@proxy:3128"})
    assert p is not None and (p.host, p.port) == ("proxy", 3128) and p.auth.startswith("Basic ")
    assert proxy_for("https", "x", {"HTTP_PROXY": "http://proxy:3128"}) is None  # http's proxy is http's
    assert proxy_for("http", "x", {"http_proxy": "proxy:8080"}).port == 8080  # type: ignore[union-attr]
    assert proxy_for("https", "b.s3.amazonaws.com", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": ".amazonaws.com"}) \
        is None
    assert proxy_for("https", "x", {"ALL_PROXY": "socks5://p:1"}) is None  # as botocore: not read
    with pytest.raises(TargetError, match="HTTPS_PROXY = https://p"):
        proxy_for("https", "x", {"HTTPS_PROXY": "https://p:443"})
    with pytest.raises(TargetError, match="services"):
        resolve("", "b", "r", {}, {"services": "mine"})
    with pytest.raises(TargetError, match="use_accelerate_endpoint"):
        resolve("", "b", "r", {}, {"s3": {"use_accelerate_endpoint": "true"}})
    with pytest.raises(TargetError, match="AWS_ENDPOINT_URL_S3"):
        resolve("", "b", "r", {"AWS_ENDPOINT_URL_S3": "ftp://x"}, {})
