"""The restore on every kind of target, in this process: machine A (a real SyncEngine) uploads
checkpoint-10 and checkpoint-20 with their manifests; a newer checkpoint-30 lies on the target
half-uploaded (no manifest); "machine B" (a fresh state dir, an empty output folder) restores
checkpoint-20 byte-identical, names checkpoint-30 as skipped, and its own sync then sends nothing
of what was restored. A damaged object (same size, other bytes) in checkpoint-20 makes the restore
fall back to checkpoint-10 and say so."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from supervisor.resume.restore import NothingToRestore, Restorer
from supervisor.store import make_target
from supervisor.store.base import TargetError
from tests.fixtures.hf_writer import HFWriter
from tests.store.test_sync_hf import TOKEN, hf_sync


@pytest.fixture(autouse=True)
def _hf_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


def machine_a(make_engine, sync: dict, out: Path, **kw) -> HFWriter:
    w = HFWriter(out)
    w.checkpoint(10, **kw)
    w.checkpoint(20, **kw)
    e = make_engine({**sync, "watch": [str(out)]}, state="state-a")
    r = e.wait_idle(60)
    assert r.ok, r.error
    e.close()
    return w


def machine_b(make_engine, sync: dict, out: Path):
    e = make_engine({**sync, "watch": [str(out)]}, state="state-b", start=False)
    kind = e.url.kind
    target = make_target(e.url, e.cfg, e.state_dir)
    return e, Restorer(target, e.ledger, list(e.roots), time.time, etag_is_sha=kind in ("local", "rsync"))


def check_restored(w: HFWriter, out_b: Path, res, e) -> None:
    assert res.unit.key == "checkpoint-20" and res.unit.step == 20
    assert [u.key for u in res.skipped] == ["checkpoint-30"]
    assert "no _MANIFEST.json" in res.skipped[0].why
    got = {p.name: p.read_bytes() for p in (out_b / "checkpoint-20").iterdir()}
    assert got == w.contents["checkpoint-20"]  # byte-identical, and nothing else in the folder
    assert sorted(p.name for p in out_b.iterdir()) == ["checkpoint-20"]  # no staging folder left
    e.start()
    r = e.wait_idle(60)
    assert r.ok and r.uploaded_files == 0, r  # what was restored is on the target already


def half_checkpoint_30(w: HFWriter) -> dict[str, bytes]:
    return {n: d for n, d in w.checkpoint_files(30)[:3]}


def test_local_target(make_engine, tmp_path):
    sync = {"target": str(tmp_path / "remote")}
    w = machine_a(make_engine, sync, tmp_path / "a" / "out")
    half = tmp_path / "remote" / "checkpoint-30"
    half.mkdir()
    for n, d in half_checkpoint_30(w).items():
        (half / n).write_bytes(d)
    e, rs = machine_b(make_engine, sync, tmp_path / "b" / "out")
    check_restored(w, tmp_path / "b" / "out", rs.restore(), e)


def test_local_damaged_object_falls_back_to_the_unit_before(make_engine, tmp_path):
    sync = {"target": str(tmp_path / "remote")}
    w = machine_a(make_engine, sync, tmp_path / "a" / "out")
    opt = tmp_path / "remote" / "checkpoint-20" / "optimizer.pt"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    opt.write_bytes(bytes(data))
    e, rs = machine_b(make_engine, sync, tmp_path / "b" / "out")
    res = rs.restore()
    assert res.unit.key == "checkpoint-10"
    assert res.fallbacks == [("checkpoint-20", "optimizer.pt: sha256 differs from the manifest")]
    out_b = tmp_path / "b" / "out"
    assert sorted(p.name for p in out_b.iterdir()) == ["checkpoint-10"]
    assert {p.name: p.read_bytes() for p in (out_b / "checkpoint-10").iterdir()} == w.contents["checkpoint-10"]
    e.close()


def test_local_nothing_there_and_unreachable(make_engine, tmp_path):
    sync = {"target": str(tmp_path / "remote")}
    (tmp_path / "remote").mkdir()
    e, rs = machine_b(make_engine, sync, tmp_path / "b" / "out")
    with pytest.raises(NothingToRestore):
        rs.restore()
    shutil.rmtree(tmp_path / "remote")
    with pytest.raises(TargetError, match="missing"):
        rs.restore()
    e.close()


def modified(s3, prefix: str, unit: str) -> dict[str, object]:
    c = s3.client()
    return {k: c.head_object(Bucket=s3.bucket, Key=f"{prefix}/{k}")["LastModified"]
            for k in s3.objects(prefix) if k.startswith(unit + "/")}


def test_s3_target(make_engine, s3_server, s3_prefix, tmp_path):
    sync = s3_server.sync_config(s3_prefix)
    w = machine_a(make_engine, sync, tmp_path / "a" / "out")
    c = s3_server.client()
    for n, d in half_checkpoint_30(w).items():
        c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/checkpoint-30/{n}", Body=d)
    before = modified(s3_server, s3_prefix, "checkpoint-20")
    puts = s3_server.requests("PUT")
    e, rs = machine_b(make_engine, sync, tmp_path / "b" / "out")
    listing = {u.key: u.state for u in rs.survey().units}
    assert listing == {"checkpoint-30": "no manifest", "checkpoint-20": "complete", "checkpoint-10": "complete"}
    check_restored(w, tmp_path / "b" / "out", rs.restore(), e)
    after = modified(s3_server, s3_prefix, "checkpoint-20")
    assert after == before  # checkpoint-20's objects were not rewritten
    # nor anything else (but B's start probe): B's sync found it all on the target
    assert s3_server.requests("PUT") == puts + 1


def test_s3_damaged_object_falls_back(make_engine, s3_server, s3_prefix, tmp_path):
    # optimizer.pt over one 16 MiB range: fetched in two ranges, hashed in order as they land
    sync = s3_server.sync_config(s3_prefix)
    w = machine_a(make_engine, sync, tmp_path / "a" / "out", optimizer_bytes=20 << 20)
    key = f"{s3_prefix}/checkpoint-20/optimizer.pt"
    data = bytearray(s3_server.get(key))
    data[17 << 20] ^= 0x01  # in the second range; same size, other bytes
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(data))
    e, rs = machine_b(make_engine, sync, tmp_path / "b" / "out")
    res = rs.restore()
    assert res.unit.key == "checkpoint-10"
    assert res.fallbacks == [("checkpoint-20", "optimizer.pt: sha256 differs from the manifest")]
    assert {p.name: p.read_bytes() for p in (tmp_path / "b" / "out" / "checkpoint-10").iterdir()} == \
        w.contents["checkpoint-10"]
    e.close()


def test_rsync_target(make_engine, sshd, tmp_path, monkeypatch):
    from supervisor.resume.ahead import Ahead

    offered: list[str] = []
    real_offer = Ahead.offer
    monkeypatch.setattr(Ahead, "offer", lambda self, u, *a, **kw: offered.append(u.key) or real_offer(self, u, *a, **kw))
    remote = tmp_path / "remote"
    sync = sshd.sync_config(remote)
    w = machine_a(make_engine, sync, tmp_path / "a" / "out")
    half = remote / "checkpoint-30"
    half.mkdir()
    for n, d in half_checkpoint_30(w).items():
        (half / n).write_bytes(d)
    e, rs = machine_b(make_engine, sync, tmp_path / "b" / "out")
    check_restored(w, tmp_path / "b" / "out", rs.restore(), e)
    assert offered == []  # one rsync run per unit cannot be stopped midway: nothing fetched on a guess


def test_hub_target(make_engine, fake_hub, tmp_path):
    token = tmp_path / "hf-token"
    token.write_text(TOKEN + "\n")
    sync = hf_sync(fake_hub, token)
    w = machine_a(make_engine, sync, tmp_path / "a" / "out")
    for n, d in half_checkpoint_30(w).items():
        fake_hub.tamper("alice/run1", f"checkpoint-30/{n}", d)
    e, rs = machine_b(make_engine, sync, tmp_path / "b" / "out")
    check_restored(w, tmp_path / "b" / "out", rs.restore(), e)
    assert json.loads((tmp_path / "b" / "out" / "checkpoint-20" / "trainer_state.json").read_bytes())[
        "global_step"] == 20


def test_one_shot_restore_without_the_daemon(make_engine, tmp_path):
    import subprocess
    import sys

    from tests.fixtures.toml_writer import to_toml

    sync = {"target": str(tmp_path / "remote")}
    w = machine_a(make_engine, sync, tmp_path / "a" / "out")
    out_b = tmp_path / "b" / "out"
    out_b.mkdir(parents=True)
    (out_b / ".checkpoint-10.tsync-dead").mkdir()  # left by a restore cut short
    cfg = tmp_path / "b.toml"
    cfg.write_text(to_toml({"state_dir": str(tmp_path / "state-b"), "sync": {**sync, "watch": [str(out_b)]}}))

    def run(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "supervisor.resume", "--config", str(cfg), *a],
                              capture_output=True, text=True, timeout=60)

    listed = json.loads(run("--list").stdout)
    assert [(u["unit"], u["state"], u["step"]) for u in listed["units"]] == [
        ("checkpoint-20", "complete", 20), ("checkpoint-10", "complete", 10)]
    dry = json.loads(run("--dry-run").stdout)
    assert dry["unit"] == "checkpoint-20" and dry["dry_run"] and not (out_b / "checkpoint-20").exists()
    r = run("--checkpoint", "checkpoint-10")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == str(out_b / "checkpoint-10")
    assert sorted(p.name for p in out_b.iterdir()) == ["checkpoint-10"]  # the stale staging folder is gone
    assert {p.name: p.read_bytes() for p in (out_b / "checkpoint-10").iterdir()} == w.contents["checkpoint-10"]
    again = json.loads(run("--checkpoint", "checkpoint-10").stdout)
    assert again["already_here"]
    assert run("--checkpoint", "checkpoint-99").returncode == 1


def test_keep_last_counts_the_restored_units_with_the_new_ones(make_engine, tmp_path):
    sync = {"target": str(tmp_path / "remote"), "keep_last": 2}
    w = machine_a(make_engine, {"target": sync["target"]}, tmp_path / "a" / "out")
    out_b = tmp_path / "b" / "out"
    e, rs = machine_b(make_engine, sync, out_b)
    assert rs.restore().unit.key == "checkpoint-20"
    e.start()
    HFWriter(out_b).checkpoint(30)
    r = e.wait_idle(60)
    assert r.ok and r.uploaded_files == len(w.checkpoint_files(30)), r
    # checkpoint-10 (machine A's, never on B) was counted too: the two newest stay
    assert sorted(p.name for p in (tmp_path / "remote").iterdir()) == ["checkpoint-20", "checkpoint-30"]
