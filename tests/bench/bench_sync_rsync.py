"""Benchmark: our rsync target against plain `rsync -a`, same run, same loopback sshd, same ssh.

    python tests/bench/bench_sync_rsync.py [--quick] [--rounds 5] [--trees big,lora] [--keep DIR]

Two trees: the ~2 GiB HF-style checkpoint of bench_sync.py (a few big files, many small ones) and
a LoRA-shaped run (20 checkpoints of ~50 MiB: adapter, optimizer, tokenizer.json, ...), the
common case on rented GPUs. Each tool uploads the tree to a fresh remote folder, then runs again
with nothing changed. Ours is a fresh `python -m supervisor.sync --once` per pass (start-up,
scan, manifests and content verification all count); the peer is one `rsync -a` with the same
`-e ssh ...` options, and once more with `-c aes128-gcm@openssh.com` (ours puts AES-GCM first
where the CPU has AES instructions), so the table shows what the cipher alone is worth. Rounds rotate the order; each round prints its ratios, then the medians.

Process counts come from one extra, untimed pass per tool with `ssh`/`rsync` shims first on PATH
(each shim counts, then execs the real program); SSH connections are counted on the server (its
log's "Accepted publickey" lines), so a multiplexed session costs no handshake.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sync import make_checkpoint, run, write_safetensors, write_torch_zip  # noqa: E402

from tests.fixtures.sshd import Sshd  # noqa: E402
from tests.fixtures.toml_writer import to_toml  # noqa: E402

MiB = 1024 * 1024
TOOLS = ["ours", "rsync", "rsync-gcm"]


def make_lora(root: Path, n: int, size_mib: float) -> tuple[int, int]:
    """n checkpoint folders shaped like a PEFT LoRA run's: the adapter, its optimizer (about
    2x the adapter), the tokenizer files (tokenizer.json ~1.8 MiB), trainer state and RNG."""
    block = os.urandom(16 * MiB)
    rnd = random.Random(11)
    tok = ('{"version": "1.0", "model": {"vocab": {' + ", ".join(
        f'"t{i}": {i}' for i in range(112_000)) + "}}}").encode()  # ~1.8 MiB
    total = int(size_mib * MiB)
    for k in range(1, n + 1):
        cp = root / f"checkpoint-{k * 100}"
        cp.mkdir(parents=True)
        small = {
            "adapter_config.json": b'{"peft_type": "LORA", "r": 16, "lora_alpha": 32}',
            "tokenizer.json": tok,
            "tokenizer_config.json": b'{"model_max_length": 4096}',
            "special_tokens_map.json": b'{"eos_token": "</s>"}',
            "training_args.bin": b"\x80\x02}q\x00.",
            "scheduler.pt": rnd.randbytes(1064),
            "rng_state.pth": rnd.randbytes(14_512),
            "README.md": b"# adapter\n",
        }
        for name, data in small.items():
            (cp / name).write_bytes(data)
        rest = max(MiB, total - sum(len(d) for d in small.values()))
        write_safetensors(cp / "adapter_model.safetensors", rest // 3, block)
        write_torch_zip(cp / "optimizer.pt", rest - rest // 3, block)
        (cp / "trainer_state.json").write_text(f'{{"global_step": {k * 100}}}')
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


class Bench:
    def __init__(self, sshd: Sshd, work: Path):
        self.sshd, self.work = sshd, work
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        c = sshd.sync_config("/")
        self.ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new", "-o",
                    f"UserKnownHostsFile={c['known_hosts_file']}", "-i", c["ssh_key"], "-o", "IdentitiesOnly=yes",
                    "-o", "LogLevel=ERROR", "-p", str(c["ssh_port"])]

    def argv(self, name: str, src: Path, remote: Path) -> list[str]:
        remote.parent.mkdir(parents=True, exist_ok=True)
        if name == "rsync":
            return ["rsync", "-a", "-e", shlex.join(self.ssh), f"{src}/", f"{self.sshd.target(remote)}/"]
        if name == "rsync-gcm":  # what our cipher order alone is worth
            ssh = [*self.ssh, "-c", "aes128-gcm@openssh.com"]
            return ["rsync", "-a", "-e", shlex.join(ssh), f"{src}/", f"{self.sshd.target(remote)}/"]
        d = remote.with_name(remote.name + ".ours")
        d.mkdir(parents=True, exist_ok=True)
        cfg = {"state_dir": str(d / "state"), "log_level": "warning",
               "sync": {**self.sshd.sync_config(remote), "watch": [str(src)], "quiet_period": "0"}}
        (d / "sync.toml").write_text(to_toml(cfg))
        return [sys.executable, "-m", "supervisor.sync", "--config", str(d / "sync.toml"), "--once"]

    def connections(self) -> int:
        return self.sshd.log.read_text(errors="replace").count("Accepted publickey")

    def counted(self, name: str, src: Path, remote: Path) -> dict[str, int]:
        """One untimed full pass and one no-change pass with counting shims first on PATH."""
        shims = self.work / "shims"
        counts = self.work / "counts"
        shutil.rmtree(counts, ignore_errors=True)
        counts.mkdir(parents=True)
        shims.mkdir(exist_ok=True)
        for prog in ("ssh", "rsync"):
            real = shutil.which(prog)
            (shims / prog).write_text(f'#!/bin/sh\necho >> "{counts}/{prog}"\nexec {real} "$@"\n')
            (shims / prog).chmod(0o755)
        env = {**self.env, "PATH": f"{shims}:{self.env.get('PATH', '')}"}
        out = {}
        for phase in ("full", "nochange"):
            c0 = self.connections()
            for f in counts.iterdir():
                f.unlink()
            r = subprocess.run(self.argv(name, src, remote), env=env, capture_output=True, timeout=1800)
            if r.returncode != 0:
                raise RuntimeError(f"{name} failed ({r.returncode}): {r.stderr[-2000:]!r}")
            time.sleep(0.3)  # the server logs the last connection
            for prog in ("ssh", "rsync"):
                f = counts / prog
                out[f"{phase} {prog}"] = len(f.read_text().splitlines()) if f.exists() else 0
            out[f"{phase} conns"] = self.connections() - c0
        return out


def check(name: str, remote: Path, files: int, nbytes: int, units: list[str]) -> None:
    got = [p for p in remote.rglob("*") if p.is_file() and p.name != "_MANIFEST.json"]
    have = (len(got), sum(p.stat().st_size for p in got))
    if have != (files, nbytes):
        raise RuntimeError(f"{name}: the target holds {have}, expected {(files, nbytes)}")
    if name == "ours":
        lost = [u for u in units if not (remote / u / "_MANIFEST.json").exists()]
        if lost:
            raise RuntimeError(f"ours: no manifest in {lost[:3]}")


def bench_tree(bench: Bench, key: str, label: str, src: Path, rounds: int) -> dict[str, dict[str, float]]:
    files = [p for p in src.rglob("*") if p.is_file()]
    nfiles, nbytes = len(files), sum(p.stat().st_size for p in files)
    units = sorted(p.name for p in src.iterdir() if p.is_dir())
    print(f"\n== {label}: {len(units)} checkpoint(s), {nfiles} files, {nbytes / MiB:.0f} MiB", flush=True)
    res: dict[str, dict[str, list[float]]] = {t: {"full": [], "nochange": []} for t in TOOLS}
    for rnd in range(rounds):
        order = TOOLS[rnd % len(TOOLS):] + TOOLS[:rnd % len(TOOLS)]
        row = {}
        for name in order:
            remote = bench.work / f"{key}-r{rnd}-{name}" / "remote"
            full, _ = run(bench.argv(name, src, remote), bench.env)
            check(name, remote, nfiles, nbytes, units)
            again, _ = run(bench.argv(name, src, remote), bench.env)
            check(name, remote, nfiles, nbytes, units)
            res[name]["full"].append(full)
            res[name]["nochange"].append(again)
            row[name] = (full, again)
            shutil.rmtree(remote.parent, ignore_errors=True)
        (of, on), (rf, rn), (gf, gn) = row["ours"], row["rsync"], row["rsync-gcm"]
        print(f"round {rnd + 1} ({'/'.join(order)}): full ours {of:6.2f}s rsync {rf:6.2f}s ratio {of / rf:5.2f}"
              f" (rsync-gcm {gf:6.2f}s ratio {of / gf:5.2f}) | no-change ours {on:6.3f}s rsync {rn:6.3f}s"
              f" ratio {on / rn:5.2f} (rsync-gcm {gn:6.3f}s)", flush=True)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    ratios_full = [o / r for o, r in zip(res["ours"]["full"], res["rsync"]["full"], strict=True)]
    ratios_nc = [o / r for o, r in zip(res["ours"]["nochange"], res["rsync"]["nochange"], strict=True)]
    ratios_gcm = [o / r for o, r in zip(res["ours"]["full"], res["rsync-gcm"]["full"], strict=True)]
    print(f"median of {rounds}: full ours {med['ours']['full']:.2f}s rsync {med['rsync']['full']:.2f}s"
          f" ({nbytes / MiB / med['rsync']['full']:.0f} MiB/s) rsync-gcm {med['rsync-gcm']['full']:.2f}s"
          f" | no-change ours {med['ours']['nochange']:.3f}s rsync {med['rsync']['nochange']:.3f}s")
    print(f"{label}: ratio ours/rsync -a, median of per-round ratios: full {statistics.median(ratios_full):.2f}"
          f" (goal <= 1.2), no-change {statistics.median(ratios_nc):.2f} (goal <= 1.0); "
          f"full vs rsync -a with our cipher {statistics.median(ratios_gcm):.2f}")
    for name in TOOLS[:2]:
        remote = bench.work / f"{key}-count-{name}" / "remote"
        c = bench.counted(name, src, remote)
        print(f"  {name:5s} processes spawned: full {c['full rsync']} rsync + {c['full ssh']} ssh, "
              f"{c['full conns']} SSH connection(s); no-change {c['nochange rsync']} rsync + "
              f"{c['nochange ssh']} ssh, {c['nochange conns']} connection(s)")
        shutil.rmtree(remote.parent, ignore_errors=True)
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small trees (256 MiB; 20 x 8 MiB), 3 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per tree (default 5, --quick 3)")
    ap.add_argument("--size-mib", type=int, default=None, help="the big checkpoint (default 2048)")
    ap.add_argument("--lora", default=None, help="N x MiB of the LoRA run (default 20x50)")
    ap.add_argument("--trees", default="big,lora")
    ap.add_argument("--keep", default="")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    size = args.size_mib or (256 if args.quick else 2048)
    n, per = (args.lora or ("20x8" if args.quick else "20x50")).split("x")
    for prog in ("rsync", "ssh", "sshd"):
        if not shutil.which(prog) and not (prog == "sshd" and os.path.exists("/usr/sbin/sshd")):
            print(f"{prog} is not installed: skipped")
            return 0
    base = Path(args.keep or tempfile.mkdtemp(prefix="bench-rsync-"))
    base.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "supervisor")], check=True,
                   capture_output=True)
    sshd = Sshd(base / "sshd")
    sshd.start()
    try:
        why = sshd.check_login()
        if why:
            print(f"sshd on loopback unusable: {why}")
            return 1
        bench = Bench(sshd, base / "work")
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for tree in args.trees.split(","):
            src = base / f"src-{tree}"
            shutil.rmtree(src, ignore_errors=True)
            src.mkdir(parents=True)
            if tree == "big":
                make_checkpoint(src, size, 512 if not args.quick else 128)
                bench_tree(bench, tree, f"big checkpoint ({size} MiB)", src, rounds)
            else:
                make_lora(src, int(n), float(per))
                bench_tree(bench, tree, f"LoRA run ({n} x {per} MiB)", src, rounds)
            shutil.rmtree(src, ignore_errors=True)
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        sshd.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
