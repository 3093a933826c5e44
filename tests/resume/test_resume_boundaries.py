"""The restore as root into the training user's folder, with a real second uid (useradd).

On a rented box the daemon is root and the output folder is the training user's. The restore must
leave what it made to that user (the Trainer, running as them, deletes old checkpoints and saves new
ones beside the restored one) and must not follow what the user put in its way: a link where the
output folder should be, a FIFO or a link inside a checkpoint folder that is already there."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from supervisor.resume.local import newest_local
from supervisor.resume.restore import Restorer
from supervisor.store import make_target
from supervisor.training.safeopen import UnsafeLog
from tests.daemon.test_security import member, open_dir  # noqa: F401 - fixtures
from tests.fixtures.hf_writer import HFWriter


def _machine_a(make_engine, remote: Path, out: Path) -> HFWriter:
    w = HFWriter(out)
    w.checkpoint(10)
    w.checkpoint(20)
    e = make_engine({"target": str(remote), "watch": [str(out)]}, state="state-a")
    r = e.wait_idle(60)
    assert r.ok, r.error
    e.close()
    return w


def _restorer(make_engine, remote: Path, out: Path, user: str) -> Restorer:
    e = make_engine({"target": str(remote), "watch": [str(out)]}, state="state-b", start=False)
    return Restorer(make_target(e.url, e.cfg, e.state_dir), e.ledger, list(e.roots), time.time,
                    etag_is_sha=True, user=user)


def _owned(p: Path) -> set[tuple[int, int]]:
    return {(q.stat(follow_symlinks=False).st_uid, q.stat(follow_symlinks=False).st_gid) for q in [p, *p.rglob("*")]}


def test_a_restore_on_a_fresh_machine_leaves_the_output_folder_to_the_training_user(
        make_engine, tmp_path, member, open_dir):  # noqa: F811 - fixtures from test_security
    w = _machine_a(make_engine, tmp_path / "remote", tmp_path / "a" / "out")
    ws = open_dir / "ws"                     # the user's /workspace; out/ is not there yet
    ws.mkdir()
    os.chown(ws, member.uid, member.gid)
    out = ws / "out"
    res = _restorer(make_engine, tmp_path / "remote", out, member.name).restore()
    cp = out / "checkpoint-20"
    assert res.unit.key == "checkpoint-20"
    assert {p.name: p.read_bytes() for p in cp.iterdir()} == w.contents["checkpoint-20"]
    assert _owned(out) == {(member.uid, member.gid)}   # the folder made, the unit and every file in it
    assert oct(cp.stat().st_mode & 0o777) == "0o755"

    def trainer_saves_and_rotates() -> int:  # as the user: a new checkpoint beside it, the old one deleted
        (out / "checkpoint-30").mkdir()
        (out / "checkpoint-30" / "trainer_state.json").write_text('{"global_step": 30}')
        shutil.rmtree(cp)
        return 0
    r = member.call(trainer_saves_and_rotates)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-30"]


def test_a_link_in_place_of_the_output_folder_is_not_followed(
        make_engine, tmp_path, member, open_dir):  # noqa: F811 - fixtures from test_security
    _machine_a(make_engine, tmp_path / "remote", tmp_path / "a" / "out")
    vault = open_dir / "rootonly"
    vault.mkdir(mode=0o700)
    ws = open_dir / "ws"
    ws.mkdir()
    os.chown(ws, member.uid, member.gid)
    r = member.call(lambda: os.symlink(vault, ws / "out") or 0)
    assert r.returncode == 0, r.stderr
    with pytest.raises(UnsafeLog, match="'out' is a symlink in a folder others than root can write"):
        _restorer(make_engine, tmp_path / "remote", ws / "out", member.name).restore()
    assert list(vault.iterdir()) == []


def test_what_the_user_left_in_the_checkpoint_folder_is_read_without_following_or_blocking(
        make_engine, tmp_path, member, open_dir):  # noqa: F811 - fixtures from test_security
    w = _machine_a(make_engine, tmp_path / "remote", tmp_path / "a" / "out")
    vault = open_dir / "rootonly"
    vault.mkdir(mode=0o700)
    secret = vault / "shadow"
    secret.write_bytes(w.contents["checkpoint-20"]["optimizer.pt"])  # the very bytes the manifest wants
    ws = open_dir / "ws"
    ws.mkdir()
    os.chown(ws, member.uid, member.gid)
    out = ws / "out"

    def plant() -> int:  # checkpoint-20 as the user leaves it: a FIFO and a link to root's file
        cp = out / "checkpoint-20"
        cp.mkdir(parents=True)
        for name, data in w.contents["checkpoint-20"].items():
            if name not in ("trainer_state.json", "optimizer.pt"):
                (cp / name).write_bytes(data)
        os.mkfifo(cp / "trainer_state.json")
        os.symlink(secret, cp / "optimizer.pt")
        return 0
    r = member.call(plant)
    assert r.returncode == 0, r.stderr
    t = time.monotonic()
    assert newest_local([str(out)]) is None     # a FIFO is no Trainer's completion marker (nor is it opened)
    res = _restorer(make_engine, tmp_path / "remote", out, member.name).restore()
    assert time.monotonic() - t < 30
    assert not res.already_here                 # the link did not count as the file it points to
    cp = out / "checkpoint-20"
    assert {p.name: p.read_bytes() for p in cp.iterdir()} == w.contents["checkpoint-20"]
    aside = [p for p in out.iterdir() if ".resume-aside-" in p.name]
    assert len(aside) == 1 and (aside[0] / "optimizer.pt").is_symlink()   # what was there is kept, set aside
    assert secret.stat().st_uid == 0 and oct(vault.stat().st_mode & 0o777) == "0o700"
