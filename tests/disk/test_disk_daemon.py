"""The disk wing through the daemon: the status line and --json block, `supervisorctl prune
[--dry-run]` (root), and a target whose copy was damaged in place keeping its size: the content
check (the local target hashes its copy again) keeps that checkpoint here."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.fixtures.hf_writer import HFWriter


def test_prune_by_hand_deletes_only_what_the_target_verifiably_holds(tmp_path, make_daemon):
    out, target = tmp_path / "out", tmp_path / "target"
    target.mkdir()
    w = HFWriter(out)
    for step in (1, 2, 3, 4):
        w.checkpoint(step)
    d = make_daemon({"sync": {"target": str(target), "watch": [str(out)], "quiet_period": "0.3s"},
                     "disk": {"keep_local": 1}})
    r = d.req("sync", {"wait": True, "timeout_s": 30}, timeout=40)
    assert r["ok"], r
    # damage the target's copy of checkpoint-1 in place, same size: only a content check sees it
    victim = target / "checkpoint-1" / "model.safetensors"
    size = victim.stat().st_size
    victim.write_bytes(b"\0" * size)
    dry = d.ctl("prune", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would delete {out / 'checkpoint-2'}" in dry.stdout and f"would delete {out / 'checkpoint-3'}" in dry.stdout
    assert "checkpoint-1: the target lost 1 file(s)" in dry.stdout, dry.stdout
    assert f"kept    {out / 'checkpoint-4'}: among the newest 1" in dry.stdout
    assert sorted(p.name for p in out.iterdir()) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    # the dry run polled (fresh); its check found checkpoint-1 damaged there: no longer counted off the machine
    fs = d.status()["disk"]["filesystems"][0]
    assert fs["checkpoints"] == 4 and fs["verified_off"] == 3 and fs["checkpoint_bytes"] > 0
    human = d.ctl("status")
    assert f"disk      {fs['mount']} " in human.stdout and "4 checkpoints here, 3 verified off the machine" in human.stdout

    # the check made the ledger forget the damaged file: the sync sends it again, then it may go too
    r = d.req("sync", {"wait": True, "timeout_s": 30}, timeout=40)
    assert r["ok"], r
    assert victim.read_bytes() == w.contents["checkpoint-1"]["model.safetensors"]

    done = d.ctl("prune")
    assert done.returncode == 0, done.stderr
    for s in (1, 2, 3):
        assert f"deleted {out / f'checkpoint-{s}'}" in done.stdout, done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4"]
    journal = [json.loads(x) for x in (Path(d.state_dir) / "disk" / "journal.jsonl").read_text().splitlines()]
    assert [(e["event"], os.path.basename(e["path"])) for e in journal] == [
        (ev, f"checkpoint-{s}") for s in (1, 2, 3) for ev in ("delete", "deleted")]
    assert all(e["by"] == "hand" and e["target"] and e["verified_at"] <= e["at"] for e in journal)
    st = d.status()["disk"]
    assert st["deleted"] == 3 and st["recent"][-1]["event"] == "deleted"
    assert "deleted" in d.ctl("status").stdout
