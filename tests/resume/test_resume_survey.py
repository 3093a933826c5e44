"""The survey holds a bounded amount in memory (issue 35, finding 5): manifests are read newest
first a round at a time and let go; only the newest complete units keep their file lists, and a
restore that falls back past them reads the next one's manifest again."""

from __future__ import annotations

import hashlib
import threading
import time

from supervisor.config import from_dict
from supervisor.config.target import parse_target
from supervisor.resume import restore as rmod
from supervisor.resume.restore import Restorer
from supervisor.store import make_target
from supervisor.sync.manifest import ManifestFile, build
from supervisor.sync.scan import watch_roots


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


def test_the_survey_ranks_from_the_manifests_and_reads_no_trainer_state(make_engine, hf_writer, tmp_path,
                                                                         monkeypatch):
    """Issue 41: each checkpoint's manifest carries its trainer_state.json's global_step (read back
    as it went up), so a restore's survey reads one object per unit, not two (a long run's
    trainer_state.json holds its whole log history: megabytes per checkpoint). A manifest written
    before that (no step in it) still gets its trainer_state.json read."""
    import json

    from supervisor.sync.policy import MANIFEST_NAME

    remote, out = tmp_path / "remote", tmp_path / "restored"
    for s in (10, 20, 30):
        hf_writer.checkpoint(s)
    hf_writer.age(60)
    e = make_engine({"target": str(remote), "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    for s in (10, 20, 30):
        assert json.loads((remote / f"checkpoint-{s}" / MANIFEST_NAME).read_bytes())["trainer_state"] == \
            {"global_step": s}
    # a unit named 40 whose trainer says step 5 (renamed by hand): ranked by the manifest's step
    (remote / "checkpoint-30").rename(remote / "checkpoint-40")
    doc = json.loads((remote / "checkpoint-40" / MANIFEST_NAME).read_bytes())
    doc["trainer_state"] = {"global_step": 5, "max_steps": 100}
    (remote / "checkpoint-40" / MANIFEST_NAME).write_text(json.dumps(doc))
    cfg = from_dict({"state_dir": str(tmp_path / "state2"), "sync": {"target": str(remote), "watch": [str(out)]}})
    target = make_target(parse_target(cfg.sync.target), cfg.sync, cfg.state_dir)
    rs = Restorer(target, None, watch_roots(cfg.sync.watch), time.time)
    read: list[str] = []
    real = target.read_file
    monkeypatch.setattr(target, "read_file", lambda key: read.append(key) or real(key))

    sv = rs.survey()
    assert [(u.key, u.step, u.max_steps) for u in sv.order] == [
        ("checkpoint-20", 20, None), ("checkpoint-10", 10, None), ("checkpoint-40", 5, 100)]
    assert sorted(read) == [f"checkpoint-{s}/{MANIFEST_NAME}" for s in (10, 20, 40)]

    older = json.loads((remote / "checkpoint-20" / MANIFEST_NAME).read_bytes())
    del older["trainer_state"]  # as a manifest written before the step was in it
    (remote / "checkpoint-20" / MANIFEST_NAME).write_text(json.dumps(older))
    ts = remote / "checkpoint-20" / "trainer_state.json"
    ts.write_bytes(ts.read_bytes().replace(b'"global_step": 20', b'"global_step": 21'))  # same size
    read.clear()
    sv = rs.survey()
    assert [(u.key, u.step) for u in sv.order][0] == ("checkpoint-20", 21)
    assert "checkpoint-20/trainer_state.json" in read and "checkpoint-10/trainer_state.json" not in read


def test_a_trainer_state_changed_since_it_went_up_is_not_described(tmp_path):
    """The step in a manifest is from the very bytes the manifest lists: a trainer_state.json that
    is not the version uploaded (another sha256, or grown) gives no step, and the survey reads
    the file on the target instead."""
    from supervisor.sync.scan import Selected, Unit
    from supervisor.sync.upload import sent_trainer_facts

    f = tmp_path / "trainer_state.json"
    data = b'{"global_step": 70, "max_steps": 700}'
    f.write_bytes(data)
    st = f.stat()
    sel = Selected(str(f), "checkpoint-70/trainer_state.json", "trainer_state.json", len(data), st.st_mtime_ns,
                   "checkpoint-70/trainer_state.json", st.st_ino)
    u = Unit(watch_roots([str(tmp_path)])[0], "dir", "checkpoint-70", "checkpoint-70", selected=[sel])
    good = ManifestFile("trainer_state.json", len(data), hashlib.sha256(data).hexdigest())
    assert sent_trainer_facts(u, [good]) == (70, 700)
    assert sent_trainer_facts(u, [ManifestFile("trainer_state.json", len(data), "0" * 64)]) is None
    f.write_bytes(b'{"global_step": 71, "max_steps": 700}')  # same size, rewritten since the scan
    assert sent_trainer_facts(u, [good]) is None
    assert sent_trainer_facts(u, []) is None
