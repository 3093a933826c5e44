"""Benchmark: the S3 transfer engines that exist, on the same local SeaweedFS and the same data, in one
run (issue 41: measure them rather than tune ours by hand).

- `light`: our SigV4 client over http.client (supervisor/store/s3_light.py, the product's one S3
  client), threads for parallelism, hashing each GET's bytes as they stream (as the restore does);
- `boto3`: a peer measured here, with the same threads (the product no longer uses it for S3: this
  bench chose s3_light, issue 54; each engine runs in its own process, so the peer stays measurable);
- `obstore`: Rust object_store bindings (its own async runtime; one call per object here);
- `awscrt`: the AWS CRT S3 client (native parallel ranged GETs and multipart PUTs).

Each engine runs as a fresh process (`start` = interpreter + import + client + one listing: what a
one-shot command pays), then, in that process: `put` every file of the tree, `list` the prefix (the
no-change pass's round trip), `get` every object into a fresh folder with sha256 of its bytes. Trees:
`big` (4 files, 1 GiB; --quick 4 x 64 MiB) and `small` (400 files of 128 KiB, a LoRA run's many small
files). Rounds rotate the engine order; the medians and each engine's ratio to ours are printed, with
the CPU seconds each used (the box has two cores, and the store runs on them too).

    python tests/bench/bench_engines.py [--quick] [--rounds 3] [--engines light,boto3,obstore,awscrt]
                                        [--python PATH]

An engine whose package is missing is reported and skipped (pip install obstore awscrt); --python
runs the engines with another interpreter (a venv that has them, the test venv left as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY, SeaweedS3  # noqa: E402

MiB = 1 << 20

WORKER = r'''
import hashlib, json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
t0 = time.perf_counter()
engine, endpoint, bucket, prefix, src, dest = sys.argv[1:7]
AK, SK = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
host = endpoint.split("://", 1)[1]
THREADS = 8
files = sorted(p for p in os.listdir(src))

if engine == "light":
    sys.path.insert(0, os.environ["REPO"])
    from supervisor.store.s3_light import LightS3
    c = LightS3(endpoint, bucket, "us-east-1", (AK, SK, ""))
    local = __import__("threading").local()
    def cl():
        if not hasattr(local, "c"):
            local.c = LightS3(endpoint, bucket, "us-east-1", (AK, SK, ""))
        return local.c
    def listing(): return {k: s for k, s, _ in c.list(prefix + "/")}
    def put(name):
        with open(os.path.join(src, name), "rb") as f:
            cl().put_object(f"{prefix}/{name}", f.read(), {})
    def get(name):
        r = cl().get(f"{prefix}/{name}")
        h = hashlib.sha256()
        with open(os.path.join(dest, name), "wb") as out:
            while b := r.read(1 << 20):
                h.update(b); out.write(b)
        return h.hexdigest()
elif engine == "boto3":
    import boto3, botocore.config
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=AK,
                     aws_secret_access_key=SK, config=botocore.config.Config(max_pool_connections=THREADS))
    def listing():
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out
    def put(name):
        with open(os.path.join(src, name), "rb") as f:
            c.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=f.read())
    def get(name):
        body = c.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"]
        h = hashlib.sha256()
        with open(os.path.join(dest, name), "wb") as out:
            while b := body.read(1 << 20):
                h.update(b); out.write(b)
        return h.hexdigest()
elif engine == "obstore":
    import obstore
    from obstore.store import S3Store
    c = S3Store(bucket, endpoint=endpoint, access_key_id=AK, secret_access_key=SK, region="us-east-1",
                client_options={"allow_http": True})
    def listing():
        return {o["path"]: o["size"] for batch in obstore.list(c, prefix + "/") for o in batch}
    def put(name):
        with open(os.path.join(src, name), "rb") as f:
            obstore.put(c, f"{prefix}/{name}", f.read())
    def get(name):
        h = hashlib.sha256()
        with open(os.path.join(dest, name), "wb") as out:
            for b in obstore.get(c, f"{prefix}/{name}").stream(min_chunk_size=1 << 20):
                b = bytes(b); h.update(b); out.write(b)
        return h.hexdigest()
elif engine == "awscrt":
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType
    elg = EventLoopGroup()
    c = S3Client(bootstrap=ClientBootstrap(elg, DefaultHostResolver(elg)), region="us-east-1",
                 credential_provider=AwsCredentialsProvider.new_static(AK, SK), tls_mode=S3RequestTlsMode.DISABLED,
                 throughput_target_gbps=5.0)
    def req(kind, path, **kw):
        r = c.make_request(type=kind, request=HttpRequest("PUT" if kind == S3RequestType.PUT_OBJECT else "GET",
                           f"/{bucket}/{path}", HttpHeaders([("Host", host)])), **kw)
        r.finished_future.result(600)
    import boto3  # the listing: the CRT has no list call of its own
    lc = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=AK,
                      aws_secret_access_key=SK)
    def listing():
        return {o["Key"]: o["Size"] for o in lc.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])}
    def put(name):
        p = os.path.join(src, name)
        r = c.make_request(type=S3RequestType.PUT_OBJECT, request=HttpRequest("PUT", f"/{bucket}/{prefix}/{name}",
                           HttpHeaders([("Host", host), ("Content-Length", str(os.path.getsize(p)))])),
                           send_filepath=p)
        r.finished_future.result(600)
    def get(name):
        p = os.path.join(dest, name)
        req(S3RequestType.GET_OBJECT, f"{prefix}/{name}", recv_filepath=p)
        h = hashlib.sha256()
        with open(p, "rb") as f:  # the CRT writes the file itself: a second read to hash it
            while b := f.read(1 << 20):
                h.update(b)
        return h.hexdigest()
listing()
out = {"start": time.perf_counter() - t0}
with ThreadPoolExecutor(THREADS) as pool:
    t = time.perf_counter(); list(pool.map(put, files)); out["put"] = time.perf_counter() - t
    t = time.perf_counter(); got = listing(); out["list"] = time.perf_counter() - t
    assert len(got) == len(files), (len(got), len(files))
    os.makedirs(dest, exist_ok=True)
    t = time.perf_counter(); sums = list(pool.map(get, files)); out["get"] = time.perf_counter() - t
want = {n: hashlib.sha256(open(os.path.join(src, n), "rb").read()).hexdigest() for n in files}
assert dict(zip(files, sums)) == want, "content differs"
print("@@" + json.dumps(out), flush=True)
'''


PY = sys.executable


def have(engine: str) -> bool:
    mod = {"light": "http.client", "boto3": "boto3", "obstore": "obstore", "awscrt": "awscrt.s3,boto3"}[engine]
    return subprocess.run([PY, "-c", f"import {mod}"], capture_output=True).returncode == 0


def make_tree(d: Path, n: int, size: int) -> None:
    d.mkdir(parents=True)
    block = os.urandom(MiB)
    for i in range(n):
        with open(d / f"f{i:04d}.bin", "wb") as f:
            left = size
            while left > 0:
                f.write(block[:min(left, MiB)] if left < MiB else block)
                left -= MiB
            f.write(i.to_bytes(4, "little"))  # every file differs: no dedup anywhere


def one(engine: str, s3: SeaweedS3, prefix: str, src: Path, dest: Path, env: dict) -> dict:
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run([PY, "-c", WORKER, engine, s3.endpoint, s3.bucket, prefix, str(src), str(dest)],
                       env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"{engine}: {r.stderr[-1500:]}")
    out = json.loads(r.stdout.split("@@", 1)[1])
    out["cpu"] = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    out["wall"] = wall
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="light,boto3,obstore,awscrt")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    global PY
    PY = args.python
    engines = [e for e in args.engines.split(",") if e]
    for e in list(engines):
        if not have(e):
            print(f"  {e}: not installed, skipped")
            engines.remove(e)
    base = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    s3 = SeaweedS3(base / "seaweedfs")
    s3.start()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "REPO": str(REPO),
           "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        trees = {"big": (4, (64 if args.quick else 256) * MiB), "small": (400, 128 << 10)}
        for tree, (n, size) in trees.items():
            src = base / f"src-{tree}"
            make_tree(src, n, size)
            res: dict[str, dict[str, list[float]]] = {e: {} for e in engines}
            for r in range(args.rounds):
                order = engines[r % len(engines):] + engines[:r % len(engines)]
                line = []
                for e in order:
                    dest = base / f"dest-{e}"
                    shutil.rmtree(dest, ignore_errors=True)
                    os.sync()
                    got = one(e, s3, f"{tree}-{e}-{r}", src, dest, env)
                    for k, v in got.items():
                        res[e].setdefault(k, []).append(v)
                    line.append(f"{e} put {got['put']:.2f} list {got['list'] * 1000:.0f}ms get {got['get']:.2f} "
                                f"start {got['start']:.2f}")
                    shutil.rmtree(dest, ignore_errors=True)
                print(f"  {tree} round {r + 1}: " + "; ".join(line), flush=True)
            total = n * size / MiB
            print(f"== {tree}: {n} files, {total:.0f} MiB; medians (ratio = engine / light, <1 is faster)")
            med = {e: {k: statistics.median(v) for k, v in res[e].items()} for e in engines}
            for k in ("start", "put", "list", "get", "cpu"):
                base_v = med.get("light", {}).get(k)
                cells = []
                for e in engines:
                    v = med[e][k]
                    ratio = f" ({v / base_v:.2f}x)" if base_v and e != "light" else ""
                    cells.append(f"{e} {v:.3f}s{ratio}")
                print(f"  {k:<6} " + ", ".join(cells))
            shutil.rmtree(src)
    finally:
        s3.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
