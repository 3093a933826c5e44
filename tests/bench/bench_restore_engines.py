"""Benchmark: our restore's download step (S3Reader.download: parallel ranged GETs over s3_light, each
file hashed while it arrives or read back in order from the page cache) against the same step with
obstore's GETs (Rust object_store) in its place, on one 2 GiB checkpoint, in one process and one run.
What it answers (issue 41): would moving the restore's GETs to obstore pay, and what does it cost in
memory? Both write through the restore's Staging and hash with the same _OrderedHash.

    python tests/bench/bench_restore_engines.py [--quick] [--rounds 3] [--python PATH]

`--python`: an interpreter that has obstore (pip install obstore); the test venv is left as it is.
Prints each round's wall and CPU seconds, the medians and obstore / ours; and the process's RSS after
each engine's first run (obstore's runtime stays loaded, as it would in the daemon)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

WORKER = r'''
import hashlib, json, os, resource, shutil, sys, time
from concurrent.futures import ThreadPoolExecutor, as_completed
sys.path.insert(0, os.environ["REPO"])
from supervisor.config import load
from supervisor.resume.place import Staging
from supervisor.store import make_target
from supervisor.store.base import reader
from supervisor.store.s3_read import RANGE_MIN, _OrderedHash
from supervisor.config.target import parse_target
cfg_path, unit, work, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = load(cfg_path)
target = make_target(parse_target(cfg.sync.target), cfg.sync, cfg.state_dir)
rd = reader(target)
keys = rd.list_keys()
files = sorted((k[len(unit) + 1:], s) for k, s in keys.items() if k.startswith(unit + "/") and not k.endswith("_MANIFEST.json"))
want = json.loads(rd.read_file(unit + "/_MANIFEST.json"))
sums = {f["path"]: f["sha256"] for f in want["files"]}
store = None

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def obstore_download(into, part):
    import obstore
    global store
    if store is None:
        from obstore.store import S3Store
        store = S3Store(cfg.sync.target[5:].split("/", 1)[0], endpoint=cfg.sync.endpoint_url,
                        access_key_id=os.environ["AWS_ACCESS_KEY_ID"], secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                        region="us-east-1", client_options={"allow_http": True})
    prefix = cfg.sync.target[5:].split("/", 1)[1]
    jobs, hashes, fds = [], {}, []
    for rel, size in files:
        fd = into.create(rel, size); fds.append(fd)
        oh = hashes[rel] = _OrderedHash(fd, rel)
        key = f"{prefix}/{unit}/{rel}"
        jobs += [(key, fd, 0, -1, oh)] if size <= part else [(key, fd, s, min(s + part, size) - 1, oh) for s in range(0, size, part)]
    def one(key, fd, start, end, oh):
        if end < 0:
            data = obstore.get(store, key).bytes()
            mv = memoryview(data)
            h = hashlib.sha256(mv)
            os.pwrite(fd, mv, 0)
            oh.whole(h, len(mv))
        else:
            mv = memoryview(obstore.get_range(store, key, start=start, end=end + 1))
            off = start
            while off < end + 1:
                off += os.pwrite(fd, mv[off - start:], off)
            oh.done(start, off)
    try:
        with ThreadPoolExecutor(max(1, int(cfg.sync.concurrency))) as pool:
            for f in as_completed([pool.submit(one, *j) for j in jobs]):
                f.result()
        return {rel: oh.hexdigest() for rel, oh in hashes.items()}
    finally:
        for fd in fds:
            os.close(fd)

out = []
for r in range(rounds):
    for engine in (("ours", "obstore") if r % 2 == 0 else ("obstore", "ours")):
        d = os.path.join(work, f"stage-{engine}")
        shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
        sfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        into = Staging(sfd, {rel for rel, _ in files})
        os.sync()
        c0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
        if engine == "ours":
            got = rd.download(unit, files, into, lambda n: None)
        else:
            got = obstore_download(into, max(RANGE_MIN, int(cfg.sync.part_size)))
        dt = time.perf_counter() - t; c1 = resource.getrusage(resource.RUSAGE_SELF)
        os.close(sfd)
        assert got == {rel: sums[rel] for rel, _ in files}, "content differs"
        out.append({"engine": engine, "s": dt, "cpu": c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime, "rss": rss()})
        shutil.rmtree(d)
print("@@" + json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    if subprocess.run([args.python, "-c", "import obstore"], capture_output=True).returncode != 0:
        print("obstore is not installed for this interpreter (pip install obstore, or --python PATH): skipped")
        return 0
    from tests.bench.bench_restore import Restore
    from tests.bench.bench_sync import MiB, make_checkpoint
    from tests.fixtures.s3 import SeaweedS3

    base = Path(tempfile.mkdtemp(prefix="bench-restore-engines-"))
    s3 = SeaweedS3(base / "seaweedfs")
    s3.start()
    try:
        src = base / "src"
        src.mkdir()
        make_checkpoint(src, 256 if args.quick else 2048, 128 if args.quick else 512)
        b = Restore(s3, src, base / "work")
        b.upload("ck")
        shutil.rmtree(src)
        dest = base / "dest"
        dest.mkdir()
        cfg = b.ours_restore("ck", dest)[-1]
        r = subprocess.run([args.python, "-c", WORKER, cfg, "checkpoint-1000", str(base), str(args.rounds * 2)],
                           env={**b.env, "REPO": str(REPO)}, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        runs = json.loads(r.stdout.split("@@", 1)[1])
        for x in runs:
            print(f"  {x['engine']:<8} {x['s']:.2f} s  cpu {x['cpu']:.2f} s  process RSS after {x['rss']:.0f} MiB")
        size = (256 if args.quick else 2048) * MiB
        med = {}
        for e in ("ours", "obstore"):
            xs = sorted(x["s"] for x in runs if x["engine"] == e)
            cs = sorted(x["cpu"] for x in runs if x["engine"] == e)
            med[e] = (xs[len(xs) // 2], cs[len(cs) // 2])
            print(f"== {e}: median {med[e][0]:.2f} s ({size / MiB / med[e][0]:.0f} MiB/s), cpu {med[e][1]:.2f} s")
        print(f"obstore / ours: wall {med['obstore'][0] / med['ours'][0]:.2f}, cpu {med['obstore'][1] / med['ours'][1]:.2f}")
    finally:
        s3.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
