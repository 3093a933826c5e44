"""Benchmark: our restore from the Hub (`python -m supervisor.resume` on an `hf://` target: pin the
newest commit, list the tree, read the manifests, download, verify every file's sha256, record in
the ledger) against `hf download REPO --include 'checkpoint-N/*' --local-dir DEST` of the same
folder from the same loopback Hub (tests/fixtures/fake_hub.py, LFS path: HF_HUB_DISABLE_XET=1).

    python tests/bench/bench_restore_hf.py [--quick] [--rounds 3]

The tree is bench_restore's `lora` one: a LoRA run (bench_sync.make_lora_run: 20 checkpoints of
~50 MiB; the restore lists and judges all 20 and downloads the newest), uploaded once with our sync
(`python -m supervisor.sync --once`). Each round both tools download into an empty folder as a
fresh process (start-up counts for both) with a fresh HF_HOME (no cache helps either side), the
order rotated; the result is checked (file count and bytes), then removed. Prints each round and
the medians, and ours / hf. `daemon` is our restore as the daemon runs it (in a process already
up: bench_restore.DaemonLike), without Python's start-up and imports. The Hub runs in this process (Python's threading HTTP server), so its
serving cost is shared by both tools. `--quick`: 20 x 12 MiB LoRA run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.bench_restore import DaemonLike, report, tree_size  # noqa: E402
from tests.bench.bench_sync import MiB, make_lora_run, run, tool  # noqa: E402
from tests.fixtures.fake_hub import FakeHub  # noqa: E402
from tests.fixtures.sync_engine import to_toml  # noqa: E402

TOKEN = "hf_writetoken"
REPO_ID = "alice/lora-run"


class HubRestore:
    def __init__(self, hub: FakeHub, src: Path, work: Path):
        self.hub, self.src, self.work = hub, src, work
        work.mkdir(parents=True, exist_ok=True)
        self.token_file = work / "hf-token"
        self.token_file.write_text(TOKEN)
        self.env = {**os.environ, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN,
                    "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
        self.env.pop("HUGGING_FACE_HUB_TOKEN", None)

    def sync_cfg(self, d: Path, watch: Path) -> Path:
        cfg = {"state_dir": str(d / "state"), "log_level": "warning",
               "sync": {"target": f"hf://{REPO_ID}", "endpoint_url": self.hub.url,
                        "hf_token_file": str(self.token_file), "watch": [str(watch)], "quiet_period": "0"}}
        (d / "cfg.toml").write_text(to_toml(cfg))
        return d / "cfg.toml"

    def upload(self) -> None:
        d = self.work / "upload"
        d.mkdir()
        run([sys.executable, "-m", "supervisor.sync", "--config", str(self.sync_cfg(d, self.src)), "--once"],
            self.round_env(d))

    def round_env(self, d: Path) -> dict:
        return {**self.env, "HF_HOME": str(d / "hf-home")}

    def ours(self, d: Path, unit: str, dest: Path) -> list[str]:
        return [sys.executable, "-m", "supervisor.resume", "--config", str(self.sync_cfg(d, dest))]

    def hf(self, d: Path, unit: str, dest: Path) -> list[str]:
        exe = tool("hf")
        if exe:
            return [exe, "download", REPO_ID, "--include", f"{unit}/*", "--local-dir", str(dest)]
        return [tool("huggingface-cli") or "huggingface-cli", "download", REPO_ID, "--include", f"{unit}/*",
                "--local-dir", str(dest)]


def bench(b: HubRestore, unit: str, want: tuple[int, int], rounds: int) -> dict[str, list[float]]:
    names = ["ours", "daemon", "hf"]
    times: dict[str, list[float]] = {n: [] for n in names}
    daemon = DaemonLike({**b.env, "HF_HOME": str(b.work / "hf-home-daemon")})
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            line = []
            for n in order:
                d = b.work / f"round-{r}-{n}"
                dest = d / "out"
                dest.mkdir(parents=True)
                os.sync()  # as in bench_restore: nobody pays for the writeback of the run before
                h0 = dict(b.hub.requests)
                cpu = None
                if n == "daemon":
                    dt = daemon.restore(str(b.sync_cfg(d, dest)))
                else:
                    dt, cpu = run(getattr(b, n)(d, unit, dest), b.round_env(d))
                calls = {k: v - h0.get(k, 0) for k, v in sorted(b.hub.requests.items()) if v - h0.get(k, 0)}
                got = tree_size(dest / unit)
                if got != want:
                    raise RuntimeError(f"{n}: restored {got}, expected {want}")
                times[n].append(dt)
                line.append(f"{n} {dt:.2f}s ({'' if cpu is None else f'cpu {cpu:.2f}s, '}Hub requests "
                            f"{sum(calls.values())}: " + " ".join(f"{k} {v}" for k, v in calls.items()) + ")")
                shutil.rmtree(d)
            print(f"  round {r + 1}: " + ", ".join(line), flush=True)
    finally:
        daemon.close()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-restore-hf-"))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "supervisor")], check=True,
                   capture_output=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    hub = FakeHub(base / "hub")
    try:
        src = base / "src-lora"
        src.mkdir(parents=True)
        make_lora_run(src, 20, 12 if args.quick else 50, 2 if args.quick else 1.8)
        unit = max((p.name for p in src.iterdir()), key=lambda n: int(n.split("-")[1]))
        want = tree_size(src / unit)
        b = HubRestore(hub, src, base / "work")
        t = time.perf_counter()
        b.upload()
        print(f"\n== lora on the Hub ({hub.url}): {unit}, {want[0]} files, {want[1] / MiB:.0f} MiB "
              f"(uploaded in {time.perf_counter() - t:.1f}s, {hub.commits(REPO_ID)} commit(s))", flush=True)
        shutil.rmtree(src)  # the restore must not find it locally
        times = bench(b, unit, want, args.rounds)
        report("lora (Hub)", want[1], {n: t for n, t in times.items() if t})
    finally:
        hub.close()
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
