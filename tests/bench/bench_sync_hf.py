"""Benchmark: our hf:// target against the Hugging Face tools, same run, same loopback Hub
(tests/fixtures/fake_hub.py, LFS path: HF_HUB_DISABLE_XET=1), same synthetic data.

    python tests/bench/bench_sync_hf.py            # --quick: 200 MiB checkpoint, LoRA run 10 x 10 MiB
    python tests/bench/bench_sync_hf.py --full     # 1 GiB checkpoint, LoRA run 20 x 50 MiB

Scenario 1, one checkpoint: a first upload, then a second run with nothing changed.
Scenario 2, a LoRA run: checkpoints appear one after another; after each one every tool is run
once (a fresh process each time, so start-up counts for everyone):
  ours         python -m supervisor.sync --once      (the engine; uploads what is new)
  hf-upload    hf upload REPO OUT .                  (the CLI on the whole output folder)
  upload_folder  HfApi.upload_folder(checkpoint-N)   (a Trainer-callback-style upload of the new folder)
Each tool has its own repo. The Hub runs in this process, the clients in subprocesses. Printed:
wall time, client CPU, bytes the Hub received, object PUTs, commits and API requests, and
ours / theirs ratios (below 1: ours is cheaper).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
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
# the test fixtures are imported in main() only: the put_units driver runs as a fresh process per
# checkpoint and must not pay for them

MiB = 1024 * 1024
TOKEN = "hf_writetoken"


# --- data ---------------------------------------------------------------------------------------

def _fill(f, size: int, block: bytes) -> None:
    i = 0
    while size > 0:
        n = min(size, len(block))
        f.write(struct.pack("<Q", i) + block[8:n] if n >= 8 else block[:n])
        size -= n
        i += 1


def _safetensors(path: Path, size: int, block: bytes) -> None:
    hdr = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)) + hdr)
        _fill(f, size, block)


def _torch(path: Path, size: int, block: bytes) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        with z.open("archive/data/0", "w", force_zip64=True) as f:
            _fill(f, size, block)


def checkpoint(out: Path, step: int, size: int, max_steps: int, peft: bool) -> Path:
    """checkpoint-{step}/ about `size` bytes, laid out as the HF Trainer writes it, mtimes in the past."""
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    block = random.Random(step).randbytes(4 * MiB)
    weights = size // 3
    if peft:
        _safetensors(d / "adapter_model.safetensors", weights, block)
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16}))
    else:
        _safetensors(d / "model.safetensors", weights, block)
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _torch(d / "optimizer.pt", size - weights - 64 * 1024, block[::-1])
    _torch(d / "scheduler.pt", 1024, block)
    _torch(d / "rng_state.pth", 14 * 1024, block)
    _torch(d / "training_args.bin", 5 * 1024, block)
    (d / "tokenizer.json").write_bytes(json.dumps({"model": {"vocab": {f"tok{i}": i for i in range(100_000)}}}).encode())
    (d / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    (d / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    (d / "trainer_state.json").write_text(json.dumps(
        {"global_step": step, "max_steps": max_steps, "log_history": [{"loss": 2.0 / (1 + step), "step": step}]}))
    t = time.time() - 120
    for p in d.iterdir():
        os.utime(p, (t, t))
    return d


# --- running the tools ----------------------------------------------------------------------------

def run(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall s, CPU s of the child)."""
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return wall, (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)


class Bench:
    def __init__(self, hub, work: Path):
        self.hub = hub
        self.work = work
        tok = work / "token"
        tok.write_text(TOKEN)
        self.token_file = tok
        self.env = {**os.environ, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HOME": str(work / "hf-home"),
                    "HF_ENDPOINT": hub.url, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
        self.env.pop("HF_TOKEN", None)

    def ours(self, name: str, out: Path) -> list[str]:
        from tests.fixtures.sync_engine import to_toml

        cfg = self.work / f"{name}.toml"
        if not cfg.exists():
            cfg.write_text(to_toml({"state_dir": str(self.work / f"state-{name}"), "sync": {
                "target": f"hf://alice/{name}", "endpoint_url": self.hub.url, "hf_token_file": str(self.token_file),
                "watch": [str(out)], "quiet_period": "1s"}}))
        return [sys.executable, "-m", "supervisor.sync", "--config", str(cfg), "--once", "--log-level", "warning"]

    def cli(self, name: str, folder: Path, in_repo: str = ".") -> list[str]:
        return [str(Path(sys.executable).with_name("hf")), "upload", f"alice/{name}", str(folder), in_repo,
                "--private", "--token", TOKEN, "--quiet"]

    def api(self, name: str, folder: Path, in_repo: str) -> list[str]:
        code = ("import sys; from huggingface_hub import HfApi; a = HfApi(token=sys.argv[1]); "
                "a.create_repo(sys.argv[2], private=True, exist_ok=True); "
                "a.upload_folder(repo_id=sys.argv[2], folder_path=sys.argv[3], path_in_repo=sys.argv[4], "
                "commit_message='upload ' + sys.argv[4])")
        return [sys.executable, "-c", code, TOKEN, f"alice/{name}", str(folder), in_repo]

    def ours_put_units(self, name: str, out: Path) -> list[str]:
        """What the engine does once it calls put_units: the new units' files and manifests in one commit."""
        return [sys.executable, str(Path(__file__).resolve()), "--drive-put-units", f"hf://alice/{name}", str(out),
                self.hub.url, str(self.token_file), str(self.work / f"state-{name}")]

    def measure(self, argv: list[str], repo: str) -> dict:
        h = self.hub
        b0, p0, r0 = h.bytes_received, sum(h.object_puts.values()), sum(h.requests.values())
        c0 = h.commits(repo) if ("model", repo) in h.repos else 0
        wall, cpu = run(argv, self.env)
        puts = sum(h.object_puts.values()) - p0
        return {"wall": wall, "cpu": cpu, "bytes": h.bytes_received - b0, "puts": puts,
                "commits": h.commits(repo) - c0, "api": sum(h.requests.values()) - r0 - puts}


def add(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b[k] for k in b}


def table(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}")
    print(f"  {'tool':<16}{'wall s':>9}{'cpu s':>9}{'MiB recv':>10}{'PUTs':>7}{'commits':>9}{'API calls':>11}")
    for name, m in rows.items():
        print(f"  {name:<16}{m['wall']:>9.2f}{m['cpu']:>9.2f}{m['bytes'] / MiB:>10.1f}{m['puts']:>7}"
              f"{m['commits']:>9}{m['api']:>11}")
    for mine in ("ours", "ours+put_units"):
        for name, m in rows.items():
            if not name.startswith("ours"):
                r = {k: ratio(rows[mine][k], m[k]) for k in ("wall", "cpu", "bytes", "commits", "api")}
                print(f"  {mine + '/' + name:<30} wall {r['wall']}  cpu {r['cpu']}  bytes {r['bytes']}  "
                      f"commits {r['commits']}  API calls {r['api']}")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ("=" if a == b else "inf")


def drive_put_units(target_url: str, out: Path, endpoint: str, token_file: str, state: Path) -> None:
    """A stand-in for the engine wired to put_units: every checkpoint-* folder not done yet (a JSON
    file plays the ledger) goes up as one UnitPut, all of them in one call."""
    import socket

    from supervisor.config import from_dict
    from supervisor.config.target import parse_target
    from supervisor.store import base
    from supervisor.store.hf import HfTarget
    from supervisor.sync import manifest as mf

    state.mkdir(parents=True, exist_ok=True)
    done_path = state / "done.json"
    done = set(json.loads(done_path.read_text())) if done_path.exists() else set()
    cfg = from_dict({"sync": {"target": target_url, "endpoint_url": endpoint, "hf_token_file": token_file}}).sync
    target = HfTarget(parse_target(target_url), cfg, state / "tmp")
    units = []
    for d in sorted(p for p in out.iterdir() if p.name.startswith("checkpoint-") and p.name not in done):
        files = [base.LocalFile(str(p), f"{d.name}/{p.name}", p.stat().st_size, p.stat().st_mtime_ns)
                 for p in sorted(d.iterdir())]

        def manifest(results: dict, d: Path = d, files: list = files) -> bytes:
            listed = [mf.ManifestFile(f.key.split("/", 1)[1], f.size, results[f.key].sha256) for f in files]
            return mf.build(d.name, listed, time.time(), socket.gethostname(), str(d))

        units.append(base.UnitPut(d.name, files, manifest))

    class Sink:  # the ledger's part is played by done.json
        def begin(self, f, info) -> None:
            pass

        def part(self, *a) -> None:
            pass

        def done(self, f, r) -> None:
            pass

        def problem(self, f, e) -> None:
            raise SystemExit(str(e))

        def progress(self, f, n) -> None:
            pass

        def in_flight(self, key) -> None:
            return None

        def cancelled(self) -> bool:
            return False

    res = base.put_units(target, units, Sink())
    done_path.write_text(json.dumps(sorted(done | set(res.manifests))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="1 GiB checkpoint, LoRA run of 20 x 50 MiB")
    ap.add_argument("--quick", action="store_true", help="64 MiB checkpoint, LoRA run of 5 x 4 MiB, 1 round")
    ap.add_argument("--rounds", type=int, default=None, help="rounds, the tools' order rotated (default 3)")
    ap.add_argument("--keep", default="", help="work in this folder and keep it")
    ap.add_argument("--drive-put-units", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive_put_units:
        url, out, endpoint, tok, state = args.drive_put_units
        drive_put_units(url, Path(out), endpoint, tok, Path(state))
        return 0
    size, n_lora, lora_size = (1024 * MiB, 20, 50 * MiB) if args.full else (200 * MiB, 10, 10 * MiB)
    if args.quick:
        size, n_lora, lora_size = 64 * MiB, 5, 4 * MiB
    rounds = args.rounds or (1 if args.quick else 3)
    from tests.fixtures.fake_hub import FakeHub

    work = Path(args.keep or tempfile.mkdtemp(prefix="bench-hf-"))
    work.mkdir(parents=True, exist_ok=True)
    hub = FakeHub(work / "hub")
    b = Bench(hub, work)
    print(f"loopback Hub {hub.url}; checkpoint {size // MiB} MiB; LoRA run {n_lora} x {lora_size // MiB} MiB; "
          f"LFS path (HF_HUB_DISABLE_XET=1); {rounds} round(s), the tools' order rotated")
    tools = ["ours", "ours+put_units", "hf-upload", "upload_folder"]
    rounds_of: dict[str, list[dict[str, dict]]] = {"first": [], "second": [], "lora": []}

    def argv_of(tool: str, name: str, out: Path, cp: Path) -> tuple[list[str], str]:
        if tool == "ours":
            return b.ours(f"{name}-ours", out), f"alice/{name}-ours"
        if tool == "ours+put_units":
            return b.ours_put_units(f"{name}-pu", out), f"alice/{name}-pu"
        if tool == "hf-upload":
            return b.cli(f"{name}-cli", out), f"alice/{name}-cli"
        return b.api(f"{name}-api", cp, cp.name), f"alice/{name}-api"

    for rnd in range(rounds):
        order = tools[rnd % len(tools):] + tools[:rnd % len(tools)]
        # 1: one checkpoint
        out = work / f"one-r{rnd}"
        cp = checkpoint(out, 1000, size, 5000, peft=False)
        first: dict[str, dict] = {}
        second: dict[str, dict] = {}
        for tool in order:
            argv, repo = argv_of(tool, f"one-r{rnd}", out, cp)
            first[tool] = b.measure(argv, repo)
            second[tool] = b.measure(argv, repo)
        first = {t: first[t] for t in tools}
        second = {t: second[t] for t in tools}
        table(f"round {rnd + 1}: 1a. one checkpoint ({size // MiB} MiB), first upload", first)
        table(f"round {rnd + 1}: 1b. the same again, nothing changed", second)

        # 2: a LoRA run, checkpoint after checkpoint
        out = work / f"lora-r{rnd}"
        total: dict[str, dict] = {}
        for i in range(1, n_lora + 1):
            cp = checkpoint(out, i * 100, lora_size, n_lora * 100, peft=True)
            for tool in order:
                argv, repo = argv_of(tool, f"lora-r{rnd}", out, cp)
                total[tool] = add(total.get(tool, {}), b.measure(argv, repo))
        total = {t: total[t] for t in tools}
        table(f"round {rnd + 1}: 2. LoRA run: {n_lora} checkpoints of {lora_size // MiB} MiB, each tool run after "
              "each checkpoint", total)
        for key, rows in (("first", first), ("second", second), ("lora", total)):
            rounds_of[key].append(rows)
    if rounds > 1:
        for key, title in (("first", "1a. first upload"), ("second", "1b. nothing changed"), ("lora", "2. LoRA run")):
            rs = rounds_of[key]
            med = {t: {k: statistics.median(r[t][k] for r in rs) for k in rs[0][t]} for t in tools}
            table(f"median of {rounds} rounds: {title}", med)
    hub.close()
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
