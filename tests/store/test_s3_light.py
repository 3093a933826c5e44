"""The one S3 client (supervisor/store/s3_light.py): its signature against botocore's own signer,
its GETs and listings against the real SeaweedFS (which checks every signature), static keys found
without botocore, and a start-up that never imports it. Other setups: tests/store/test_s3_setups.py."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.store.base import TargetError
from supervisor.store.credentials import static_keys
from supervisor.store.s3_light import LightS3, parse_listing, sign
from supervisor.store.s3_wire import NotFound, Refused
from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY

KEYS = (ACCESS_KEY, SECRET_KEY, "")
REPO = Path(__file__).resolve().parents[2]


def run_without_boto3(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args` in a process of its own, which must succeed without importing botocore."""
    code = ("import sys, runpy; mod = sys.argv[1]; sys.argv = ['x', *sys.argv[2:]]\n"
            "try:\n    runpy.run_module(mod, run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "sys.stderr.write('BOTO=%s' % ('botocore' in sys.modules))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    r = subprocess.run([sys.executable, "-c", code, module, *args], capture_output=True, text=True, timeout=60,
                       env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "BOTO=False" in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("path,query,token", [
    ("/bucket/checkpoint-20/model.safetensors", {}, ""),
    ("/bucket/a b+c/ü é/x=y&z.bin", {}, "a-session-token/+="),
    ("/bucket", {"list-type": "2", "prefix": "run/a b+c/", "encoding-type": "url",
                 "continuation-token": "1/2+3=="}, ""),
])
def test_the_signature_is_the_one_botocore_computes(path, query, token):
    from urllib.parse import quote

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from supervisor.store.s3_light import EMPTY_SHA256

    keys = ("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    url = "http://127.0.0.1:8333" + quote(path) + ("?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())
                                                         if query else "")
    req = AWSRequest("GET", url, headers={"X-Amz-Content-SHA256": EMPTY_SHA256})
    S3SigV4Auth(Credentials(keys[0], keys[1], token or None), "s3", "eu-west-1").add_auth(req)
    # botocore reads its own clock: sign ours at the time it used
    when = dt.datetime.strptime(req.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC)
    ours = sign("GET", "127.0.0.1:8333", path, query, keys, "eu-west-1", when)
    assert ours["Authorization"] == req.headers["Authorization"]


def test_static_keys_are_found_the_way_botocore_finds_them(tmp_path):
    f = tmp_path / "creds"
    f.write_text("[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
    assert static_keys(str(f), {}) == ("AK", "SK", "")
    assert static_keys(str(f), {"AWS_ACCESS_KEY_ID": "EA", "AWS_SECRET_ACCESS_KEY": "ES",
                                "AWS_SESSION_TOKEN": "T"}) == ("EA", "ES", "T")  # the environment first
    assert static_keys("", {}) is None                          # ~/.aws, an instance role: the chain's
    assert static_keys(str(f), {"AWS_PROFILE": "other"}) is None  # the profile names the keys
    # where the requests go is no business of the keys' (s3_endpoint.py)
    assert static_keys(str(f), {"HTTPS_PROXY": "http://proxy:3128"}) == ("AK", "SK", "")
    assert static_keys(str(f), {"AWS_ENDPOINT_URL": "http://elsewhere"}) == ("AK", "SK", "")
    assert static_keys(str(f), {"AWS_ACCESS_KEY_ID": "only-half"}) is None
    f.write_text("[default]\naws_access_key_id = AK\naws_secret_access_key = SK\nrole_arn = arn:aws:iam::1:role/x\n")
    assert static_keys(str(f), {}) is None                      # an assumed role: the chain's
    f.write_text("[other]\naws_access_key_id = AK\n")
    assert static_keys(str(f), {}) is None
    assert static_keys(str(tmp_path / "missing"), {}) is None


def test_a_listing_page_with_url_encoded_keys():
    body = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            b"<EncodingType>url</EncodingType><IsTruncated>true</IsTruncated>"
            b"<Contents><Key>run/a%20b%2Bc/x</Key><Size>5</Size><ETag>&quot;abc&quot;</ETag></Contents>"
            b"<NextContinuationToken>tok</NextContinuationToken></ListBucketResult>")
    assert parse_listing(body) == ([("run/a b+c/x", 5, "abc")], "tok")
    with pytest.raises(TargetError, match="not XML"):
        parse_listing(b"<html>a proxy's login page")


def test_gets_ranges_and_listings_on_the_real_store(s3_server, s3_prefix):
    c = s3_server.client()
    data = os.urandom(300_000)
    names = ["x.bin", "a b+c/ü.bin", "deep/er/y.json"]
    for n in names:
        c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/{n}", Body=data)
    light = LightS3(s3_server.endpoint, s3_server.bucket, "us-east-1", KEYS)
    listed = light.list(f"{s3_prefix}/")
    assert sorted(k for k, _, _ in listed) == sorted(f"{s3_prefix}/{n}" for n in names)
    assert {size for _, size, _ in listed} == {len(data)}
    for n in names:
        assert light.read(f"{s3_prefix}/{n}", 1 << 20) == data
    r = light.get(f"{s3_prefix}/x.bin", 1000, 1999)
    assert r.status == 206 and r.read() == data[1000:2000]
    assert light.read(f"{s3_prefix}/x.bin", 10) == data[:10]  # a body left half read...
    assert light.read(f"{s3_prefix}/x.bin", 1 << 20) == data  # ...does not spoil the next answer
    with pytest.raises(NotFound):
        light.read(f"{s3_prefix}/absent", 10)
    wrong = LightS3(s3_server.endpoint, s3_server.bucket, "us-east-1", (ACCESS_KEY, "not-the-secret", ""))
    with pytest.raises(Refused, match="check the credentials"):
        wrong.read(f"{s3_prefix}/x.bin", 10)


def test_a_listing_of_more_than_one_page(s3_server, s3_prefix):
    c = s3_server.client()
    for i in range(1005):
        c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/f/{i:05d}", Body=b"x")
    light = LightS3(s3_server.endpoint, s3_server.bucket, "us-east-1", KEYS)
    assert [k for k, _, _ in light.list(f"{s3_prefix}/f/")] == [f"{s3_prefix}/f/{i:05d}" for i in range(1005)]


def test_a_released_connection_serves_the_next_pool_of_threads(s3_server, s3_prefix, monkeypatch):
    """Issue 41: a restore's survey and its download each run a pool of threads; the download's
    threads take the connections the survey's released (a new one costs a round trip, on https a
    handshake too). A connection whose body was left half read is never handed on."""
    import http.client
    import socket
    from concurrent.futures import ThreadPoolExecutor

    c = s3_server.client()
    data = os.urandom(100_000)
    keys = [f"{s3_prefix}/f{i}.bin" for i in range(8)]
    for k in keys:
        c.put_object(Bucket=s3_server.bucket, Key=k, Body=data)
    light = LightS3(s3_server.endpoint, s3_server.bucket, "us-east-1", KEYS)
    made: list[int] = []
    real = socket.create_connection

    def connect(*a, **kw):
        made.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(http.client.socket, "create_connection", connect)

    def read(key: str) -> bytes:
        try:
            return light.read(key, 1 << 20)
        finally:
            light.release()
    for _ in range(3):
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(read, keys)) == [data] * len(keys)
    assert 1 <= len(made) <= 4, f"{len(made)} connections for 3 pools of 4 threads"
    fresh, before = LightS3(s3_server.endpoint, s3_server.bucket, "us-east-1", KEYS), len(made)
    assert fresh.read(keys[0], 10) == data[:10]  # left half read: closed, not released
    fresh.release()
    assert fresh.read(keys[1], 1 << 20) == data and len(made) == before + 2


def test_a_restore_process_never_imports_boto3(s3_server, s3_prefix, tmp_path):
    """The point of the light client: the restore's start-up is Python's and ours, not boto3's."""
    from tests.fixtures.toml_writer import to_toml

    c = s3_server.client()
    files = {"adapter_model.safetensors": os.urandom(50_000), "trainer_state.json": b'{"global_step": 7}'}
    digest_files = []
    import hashlib
    for n, d in files.items():
        c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/checkpoint-7/{n}", Body=d)
        digest_files.append({"path": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()})
    from supervisor.sync.manifest import FORMAT
    c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/checkpoint-7/_MANIFEST.json",
                 Body=json.dumps({"format": FORMAT, "complete": True, "files": digest_files,
                                  "created_at": "2026-12-03T19:00:00Z", "host": "a"}).encode())
    out = tmp_path / "out"
    cfgf = tmp_path / "c.toml"
    cfgf.write_text(to_toml({"state_dir": str(tmp_path / "state"), "log_level": "warning",
                             "sync": {**s3_server.sync_config(s3_prefix), "watch": [str(out)]}}))
    r = run_without_boto3("supervisor.resume", "--config", str(cfgf))
    assert (out / "checkpoint-7" / "adapter_model.safetensors").read_bytes() == files["adapter_model.safetensors"]
    assert json.loads(r.stdout)["unit"] == "checkpoint-7"


def test_a_dead_endpoint_is_a_target_error_after_the_attempts():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    light = LightS3(f"http://127.0.0.1:{port}", "b", "us-east-1", KEYS)
    with pytest.raises(TargetError, match="ConnectionRefused"):
        light.read("k", 10)


@pytest.fixture
def odd_store():
    """A loopback store whose 200 answers are what the test sets: a proxy's page, a broken store."""
    import http.server
    import threading

    answer = {"body": b""}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer["body"])))
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield answer, LightS3(f"http://127.0.0.1:{srv.server_address[1]}", "b", "us-east-1", KEYS)
    srv.shutdown()
    srv.server_close()


def test_a_store_answer_that_is_no_s3_answer_is_a_target_error_never_a_crash_or_a_heap(odd_store):
    # a ValueError would end the pass as an internal error, retried every second with no backoff
    answer, light = odd_store
    listing = b"<ListBucketResult><Contents><Key>k</Key><Size>%s</Size></Contents></ListBucketResult>"
    answer["body"] = listing % b"5"
    assert light.list("p") == [("k", 5, "")]
    answer["body"] = listing % b"five"
    with pytest.raises(TargetError, match="Size 'five' is not a number"):
        light.list("p")
    answer["body"] = b"<ListPartsResult><Part><PartNumber>1e999</PartNumber></Part></ListPartsResult>"
    with pytest.raises(TargetError, match="PartNumber '1e999' is not a number"):
        light.list_parts("k", "u", 0)
    answer["body"] = b"<ListBucketResult>" + b" " * (16 << 20) + b"</ListBucketResult>"
    with pytest.raises(TargetError, match="an answer over 16 MiB"):
        light.list("p")
    answer["body"] = listing % b"7"
    assert light.list("p") == [("k", 7, "")]  # the connection the big answer left is not reused


def test_an_upload_pass_of_small_files_never_imports_boto3(s3_server, s3_prefix, tmp_path):
    """A LoRA run's files are all below the multipart threshold: PUTs, the tokenizer's server-side
    copies, the manifests and the verifying listing all go without boto3, and land verified."""
    from tests.fixtures.hf_writer import HFWriter
    from tests.fixtures.toml_writer import to_toml

    out = tmp_path / "out"
    w = HFWriter(out)
    for step in (10, 20):
        w.checkpoint(step)
    cfgf = tmp_path / "c.toml"
    cfgf.write_text(to_toml({"state_dir": str(tmp_path / "state"), "log_level": "warning",
                             "sync": {**s3_server.sync_config(s3_prefix), "watch": [str(out)], "quiet_period": "0"}}))
    run_without_boto3("supervisor.sync", "--config", str(cfgf), "--once")
    objs = s3_server.objects(s3_prefix)
    for step in (10, 20):
        here = {p.relative_to(out).as_posix(): p.read_bytes() for p in (out / f"checkpoint-{step}").rglob("*")
                if p.is_file()}
        for rel, data in here.items():
            assert objs[rel]["size"] == len(data)
            assert s3_server.get(f"{s3_prefix}/{rel}") == data
        assert f"checkpoint-{step}/_MANIFEST.json" in objs
