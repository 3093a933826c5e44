"""The survey holds a bounded amount in memory (issue 35, finding 5): manifests are read newest
first a round at a time and let go; only the newest complete units keep their file lists, and a
restore that falls back past them reads the next one's manifest again."""

from __future__ import annotations

import hashlib
import threading
import time

from supervisor.config import from_dict
from supervisor.resume import restore as rmod
from supervisor.resume.restore import Restorer
from supervisor.sync.manifest import ManifestFile, build
from supervisor.sync.scan import watch_roots
from supervisor.sync.targets import make_target
from supervisor.syncurl import parse_target


def unit(remote, step: int) -> dict[str, bytes]:
    files = {"adapter_model.safetensors": bytes([step]) * 1000,
             "trainer_state.json": f'{{"global_step": {step}}}'.encode()}
    d = remote / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for n, b in files.items():
        (d / n).write_bytes(b)
    mfs = [ManifestFile(n, len(b), hashlib.sha256(b).hexdigest()) for n, b in files.items()]
    (d / "_MANIFEST.json").write_bytes(build(f"checkpoint-{step}", mfs, time.time()))
    return files


def test_a_survey_keeps_few_lists_and_a_deep_fallback_reads_again(tmp_path, monkeypatch):
    remote, out = tmp_path / "remote", tmp_path / "out"
    for s in range(1, 21):
        unit(remote, s * 10)
    for s in range(14, 21):  # the seven newest: damaged (same size, other bytes)
        (remote / f"checkpoint-{s * 10}" / "adapter_model.safetensors").write_bytes(b"\xff" * 1000)
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "sync": {"target": str(remote), "watch": [str(out)]}})
    target = make_target(parse_target(cfg.sync.target), cfg.sync, cfg.state_dir)
    rs = Restorer(target, None, watch_roots(cfg.sync.watch), time.time)

    live, peak, lock = [0], [0], threading.Lock()
    real = target.read_file

    def counted(key):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            return real(key)
        finally:
            with lock:
                live[0] -= 1
    monkeypatch.setattr(target, "read_file", counted)

    sv = rs.survey()
    assert [u.step for u in sv.order][:3] == [200, 190, 180]
    assert sum(1 for u in sv.units if u.files) == rmod.KEEP_LISTS
    assert all(u.to_json()["files"] == 2 for u in sv.units)   # a summary still says how many
    assert peak[0] <= rmod.SURVEY_THREADS
    res = rs.restore()
    assert res.unit.step == 130 and len(res.fallbacks) == 7
    assert (out / "checkpoint-130" / "adapter_model.safetensors").read_bytes() == bytes([130]) * 1000


def test_a_slow_manifest_does_not_hold_back_the_folders_after_it(tmp_path, monkeypatch):
    """Issue 41: the survey's reads go on while one GET is slow: with hundreds of checkpoints on
    the target, rounds that each wait for their slowest GET made the survey cost a GET's latency
    per SURVEY_THREADS folders. Still never more than SURVEY_THREADS reads at once, and the
    folders are judged newest first."""
    remote, out = tmp_path / "remote", tmp_path / "out"
    for s in range(1, 26):
        unit(remote, s * 10)
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "sync": {"target": str(remote), "watch": [str(out)]}})
    target = make_target(parse_target(cfg.sync.target), cfg.sync, cfg.state_dir)
    rs = Restorer(target, None, watch_roots(cfg.sync.watch), time.time)
    real = target.read_file
    slow = "checkpoint-250/_MANIFEST.json"
    release = threading.Event()
    in_time: list[bool] = []
    started: set[str] = set()
    live, peak, lock = [0], [0], threading.Lock()

    def read(key):
        with lock:
            started.add(key.split("/")[0])
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            if len(started) > rmod.SURVEY_THREADS + 1:
                release.set()   # folders past the first "round" were read while the newest one hung
        try:
            if key == slow:
                in_time.append(release.wait(10))
            return real(key)
        finally:
            with lock:
                live[0] -= 1
    monkeypatch.setattr(target, "read_file", read)

    sv = rs.survey()
    assert in_time == [True], f"only {sorted(started)} were read while {slow} was slow"
    assert peak[0] <= rmod.SURVEY_THREADS
    assert [u.step for u in sv.order][:3] == [250, 240, 230] and len(sv.units) == 25
