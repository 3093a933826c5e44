"""Single checkpoint files are units of their own, resumable like folders (issue 50): a Lightning
`.ckpt`, a nanoGPT-style `out/ckpt.pt` get a manifest beside them on every kind of target
(`NAME._MANIFEST.json`); a new machine restores the newest by the step its name states (not the
second it went up), byte-identical, into its place, and its own sync then sends nothing again. A
log file gets no manifest; a manifest beside a file that lists another name is refused."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from supervisor.resume.choose import REFUSED, file_units, judge, kind_of
from supervisor.resume.restore import Restorer
from supervisor.saves.manifest_doc import ManifestFile, build
from supervisor.store import make_target
from supervisor.sync.policy import is_manifest_name, manifest_key
from tests.fixtures.hf_writer import torch_zip_bytes
from tests.store.test_sync_hf import TOKEN, hf_sync

CKPTS = "lightning_logs/version_0/checkpoints"


@pytest.fixture(autouse=True)
def _hf_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


def lightning_run(out: Path) -> dict[str, bytes]:
    """What a Lightning fit with ModelCheckpoint(save_top_k=2) and nanoGPT's loop leave: two
    step-named .ckpt (written in an order their mtimes do not tell) and an in-place ckpt.pt."""
    files = {
        f"{CKPTS}/epoch=1-step=20.ckpt": torch_zip_bytes(3000, seed=20),
        f"{CKPTS}/epoch=0-step=10.ckpt": torch_zip_bytes(3000, seed=10),
        "nano/ckpt.pt": torch_zip_bytes(2000, seed=5),
        "train.log": b"iter 10: loss 2.0\n",
    }
    for rel, data in files.items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def machine_a(make_engine, sync: dict, out: Path) -> dict[str, bytes]:
    files = lightning_run(out)
    e = make_engine({**sync, "watch": [str(out)], "include": ["**/*.ckpt", "**/*.pt", "**/*.log"]}, state="state-a")
    r = e.wait_idle(60)
    assert r.ok, r.error
    e.close()
    return files


def machine_b(make_engine, sync: dict, out: Path, state: str = "state-b"):
    e = make_engine({**sync, "watch": [str(out)], "include": ["**/*.ckpt", "**/*.pt", "**/*.log"]},
                    state=state, start=False)
    target = make_target(e.url, e.cfg, e.state_dir)
    return e, Restorer(target, e.ledger, list(e.roots), time.time, etag_is_sha=e.url.kind in ("local", "rsync"))


def check(files: dict[str, bytes], keys: set[str], make_engine, sync: dict, out_b: Path) -> None:
    for rel in (f"{CKPTS}/epoch=1-step=20.ckpt", f"{CKPTS}/epoch=0-step=10.ckpt", "nano/ckpt.pt"):
        assert manifest_key(rel, "file") in keys, sorted(keys)
    assert "train.log._MANIFEST.json" not in keys  # a log is no checkpoint: no manifest for it
    e, rs = machine_b(make_engine, sync, out_b)
    sv = rs.survey()
    by_key = {u.key: u for u in sv.units}
    assert by_key[f"{CKPTS}/epoch=1-step=20.ckpt"].step == 20
    assert by_key[f"{CKPTS}/epoch=1-step=20.ckpt"].kind == "file"
    res = rs.restore()
    assert res.unit.key == f"{CKPTS}/epoch=1-step=20.ckpt" and res.unit.step == 20
    got = out_b / CKPTS / "epoch=1-step=20.ckpt"
    assert got.read_bytes() == files[f"{CKPTS}/epoch=1-step=20.ckpt"]
    assert sorted(p.name for p in got.parent.iterdir()) == ["epoch=1-step=20.ckpt"]  # no staging left
    again = rs.restore(name="ckpt.pt")  # any unit by name, beside what is there
    assert (out_b / "nano" / "ckpt.pt").read_bytes() == files["nano/ckpt.pt"]
    assert again.unit.kind == "file" and not again.already_here
    assert rs.restore(name="ckpt.pt").already_here  # the same bytes already in place: nothing fetched
    e.start()
    r = e.wait_idle(60)
    assert r.ok and r.uploaded_files == 0, r  # what was restored is on the target already
    e.close()


def test_local_target(make_engine, tmp_path):
    sync = {"target": str(tmp_path / "remote")}
    files = machine_a(make_engine, sync, tmp_path / "a")
    remote = tmp_path / "remote"
    keys = {str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file()}
    doc = json.loads((remote / "nano" / "ckpt.pt._MANIFEST.json").read_bytes())
    assert doc["kind"] == "file" and doc["complete"] is True
    assert [f["path"] for f in doc["files"]] == ["ckpt.pt"]
    check(files, keys, make_engine, sync, tmp_path / "b")


def test_s3_target(make_engine, s3_server, s3_prefix, tmp_path):
    sync = s3_server.sync_config(s3_prefix)
    files = machine_a(make_engine, sync, tmp_path / "a")
    check(files, set(s3_server.objects(s3_prefix)), make_engine, sync, tmp_path / "b")


def test_rsync_target(make_engine, sshd, tmp_path):
    remote = tmp_path / "remote"
    sync = sshd.sync_config(remote)
    files = machine_a(make_engine, sync, tmp_path / "a")
    keys = {str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file()}
    check(files, keys, make_engine, sync, tmp_path / "b")


def test_hub_target(make_engine, fake_hub, tmp_path):
    token = tmp_path / "hf-token"
    token.write_text(TOKEN + "\n")
    sync = hf_sync(fake_hub, token)
    files = machine_a(make_engine, sync, tmp_path / "a")
    _e, rs = machine_b(make_engine, sync, tmp_path / "b", state="state-list")
    keys = set(rs.survey().keys)
    check(files, keys, make_engine, sync, tmp_path / "c")


def test_a_rewritten_file_gets_a_new_manifest(make_engine, tmp_path):
    """nanoGPT rewrites ckpt.pt in place: the manifest beside it follows the new version."""
    out, remote = tmp_path / "a", tmp_path / "remote"
    sync = {"target": str(remote), "watch": [str(out)], "include": ["**/*.pt"]}
    (out / "nano").mkdir(parents=True)
    ckpt = out / "nano" / "ckpt.pt"
    ckpt.write_bytes(torch_zip_bytes(2000, seed=1))
    e = make_engine(sync, state="state-a")
    assert e.wait_idle(60).ok
    new = torch_zip_bytes(2500, seed=2)
    ckpt.write_bytes(new)
    e.request_sync()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the watcher sees the rewrite; each pass waits for it to settle
        doc = json.loads((remote / "nano" / "ckpt.pt._MANIFEST.json").read_bytes())
        if doc["files"][0]["size"] == len(new):
            break
        assert e.wait_idle(10).ok
    assert doc["files"][0]["size"] == len(new)
    assert (remote / "nano" / "ckpt.pt").read_bytes() == new


# --- pure ----------------------------------------------------------------------------------------

def test_names_and_listing():
    assert manifest_key("out/ckpt.pt", "file") == "out/ckpt.pt._MANIFEST.json"
    assert manifest_key("out/checkpoint-5") == "out/checkpoint-5/_MANIFEST.json"
    assert manifest_key("") == "_MANIFEST.json"
    assert is_manifest_name("ckpt.pt._MANIFEST.json") and is_manifest_name("_MANIFEST.json")
    assert not is_manifest_name("._MANIFEST.json") and not is_manifest_name("ckpt.pt")
    keys = {"a/ckpt.pt": 10, "a/ckpt.pt._MANIFEST.json": 5, "checkpoint-5/_MANIFEST.json": 5,
            "checkpoint-5/model.safetensors": 9, "._MANIFEST.json": 1}
    assert file_units(keys) == {"a/ckpt.pt"}
    assert kind_of("a/ckpt.pt", keys) == "file" and kind_of("checkpoint-5", keys) == "dir"


def test_a_manifest_beside_a_file_vouches_for_that_file_alone():
    other = build("x.ckpt", [ManifestFile("evil.sh", 4, "0" * 64)], 0.0, kind="file")
    u = judge("out/x.ckpt", other, {"out/x.ckpt": 4, "out/evil.sh": 4, "out/x.ckpt._MANIFEST.json": 1}, "file")
    assert u.state == REFUSED and "lists other files" in u.why
    good = build("x.ckpt", [ManifestFile("x.ckpt", 4, "0" * 64)], 0.0, kind="file")
    u = judge("out/x.ckpt", good, {"out/x.ckpt": 4, "out/x.ckpt._MANIFEST.json": 1}, "file")
    assert u.state == "complete" and u.folder == "out" and u.file_key("x.ckpt") == "out/x.ckpt"
    gone = judge("out/x.ckpt", good, {"out/x.ckpt._MANIFEST.json": 1}, "file")
    assert gone.state == "partial" and "missing" in gone.why


def test_lightning_last_ckpt_comes_with_the_newest(make_engine, tmp_path):
    """`trainer.fit(ckpt_path="last")` needs last.ckpt: it is restored beside the newest step file."""
    sync = {"target": str(tmp_path / "remote")}
    out = tmp_path / "a"
    files = lightning_run(out)
    last = torch_zip_bytes(3100, seed=30)
    (out / CKPTS / "last.ckpt").write_bytes(last)
    e = make_engine({**sync, "watch": [str(out)], "include": ["**/*.ckpt"]}, state="state-a")
    assert e.wait_idle(60).ok
    e.close()
    e, rs = machine_b(make_engine, sync, tmp_path / "b")
    res = rs.restore()
    assert res.unit.key == f"{CKPTS}/epoch=1-step=20.ckpt"  # the step its name states ranks first
    assert res.companions == [f"{CKPTS}/last.ckpt"]
    here = tmp_path / "b" / CKPTS
    assert sorted(p.name for p in here.iterdir()) == ["epoch=1-step=20.ckpt", "last.ckpt"]
    assert (here / "last.ckpt").read_bytes() == last
    assert (here / "epoch=1-step=20.ckpt").read_bytes() == files[f"{CKPTS}/epoch=1-step=20.ckpt"]
    e.start()
    r = e.wait_idle(60)
    assert r.ok and r.uploaded_files == 0, r
    e.close()


def test_lightning_last_link_is_made_again(make_engine, tmp_path):
    """save_last="link": last.ckpt is a relative link to the newest step file. The walk never
    follows it (nothing is sent twice); the file's manifest names it; a restore makes it again."""
    sync = {"target": str(tmp_path / "remote")}
    out = tmp_path / "a"
    files = lightning_run(out)
    (out / CKPTS / "last.ckpt").symlink_to("epoch=1-step=20.ckpt")
    e = make_engine({**sync, "watch": [str(out)], "include": ["**/*.ckpt"]}, state="state-a")
    assert e.wait_idle(60).ok
    e.close()
    remote = tmp_path / "remote" / CKPTS
    assert not (remote / "last.ckpt").exists()
    assert json.loads((remote / "epoch=1-step=20.ckpt._MANIFEST.json").read_bytes())["links"] == ["last.ckpt"]
    assert "links" not in json.loads((remote / "epoch=0-step=10.ckpt._MANIFEST.json").read_bytes())
    e, rs = machine_b(make_engine, sync, tmp_path / "b")
    res = rs.restore()
    here = tmp_path / "b" / CKPTS
    assert res.unit.key == f"{CKPTS}/epoch=1-step=20.ckpt" and res.companions == []
    assert (here / "last.ckpt").is_symlink() and os.readlink(here / "last.ckpt") == "epoch=1-step=20.ckpt"
    assert (here / "last.ckpt").read_bytes() == files[f"{CKPTS}/epoch=1-step=20.ckpt"]
    e.close()


def test_links_a_hostile_manifest_asks_for_are_plain_names_only():
    from supervisor.saves.manifest_doc import links_of

    assert links_of({"kind": "file", "links": ["last.ckpt", "../x", "a/b", "", 5, "/etc/passwd", "ok"]}) == \
        ("last.ckpt", "ok")
    assert links_of({"links": ["last.ckpt"]}) == ()  # a folder's manifest makes no links
    assert links_of({"kind": "file", "links": "last.ckpt"}) == ()
    assert len(links_of({"kind": "file", "links": [f"l{i}" for i in range(100)]})) == 16


def test_a_save_whose_name_states_no_step_carries_the_step_it_was_saved_at(make_engine, tmp_path):
    """nanoGPT's ckpt.pt and Lightning's last.ckpt name no step: the manifest carries the training's
    step at the file's mtime as the progress wing read it (`step_seen`); a step-named file does not."""
    sync = {"target": str(tmp_path / "remote")}
    out = tmp_path / "a"
    lightning_run(out)
    asked: list[float] = []
    e = make_engine({**sync, "watch": [str(out)], "include": ["**/*.ckpt", "**/*.pt"]}, state="state-a", start=False)
    e.step_at = lambda t: asked.append(t) or 70
    e.start()
    assert e.wait_idle(60).ok
    e.close()
    remote = tmp_path / "remote"
    assert json.loads((remote / "nano" / "ckpt.pt._MANIFEST.json").read_bytes())["step_seen"] == 70
    assert "step_seen" not in json.loads((remote / CKPTS / "epoch=1-step=20.ckpt._MANIFEST.json").read_bytes())
    assert asked and all(abs(t - (out / "nano" / "ckpt.pt").stat().st_mtime) < 1 for t in asked)
    _e, rs = machine_b(make_engine, sync, tmp_path / "b")
    assert {u.key: u.step for u in rs.survey().units}["nano/ckpt.pt"] == 70



@pytest.mark.parametrize("follow", [False, True])
def test_the_target_follows_the_trainers_rotation_only_when_asked(make_engine, tmp_path, follow):
    """Lightning's top-k deletes epoch=0-step=10.ckpt here once epoch=2-step=30.ckpt is saved: with
    sync.follow_deletions it goes from the target too, once the newer one is verified there;
    last.ckpt (rewritten, never ranked) and a folder beside them stay; without it, nothing goes."""
    sync = {"target": str(tmp_path / "remote"), "follow_deletions": follow}
    out = tmp_path / "a"
    lightning_run(out)
    (out / CKPTS / "last.ckpt").write_bytes(torch_zip_bytes(100, 9))
    e = make_engine({**sync, "watch": [str(out)], "include": ["**/*.ckpt", "**/*.pt"]}, state="state-a")
    assert e.wait_idle(60).ok
    remote = tmp_path / "remote" / CKPTS
    (out / CKPTS / "epoch=0-step=10.ckpt").unlink()       # the rotation
    (out / CKPTS / "epoch=2-step=30.ckpt").write_bytes(torch_zip_bytes(3000, seed=30))
    (out / CKPTS / "last.ckpt").write_bytes(torch_zip_bytes(100, 10))
    e.request_sync()
    deadline = time.monotonic() + 30
    while not (remote / "epoch=2-step=30.ckpt._MANIFEST.json").exists() and time.monotonic() < deadline:
        e.wait_idle(5)
    assert e.wait_idle(30).ok
    assert (remote / "epoch=2-step=30.ckpt._MANIFEST.json").exists()
    gone = not (remote / "epoch=0-step=10.ckpt").exists() and not (remote / "epoch=0-step=10.ckpt._MANIFEST.json").exists()
    assert gone is follow
    assert (remote / "epoch=1-step=20.ckpt").exists() and (remote / "last.ckpt").exists()
    assert (tmp_path / "remote" / "nano" / "ckpt.pt").exists()
    e.close()


def test_follow_rules():
    from supervisor.sync.follow import Done, to_follow

    others = [("c/epoch=0-step=10.ckpt", "file"), ("c/epoch=1-step=20.ckpt", "file"), ("c/last.ckpt", "file"),
              ("c/epoch=9-step=90.ckpt", "file"), ("c/x.pt", "file"), ("d/epoch=0-step=5.ckpt", "file"),
              ("c/checkpoint_3", "dir")]
    gone = {"c/epoch=0-step=10.ckpt", "c/last.ckpt", "c/epoch=9-step=90.ckpt", "c/x.pt", "d/epoch=0-step=5.ckpt",
            "c/checkpoint_3"}
    got = to_follow(Done("c/epoch=2-step=30.ckpt", "file"), others, lambda k, kind: k in gone)
    assert got == ["c/epoch=0-step=10.ckpt"]  # not newer ones, not last.ckpt, not other suffixes or folders
    assert to_follow(Done("c/last.ckpt", "file"), others, lambda k, kind: True) == []
    acc = [("ck/checkpoint_0", "dir"), ("ck/checkpoint_1", "dir"), ("ck/checkpoint_2", "dir")]
    assert to_follow(Done("ck/checkpoint_3", "dir"), acc, lambda k, kind: k != "ck/checkpoint_2") == \
        ["ck/checkpoint_0", "ck/checkpoint_1"]


def test_follow_deletions_of_accelerate_folders(make_engine, tmp_path):
    """Accelerate's total_limit deletes checkpoint_0/ when checkpoint_2/ is saved: it goes from the
    target once checkpoint_2/ is complete there; an unmounted folder (the parent gone) deletes nothing."""
    from tests.fixtures.hf_writer import safetensors_bytes

    def save(i: int) -> None:
        d = out / "checkpoints" / f"checkpoint_{i}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(safetensors_bytes({"w": 256}, i))
        (d / "random_states_0.pkl").write_bytes(torch_zip_bytes(64, i))

    out, remote = tmp_path / "a", tmp_path / "remote"
    save(0)
    save(1)
    e = make_engine({"target": str(remote), "watch": [str(out)], "follow_deletions": True, "world_size": 1},
                    state="state-a")
    assert e.wait_idle(60).ok
    assert (remote / "checkpoints" / "checkpoint_0" / "_MANIFEST.json").exists()
    import shutil
    shutil.rmtree(out / "checkpoints" / "checkpoint_0")
    save(2)
    e.request_sync()
    deadline = time.monotonic() + 30
    while not (remote / "checkpoints" / "checkpoint_2" / "_MANIFEST.json").exists() and time.monotonic() < deadline:
        e.wait_idle(5)
    assert e.wait_idle(30).ok
    assert not (remote / "checkpoints" / "checkpoint_0").exists()
    assert (remote / "checkpoints" / "checkpoint_1" / "_MANIFEST.json").exists()
    e.close()
