"""Issue 41: the newest complete unit's download begins while the survey still reads the older
manifests (resume/ahead.py), and nothing of a guess that is not the restore's choice is placed,
kept or recorded, whether the guess is stopped mid-download or after its files were checked."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest

from supervisor.config import from_dict
from supervisor.config.target import parse_target
from supervisor.resume import ahead as ahead_mod
from supervisor.resume.restore import Restorer
from supervisor.store import make_target, target_identity
from supervisor.sync.ledger import Ledger
from supervisor.sync.manifest import ManifestFile, build
from supervisor.sync.scan import watch_roots

WAIT = 10.0


def unit(remote, folder_step: int, global_step: int | None = None) -> dict[str, bytes]:
    step = folder_step if global_step is None else global_step
    files = {"adapter_model.safetensors": bytes([folder_step % 256]) * 4000,
             "trainer_state.json": f'{{"global_step": {step}}}'.encode()}
    d = remote / f"checkpoint-{folder_step}"
    d.mkdir(parents=True)
    for n, b in files.items():
        (d / n).write_bytes(b)
    mfs = [ManifestFile(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in files.items()]
    (d / "_MANIFEST.json").write_bytes(build(f"checkpoint-{folder_step}", mfs, time.time()))
    return files


def setup(tmp_path, steps, ledger: bool = False):
    remote, out = tmp_path / "remote", tmp_path / "out"
    for s in steps:
        unit(remote, *s) if isinstance(s, tuple) else unit(remote, s)
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "sync": {"target": str(remote), "watch": [str(out)]}})
    url = parse_target(cfg.sync.target)
    target = make_target(url, cfg.sync, cfg.state_dir)
    led = Ledger(cfg.state_dir, target_identity(url, cfg.sync)) if ledger else None
    return target, led, Restorer(target, led, watch_roots(cfg.sync.watch), time.time), out


def leftovers(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


def test_the_newest_downloads_from_the_listing_before_any_manifest_is_read(tmp_path, monkeypatch):
    target, _, rs, out = setup(tmp_path, [s * 10 for s in range(1, 26)])
    began = threading.Event()
    in_time: list[bool] = []
    real_read, real_download = target.read_file, target.download

    def read(key):
        if key == "checkpoint-250/_MANIFEST.json":  # its own manifest: held until its bytes are coming
            in_time.append(began.wait(WAIT))
        return real_read(key)

    def download(unit_key, files, into, progress):
        if unit_key == "checkpoint-250":
            began.set()
        return real_download(unit_key, files, into, progress)

    monkeypatch.setattr(target, "read_file", read)
    monkeypatch.setattr(target, "download", download)
    res = rs.restore()
    assert in_time == [True], "the newest unit's download waited for its manifest"
    assert res.unit.key == "checkpoint-250" and not res.fallbacks
    assert (out / "checkpoint-250" / "adapter_model.safetensors").read_bytes() == bytes([250]) * 4000
    assert leftovers(out) == []


def partial(remote, step: int) -> None:
    """checkpoint-N uploaded, its manifest saying it is not complete (a save cut short)."""
    p = remote / f"checkpoint-{step}" / "_MANIFEST.json"
    doc = json.loads(p.read_bytes())
    doc["complete"] = False
    p.write_text(json.dumps(doc))


def stray(remote, step: int) -> None:
    """An object in the folder that its manifest does not list (an earlier upload's leftover)."""
    (remote / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"left from another save")


@pytest.mark.parametrize("spoil", [partial, stray])
def test_a_listed_unit_its_manifest_does_not_vouch_for_is_dropped(tmp_path, monkeypatch, spoil):
    """The download begun from the listing goes on only if the manifest calls the unit complete
    and lists exactly the files being fetched; otherwise it is dropped and the first complete unit
    judged after it downloads ahead instead."""
    target, _, rs, out = setup(tmp_path, [s * 10 for s in range(1, 26)])
    spoil(tmp_path / "remote", 250)
    started: list[str] = []
    real_download = target.download

    def download(unit_key, files, into, progress):
        started.append(unit_key)
        return real_download(unit_key, files, into, progress)

    monkeypatch.setattr(target, "download", download)
    res = rs.restore()
    if spoil is partial:
        assert res.unit.key == "checkpoint-240"
        assert started == ["checkpoint-250", "checkpoint-240"]
        assert not (out / "checkpoint-250").exists()
    else:  # complete, but the listing showed one more file: fetched again as its manifest lists it
        assert res.unit.key == "checkpoint-250" and not (out / "checkpoint-250" / "optimizer.pt").exists()
        assert started == ["checkpoint-250", "checkpoint-250"]
    assert (out / res.unit.name / "adapter_model.safetensors").read_bytes() == bytes([res.unit.step]) * 4000
    assert leftovers(out) == []


@pytest.mark.parametrize("when", ["mid-download", "after-check"])
def test_a_guess_that_is_not_the_choice_leaves_nothing(tmp_path, monkeypatch, when):
    """checkpoint-300 is the newest by its folder's name, so it is downloaded ahead; its
    trainer_state.json says global_step 5, so the choice is checkpoint-290. Stopped while its
    bytes arrive, or after they matched its manifest: it is never placed nor recorded."""
    target, led, rs, out = setup(tmp_path, [(300, 5)] + [s * 10 for s in range(20, 30)], ledger=True)
    assert led is not None
    real_read, real_download = target.read_file, target.download
    dropping, guessed_done = threading.Event(), threading.Event()
    real_drop = ahead_mod.Ahead.drop

    def drop(self):
        dropping.set()
        real_drop(self)

    def read(key):
        if when == "after-check" and key == "checkpoint-200/_MANIFEST.json":  # the survey's last read
            assert guessed_done.wait(WAIT)
        return real_read(key)

    def download(unit_key, files, into, progress):
        if unit_key != "checkpoint-300":
            return real_download(unit_key, files, into, progress)
        if when == "mid-download":
            assert dropping.wait(WAIT)  # the survey has chosen meanwhile
        try:
            return real_download(unit_key, files, into, progress)
        finally:
            guessed_done.set()

    monkeypatch.setattr(ahead_mod.Ahead, "drop", drop)
    monkeypatch.setattr(target, "read_file", read)
    monkeypatch.setattr(target, "download", download)
    try:
        res = rs.restore()
        assert led.get("checkpoint-300/adapter_model.safetensors") is None
        assert led.get("checkpoint-290/adapter_model.safetensors") is not None
    finally:
        led.close()
    assert res.unit.key == "checkpoint-290" and res.unit.step == 290
    assert guessed_done.is_set()
    assert (out / "checkpoint-290" / "adapter_model.safetensors").read_bytes() == bytes([290 % 256]) * 4000
    assert not (out / "checkpoint-300").exists()
    assert leftovers(out) == []


def test_a_restore_stopped_during_the_survey_stops_its_guess(tmp_path, monkeypatch):
    """The target fails after the newest unit's download began: the restore raises as before, and
    the download begun ahead is stopped and its staging folder removed before restore() returns."""
    from supervisor.store.base import TargetError

    target, _, rs, out = setup(tmp_path, [s * 10 for s in range(1, 21)])
    real_read, real_download = target.read_file, target.download
    began = threading.Event()

    def read(key):
        if key == "checkpoint-10/_MANIFEST.json":
            assert began.wait(WAIT)
            raise TargetError("the network went")
        return real_read(key)

    def download(unit_key, files, into, progress):
        began.set()
        return real_download(unit_key, files, into, progress)

    monkeypatch.setattr(target, "read_file", read)
    monkeypatch.setattr(target, "download", download)
    with pytest.raises(TargetError, match="the network went"):
        rs.restore()
    assert [p.name for p in out.iterdir()] == []
    assert not [t for t in threading.enumerate() if t.name == "resume-ahead"]
