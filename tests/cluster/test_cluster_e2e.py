"""Many machines, round two (issue 53), end to end: real daemons on one box as separate nodes, each
running its node of a real torchrun job (gloo on CPU, loopback) that saves the way the HF Trainer
with DeepSpeed ZeRO does (tests/fixtures/ds_node.py), to SeaweedFS.

- three nodes on node-local folders, the run signed with cluster.key_file, the default heartbeat
  and silent_after: every node's part is complete by its own ranks (node 1 and 2 never get the
  model states), rank 0 records the units, a planted unsigned record and a record that is JSON
  but no object change nothing, node 2 frozen whole releases the two survivors (saved, then
  stopped: the time is measured and printed), and fresh machines resume from one unit;
- two nodes on one shared folder, node 1's daemon killed mid-upload and started again: the records
  keep naming both nodes' verified parts."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from supervisor.saves import parts
from tests.fixtures.ports import free_port
from tests.waiting import wait_until

HF_PYTHON = os.environ.get("TSUP_HF_PYTHON", "")
SCRIPT = Path(__file__).parents[1] / "fixtures" / "ds_node.py"
pytestmark = pytest.mark.skipif(not HF_PYTHON, reason="TSUP_HF_PYTHON is not set (tests/run.sh builds .venv-hf with torch)")


def node_config(here: Path, k: int, nodes: int, s3, prefix: str, port: int, out: Path, *, key_file: str = "",
                every: int = 20, heartbeat: str = "15s", silent_after: str = "60s", sync: dict | None = None) -> dict:
    here.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    cmd = (f"{HF_PYTHON} -m torch.distributed.run --nnodes {nodes} --node_rank {k} --nproc_per_node 1 "
           f"--master_addr 127.0.0.1 --master_port {port} {SCRIPT} {out} {every}")
    return {
        "training": {"command": cmd, "workdir": str(here), "log": str(here / "train.log"), "on_finish": "none",
                     "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TMPDIR": str(here)}},
        # a long quiet period: every unit here goes up by its trainer's rule, never by quiet alone
        "sync": s3.sync_config(prefix, watch=[str(out)], quiet_period="30s", **(sync or {})),
        "idle": {"warn_after": "2h", "count_ssh": False},
        "stop": {"action": "command", "command": f"echo stopped >> {here / 'stopped.txt'}", "final_sync": [str(out)],
                 "retry_interval": "1s", "final_sync_timeout": "60s"},
        "cluster": {"nodes": nodes, "rank": k, "run_id": "ds-1", "heartbeat": heartbeat, "silent_after": silent_after,
                    **({"key_file": key_file} if key_file else {})},
    }


def records(s3, prefix: str, nodes: int, key: bytes | None = None) -> dict[str, dict[int, str]]:
    """The run-wide records on the target that are ours (read as a resume reads them)."""
    out = {}
    for k in s3.objects(prefix):
        if k.startswith("_cluster/checkpoint-") and k.endswith(".json"):
            unit = k[len("_cluster/"):-len(".json")]
            rec, _ = parts.read_record(s3.get(f"{prefix}/{k}"), unit, nodes, key)
            if rec is not None:
                out[unit] = rec
    return out


def freeze(d, here: Path) -> list[int]:
    """The node's daemon and every process of its job stopped whole (torchrun's workers run in
    sessions of their own, so the job's process group alone would leave the worker training)."""
    import psutil

    pids = [d.proc.pid] + [p.pid for p in psutil.process_iter(["cmdline"])
                           if any(str(here) in a for a in (p.info["cmdline"] or []))]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def thaw(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_three_nodes_on_their_own_disks_record_resume_and_release_the_survivors(tmp_path, make_daemon, s3_server,
                                                                                s3_prefix):
    key = b"the-runs-shared-secret-0123456789"
    (tmp_path / "run.key").write_bytes(key + b"\n")
    port = free_port()
    ds = []
    for k in range(3):
        here = tmp_path / f"n{k}"
        ds.append(make_daemon(node_config(here, k, 3, s3_server, s3_prefix, port, here / "out",
                                          key_file=str(tmp_path / "run.key")), sub=f"d{k}"))
    for d in ds:
        d.req("start")

    def whole() -> dict:
        got = records(s3_server, s3_prefix, 3, key)
        return {u: r for u, r in got.items() if parts.NONE not in r.values()}

    wait_until(whole, 240, interval=1.0, what="a unit recorded with every node's part")
    unit, rec = max(whole().items(), key=lambda x: int(x[0].split("-")[1]))
    raw = json.loads(s3_server.get(f"{s3_prefix}/_cluster/{unit}.json"))
    assert raw["sig"] and set(raw["parts"]) == {"0", "1", "2"}
    objs = s3_server.objects(s3_prefix)
    # node-local: each part holds its own rank's shard; the model states only node 0's
    assert f"node-1/{unit}/global_step{unit.split('-')[1]}/zero_pp_rank_1_mp_rank_00_optim_states.pt" in objs
    assert not [k for k in objs if k.startswith(("node-1/", "node-2/")) and k.endswith("mp_rank_00_model_states.pt")
                and "zero_pp" not in k]
    st1 = ds[1].status()
    assert st1["cluster"]["ranks"]["ranks"] == [[1, 1]] and st1["cluster"]["ranks"]["world_size"] == 3
    assert st1["cluster"]["trust"]["signed"]
    mine = {u["unit"]: u for u in st1["sync"]["units"]}
    assert mine[unit]["complete"] and mine[unit]["format"] == "deepspeed"

    # planted: an unsigned record naming a newer unit, and a record that is JSON but no object
    c = s3_server.client()
    c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/_cluster/checkpoint-999999.json",
                 Body=parts.record_doc("checkpoint-999999", "ds-1", {0: "a" * 64, 1: "b" * 64, 2: "c" * 64}, "t"))
    c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/_cluster/checkpoint-999998.json", Body=b"[]")

    # node 2 frozen whole: the two survivors are saved, then stopped
    pids = freeze(ds[2], tmp_path / "n2")
    assert len(pids) >= 3, pids
    frozen_at = time.monotonic()
    took = {}
    try:
        def stopped() -> bool:
            for k in (0, 1):
                if k not in took and (tmp_path / f"n{k}" / "stopped.txt").exists():
                    took[k] = time.monotonic() - frozen_at
            return len(took) == 2
        wait_until(stopped, 200, interval=0.5, what="both survivors stopped")
        for k in (0, 1):
            st = ds[k].status()
            assert st["stop"]["reason"] == "node_lost", st["stop"]
            assert st["stop"]["final_sync"]["ok"], st["stop"]
            assert {n["rank"]: n["state"] for n in st["cluster"]["nodes"]}[2] == "lost"
            assert st["cluster"]["error"] == ""
    finally:
        thaw(pids)
    print(f"dead node -> survivors saved and stopped (heartbeat 15s, silent_after 60s): node 0 {took[0]:.1f} s, "
          f"node 1 {took[1]:.1f} s after node 2 was frozen")
    assert max(took.values()) < 120, took
    for d in ds:
        d.cleanup()

    # fresh machines: every node restores its own part of one and the same unit
    got = []
    for k in range(3):
        here = tmp_path / "again" / f"n{k}"
        cfg = node_config(here, k, 3, s3_server, s3_prefix, port, here / "out", key_file=str(tmp_path / "run.key"))
        cfg["resume"] = {"from_target": True}
        d = make_daemon(cfg, sub=f"again{k}")
        res = d.req("resume", {}, timeout=120)
        got.append(res["unit"])
        step = res["unit"].split("-")[1]
        tag = here / "out" / res["unit"] / f"global_step{step}"
        assert (tag / f"zero_pp_rank_{k}_mp_rank_00_optim_states.pt").is_file()
        assert [p.name for p in tag.glob("zero_pp_rank_*")] == [f"zero_pp_rank_{k}_mp_rank_00_optim_states.pt"]
    assert got[0] == got[1] == got[2] and got[0] != "checkpoint-999999", got
    assert int(got[0].split("-")[1]) >= int(unit.split("-")[1])


def test_two_nodes_on_a_shared_disk_keep_their_records_through_a_daemon_restart_mid_upload(tmp_path, make_daemon,
                                                                                          s3_server, s3_prefix):
    """Both nodes see every file of the shared folder and each sends it as its part; node 1's sends
    slowly (a bandwidth limit) and its daemon is killed while it sends, then started again (its
    first heartbeats say it holds "unknown" until its first scan ends: tests/cluster/test_cluster_whole.py):
    every record names both nodes' verified parts, never "none", and units saved after the restart
    are recorded."""
    port = free_port()
    shared = tmp_path / "shared" / "out"
    ds = [make_daemon(node_config(tmp_path / f"n{k}", k, 2, s3_server, s3_prefix, port, shared, every=30,
                                  heartbeat="1s", silent_after="20s",
                                  sync={"bandwidth_limit": "150KB"} if k == 1 else None), sub=f"d{k}")
          for k in range(2)]
    for d in ds:
        d.req("start")
    wait_until(lambda: records(s3_server, s3_prefix, 2), 180, interval=0.5, what="a first record")
    wait_until(lambda: ds[1].status()["sync"]["state"] == "uploading", 60, interval=0.05, what="node 1 uploading")
    ds[1].kill9()
    saved = [int(p.name.split("-")[1]) for p in shared.glob("checkpoint-*")]
    ds[1].start()
    assert ds[1].status()["training"]["state"] == "RUNNING"  # re-adopted, never started twice

    def after_restart() -> list[str]:
        # a unit first saved after the kill: node 1's part of it was sent by the restarted daemon
        return [u for u in records(s3_server, s3_prefix, 2) if int(u.split("-")[1]) > max(saved)]
    wait_until(after_restart, 180, interval=1.0, what="a unit saved after node 1's restart, recorded")
    for unit, rec in records(s3_server, s3_prefix, 2).items():
        assert parts.NONE not in rec.values(), (unit, rec)
        for k in (0, 1):
            m = s3_server.get(f"{s3_prefix}/node-{k}/{unit}/_MANIFEST.json")
            assert parts.part_digest(m) == rec[k], (unit, k)
    st = ds[0].status()["cluster"]
    assert not st["trust"]["signed"] and "is trusted by the cluster" in st["trust"]["words"]
    for d in ds:
        d.cleanup()
