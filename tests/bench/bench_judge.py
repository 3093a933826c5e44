"""Benchmark: what judging a checkpoint costs next to uploading it (issue 38: within 5 %).

A DeepSpeed ZeRO-3 checkpoint inside the HF Trainer's checkpoint-N/ (4 ranks' optimizer and model
shards as torch zips, a sharded model.safetensors, JSON files): about 2 GiB in 100 files. The
judge is the scanner's first look (the walk, every format check's header and end-record reads,
the format rule); the upload is the engine's `--once` pass of the same folder, which already
includes a judge, to a local folder target (the fastest target there is: the worst case for the
ratio) and to `cp -r` of the same tree for scale. Page cache dropped between steps where root may.

    python tests/bench/bench_judge.py [--size-mib 2048] [--files 100] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fixtures.hf_writer import safetensors_bytes, torch_zip_bytes  # noqa: E402

MiB = 1024**2


def make(root: Path, size: int, nfiles: int, ranks: int = 4) -> Path:
    ck = root / "out" / "checkpoint-400"
    tag = ck / "global_step400"
    tag.mkdir(parents=True)
    big = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ranks)]
    big += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(ranks)]
    shards = [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    per = size // (len(big) + len(shards))
    for i, n in enumerate(big):
        (tag / n).write_bytes(torch_zip_bytes(per - 4096, i))
    for i, n in enumerate(shards):
        (ck / n).write_bytes(safetensors_bytes({"w": per - 4096}, 100 + i))
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"l{i}": s for i, s in enumerate(shards)}}))
    (ck / "latest").write_text("global_step400")
    small = nfiles - len(big) - len(shards) - 3
    for i in range(max(0, small)):
        (ck / f"extra_{i:03d}.json").write_text(json.dumps({"i": i, "pad": "x" * 2000}))
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 400, "log_history": []}))
    return root / "out"


def drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def judge_once(out: Path) -> tuple[float, str, int]:
    from supervisor.config import from_dict
    from supervisor.store._log import Once, get_logger
    from supervisor.sync import scan as sc
    from supervisor.sync.policy import Policy
    from supervisor.sync.walk import Walker

    cfg = from_dict({"sync": {"target": "/nowhere", "watch": [str(out)], "quiet_period": "0s", "world_size": 4}})
    policy = Policy(cfg.sync.include, cfg.sync.exclude)
    s = Walker(policy, cfg.sync, Once(get_logger("bench")))
    t = time.perf_counter()
    units = s.scan([sc.Root(str(out), "")], [], time.time() + 60, time.monotonic() + 60, lambda _p: [])
    dt = time.perf_counter() - t
    u = next(iter(units.values()))
    return dt, f"{u.verdict.format}: {u.verdict.reason}", s.header_reads


def upload_once(work: Path, out: Path, n: int) -> float:
    d = work / f"up{n}"
    d.mkdir()
    cfg = d / "cfg.toml"
    cfg.write_text(f'state_dir = "{d / "state"}"\nlog_level = "warning"\n[sync]\ntarget = "{d / "remote"}"\n'
                   f'watch = ["{out}"]\nquiet_period = "0s"\nworld_size = 4\n')
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "supervisor.sync", "--config", str(cfg), "--once"], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return time.perf_counter() - t


def cp_once(work: Path, out: Path, n: int) -> float:
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(out), str(work / f"cp{n}")], check=True)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=2048)
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    size = (256 if a.quick else a.size_mib) * MiB
    work = Path(tempfile.mkdtemp(prefix="bench-judge-"))
    try:
        out = make(work, size, a.files)
        nfiles = sum(1 for _ in out.rglob("*") if _.is_file())
        print(f"tree: {nfiles} files, {sum(p.stat().st_size for p in out.rglob('*') if p.is_file()) / MiB:.0f} MiB")
        judges, ups, cps = [], [], []
        for r in range(a.rounds):
            drop_caches()
            j, verdict, reads = judge_once(out)
            drop_caches()
            u = upload_once(work, out, r)
            drop_caches()
            c = cp_once(work, out, r)
            shutil.rmtree(work / f"up{r}")
            shutil.rmtree(work / f"cp{r}")
            judges.append(j)
            ups.append(u)
            cps.append(c)
            print(f"round {r + 1}: judge {j * 1000:.0f} ms ({reads} header reads; {verdict}); upload {u:.2f} s; "
                  f"cp -r {c:.2f} s; judge/upload {100 * j / u:.2f} %")
        j, u, c = statistics.median(judges), statistics.median(ups), statistics.median(cps)
        print(f"median: judge {j * 1000:.0f} ms, upload {u:.2f} s (cp -r {c:.2f} s): the judge is {100 * j / u:.2f} % "
              f"of the upload it rides on (goal: under 5 %), {100 * j / c:.2f} % of a plain cp -r")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
