"""DiskWatch against a real sync engine and a local target (no mount needed): what a prune keeps
and why -- files the target does not hold, the Trainer's best checkpoint named by a relative path,
a file open in a folder, no target at all."""

from __future__ import annotations

import json
import os

import pytest

from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.disk.watch import DiskWatch
from supervisor.notify.alerts import Alerts
from supervisor.statefile import StateStore
from supervisor.sync.engine import engine_for
from tests.fixtures.context import ConfiguredContext
from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.nvml import make_ctx
from tests.fixtures.sync_engine import engine_config


@pytest.fixture
def setup(tmp_path):
    made = []

    def make(sync: dict | None = None, steps=(1, 2, 3, 4), **disk):
        out, target = tmp_path / "out", tmp_path / "target"
        target.mkdir(exist_ok=True)
        w = HFWriter(out)
        for s in steps:
            w.checkpoint(s)
        sync = {"target": str(target), "watch": [str(out)], "quiet_period": "0.1s", **(sync or {})}
        cfg = from_dict(engine_config(tmp_path, sync, disk={"keep_local": 1, **disk}))
        clock = SystemClock()
        alerts = Alerts(cfg.alerts, clock, cfg.state_dir, None)
        e = engine_for(cfg, clock, alerts)
        e.start()
        made.append(e)
        assert e.wait_idle(30).ok
        return w, out, DiskWatch(ConfiguredContext(clock, StateStore(cfg.state_dir), alerts, cfg), cfg.disk, e, [str(out)], quiet=0.1)

    yield make
    for e in made:
        e.close()


def test_files_the_target_does_not_hold_keep_a_folder_and_the_next_one_goes(setup, tmp_path):
    w, out, disk = setup({"exclude": ["**/notes.txt"]})
    (out / "checkpoint-1" / "notes.txt").write_text("mine, never synced")
    os.utime(out / "checkpoint-1" / "notes.txt", (0, 0))
    r = disk.prune_now()
    assert r["kept"][str(out / "checkpoint-1")] == "holds files the target does not: notes.txt"
    assert sorted(os.path.basename(p) for p in r["deleted"]) == ["checkpoint-2", "checkpoint-3"]
    # asked again, unchanged: not checked again, same answer
    r = disk.prune_now(dry_run=True)
    assert r["kept"][str(out / "checkpoint-1")] == "holds files the target does not: notes.txt"
    assert (out / "checkpoint-1" / "notes.txt").exists()


def test_best_by_relative_path_and_a_file_open_stay(setup):
    w, out, disk = setup()
    state = out / "checkpoint-4" / "trainer_state.json"
    st = json.loads(state.read_text())
    st["best_model_checkpoint"] = "out/checkpoint-2"     # relative to the training's folder, as written
    state.write_text(json.dumps(st))
    os.utime(state, (0, 0))
    with open(out / "checkpoint-3" / "optimizer.pt", "rb"):
        r = disk.prune_now()
    assert r["kept"][str(out / "checkpoint-2")] == "the Trainer's best_model_checkpoint"
    assert r["kept"][str(out / "checkpoint-3")] == "being written"
    assert r["kept"][str(out / "checkpoint-4")].startswith("among the newest 1")
    assert [os.path.basename(p) for p in r["deleted"]] == ["checkpoint-1"]


def test_no_target_nothing_is_deleted(tmp_path):
    ctx = make_ctx(tmp_path, SystemClock(), {})
    (tmp_path / "out" / "checkpoint-1").mkdir(parents=True)
    r = DiskWatch(ctx, ctx.config.disk, None, [str(tmp_path / "out")]).prune_now()
    assert not r["ok"] and "nothing is deleted" in r["error"]
    assert (tmp_path / "out" / "checkpoint-1").is_dir()


def test_probe_finds_nested_checkpoints_not_caches_nor_inside_a_dataset(tmp_path, monkeypatch):
    from supervisor.disk import probe
    from supervisor.training import finder

    for p in ("out/run1/checkpoint-5", "out/checkpoint-7", "huggingface/hub/checkpoint-1", "models--x/checkpoint-2",
              "data/checkpoint-3"):
        (tmp_path / p).mkdir(parents=True)
        (tmp_path / p / "trainer_state.json").write_text("{}")
    for i in range(30):
        (tmp_path / "data" / f"shard-{i}").mkdir()
    (tmp_path / "out" / "checkpoint-7" / "link").symlink_to("/etc")
    monkeypatch.setattr(finder, "WIDE_DIR", 20)
    found = {os.path.relpath(f.path, tmp_path): f for f in probe.checkpoints(str(tmp_path))}
    assert set(found) == {"out/run1/checkpoint-5", "out/checkpoint-7"}
    assert found["out/checkpoint-7"].has_state and found["out/checkpoint-7"].step == 7
    assert probe.files(str(tmp_path / "out" / "checkpoint-7"))["link"] == (-1, 0, 0, 0)  # never followed


def test_prune_is_roots_alone():
    from supervisor.daemon.control import Peer, refusal
    from supervisor.daemon.main import MEMBER_COMMANDS

    assert "prune" not in MEMBER_COMMANDS
    assert refusal("prune", Peer(1, 0, 0), MEMBER_COMMANDS, owner_uid=0) is None
    why = refusal("prune", Peer(1, 4321, 4321), MEMBER_COMMANDS, owner_uid=0)
    assert why is not None and "only root" in why


def test_a_parent_swapped_for_a_symlink_after_the_check_does_not_send_the_delete_elsewhere(tmp_path):
    from supervisor.disk import probe

    ctx = make_ctx(tmp_path, SystemClock(), {})
    out, decoy = tmp_path / "out", tmp_path / "decoy"
    for d in (out / "checkpoint-1", decoy / "checkpoint-1"):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 10)
    disk = DiskWatch(ctx, ctx.config.disk, None, [str(out)])
    proof = {"unit": "checkpoint-1", "files": {r: list(v) for r, v in probe.files(str(out / "checkpoint-1")).items()},
             "checked_at": 1.0}
    pfd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out.rename(tmp_path / "out-moved")        # the training user swaps the folder for a symlink
        out.symlink_to(decoy)
        assert disk._delete_at(pfd, str(out / "checkpoint-1"), "checkpoint-1", proof, 10, "hand") is None
    finally:
        os.close(pfd)
    assert (decoy / "checkpoint-1" / "model.safetensors").exists()       # untouched
    assert not (tmp_path / "out-moved" / "checkpoint-1").exists()        # the one checked is the one deleted
    # and a folder whose files are not the verified ones is refused, naming why
    (tmp_path / "out-moved" / "checkpoint-2").mkdir()
    (tmp_path / "out-moved" / "checkpoint-2" / "a").write_text("1")
    why = disk._delete(str(tmp_path / "out-moved" / "checkpoint-2"), {"files": {}}, 1, "hand")
    assert why == "holds files the target does not: a"


def test_a_file_rewritten_in_place_with_its_mtime_set_back_is_not_pruned(tmp_path):
    """Size, mtime and inode the same (the bytes rewritten in place, `touch -d` to the old mtime):
    only the ctime tells, and the proof carries it (issue 35, finding 5)."""
    from supervisor.disk import probe

    ctx = make_ctx(tmp_path, SystemClock(), {})
    ck = tmp_path / "out" / "checkpoint-1"
    ck.mkdir(parents=True)
    f = ck / "model.safetensors"
    f.write_bytes(b"x" * 10)
    proof = {"unit": "checkpoint-1", "files": {r: list(v) for r, v in probe.files(str(ck)).items()}, "checked_at": 1.0}
    st = f.stat()
    with open(f, "r+b") as fh:  # same inode, same size: new bytes the target does not hold
        fh.write(b"y" * 10)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    disk = DiskWatch(ctx, ctx.config.disk, None, [str(tmp_path / "out")])
    why = disk._delete(str(ck), proof, 10, "hand")
    assert why and "changed since the check: model.safetensors" in why
    assert f.read_bytes() == b"y" * 10
