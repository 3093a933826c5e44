"""The gate before a training start (supervisor.resume.gate) in this process, on a local target:
unreachable at start -> no silent fresh start: "wait" retries with backoff, shows the wait in status
and alerts, then restores and starts once the target is back; "start_fresh" alerts and starts.
Also the status lines and the mail's words."""

from __future__ import annotations

import threading
import time

from supervisor.cli.render import resume_lines
from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.notify.alerts import Alerts
from supervisor.notify.mails.resume import Resumed, resumed, resumed_line
from supervisor.resume.gate import ENV, GateConfig, ResumeGate
from supervisor.sync.engine import engine_for
from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.sync_engine import ListMailer
from tests.waiting import wait_until


def gate_for(tmp_path, remote, out, if_unreachable: str):
    cfg = from_dict({"state_dir": str(tmp_path / "state-b"), "hostname": "box-b", "alerts": {"first_delay": "0"},
                     "sync": {"target": str(remote), "watch": [str(out)], "quiet_period": "0.3s"},
                     "resume": {"from_target": True, "if_unreachable": if_unreachable}})
    clock = SystemClock()
    mailer = ListMailer()
    alerts = Alerts(cfg.alerts, clock, cfg.state_dir, mailer, hostname="box-b")
    engine = engine_for(cfg, clock, alerts)
    return ResumeGate(GateConfig.of(cfg), clock, alerts, engine, retry_base_s=0.3), engine, alerts, mailer


def test_unreachable_waits_with_backoff_then_restores_and_starts(tmp_path):
    remote, out = tmp_path / "remote", tmp_path / "out"
    w = HFWriter(tmp_path / "a-out")
    w.checkpoint(20)
    gate, engine, alerts, mailer = gate_for(tmp_path, remote, out, "wait")
    started = threading.Event()
    envs: list[dict] = []
    try:
        res = gate.gate(lambda: (envs.append(gate.env()), started.set(), {})[2])
        assert res["resuming"]
        st = wait_until(lambda: (s := gate.status())["state"] == "waiting" and s, 10, what="waiting")
        assert "missing" in st["error"] and st["next_try_in_s"] >= 0
        assert any("WAITING for the target" in ln for ln in resume_lines({"resume": st}))
        assert any(a["kind"] == "resume_unreachable" for a in alerts.active())
        assert not started.is_set()  # no silent fresh start
        # the target comes back, holding machine A's upload (copied as the local target lays it out)
        # (A fills a folder beside it, which then appears whole: an empty target that answers
        # would be a fresh start, rightly)
        staging = tmp_path / "staging"
        a = engine_for(from_dict({"state_dir": str(tmp_path / "state-a"), "sync": {
            "target": str(staging), "watch": [str(w.out)], "quiet_period": "0.3s"}}), SystemClock())
        a.start()
        assert a.wait_idle(30).ok
        a.close()
        staging.rename(remote)
        assert started.wait(20), gate.status()
        assert envs == [{ENV: str(out / "checkpoint-20")}]
        st = gate.status()
        assert st["state"] == "done" and st["result"]["unit"] == "checkpoint-20"
        assert not any(a["kind"] == "resume_unreachable" for a in alerts.active())
        assert alerts.flush(10)
        assert any("resumed on box-b from checkpoint-20 (step 20)" in s for s in mailer.subjects())
    finally:
        gate.close()
        engine.close()


def test_start_fresh_alerts_and_starts_at_once(tmp_path):
    gate, engine, alerts, mailer = gate_for(tmp_path, tmp_path / "nowhere", tmp_path / "out", "start_fresh")
    started = threading.Event()
    try:
        gate.gate(lambda: (started.set(), {})[1])
        assert started.wait(10)
        assert gate.status()["state"] == "fresh"
        assert alerts.flush(10)
        assert any("cannot fetch the checkpoint to resume from" in s for s in mailer.subjects())
    finally:
        gate.close()
        engine.close()


def test_a_local_checkpoint_means_no_restore(tmp_path):
    out = tmp_path / "out"
    HFWriter(out).checkpoint(5)
    gate, engine, _, _ = gate_for(tmp_path, tmp_path / "nowhere", out, "wait")
    try:
        assert gate.gate(lambda: {"state": "STARTING"}) == {"state": "STARTING"}
        assert gate.env() == {ENV: str(out / "checkpoint-5")}
    finally:
        engine.close()


def test_the_mail_says_where_from_and_what_was_lost():
    saved = time.mktime((2026, 12, 3, 14, 2, 0, 0, 0, -1))
    r = Resumed("box-b", "checkpoint-1200", 1200, 5000, saved, "box-a", saved + 11 * 60 + 20, "/out/checkpoint-1200",
                3 << 30, 42.0, skipped=(("checkpoint-1300", "no _MANIFEST.json: a partial upload"),))
    assert resumed_line(r) == ("resumed on box-b from checkpoint-1200 (step 1200 of 5000), saved 14:02 on box-a; "
                               "lost since that save: ~11 min of training")
    m = resumed(r)
    assert m.subject.startswith("box-b: resumed on box-b from checkpoint-1200")
    assert "checkpoint-1300: no _MANIFEST.json" in m.body and "TRAIN_SUPERVISOR_RESUME_FROM=/out/checkpoint-1200" \
        in m.body


def test_status_shows_the_restores_progress():
    st = {"resume": {"enabled": True, "state": "restoring",
                     "progress": {"unit": "checkpoint-20", "bytes_done": 3 << 20, "bytes_total": 10 << 20,
                                  "rate_bps": 1 << 20, "eta_s": 7.0}}}
    (line,) = resume_lines(st)
    assert line.startswith("resume    restoring checkpoint-20: 3.0 of 10.0 MiB at 1.0 MiB/s, ETA ")
    assert resume_lines({"resume": {"enabled": False, "state": "idle"}}) == []




def test_a_running_training_is_never_restored_under(tmp_path):
    gate, engine, _, _ = gate_for(tmp_path, tmp_path / "nowhere", tmp_path / "out", "wait")
    gate.busy = lambda: True
    try:
        assert gate.gate(lambda: {"state": "refused by start()"}) == {"state": "refused by start()"}
        assert gate.status()["state"] == "idle"
    finally:
        engine.close()


def test_from_target_needs_a_target_and_watched_folders():
    import pytest

    from supervisor.config import ConfigError

    with pytest.raises(ConfigError) as e:
        from_dict({"resume": {"from_target": True}})
    assert any(p.startswith("resume.from_target: needs sync.target and sync.watch") for p in e.value.problems)
    with pytest.raises(ConfigError):
        from_dict({"resume": {"if_unreachable": "retry"}})


def test_every_complete_unit_damaged_is_no_quiet_fresh_start(tmp_path):
    remote, out = tmp_path / "remote", tmp_path / "out"
    w = HFWriter(tmp_path / "a-out")
    w.checkpoint(20)
    a = engine_for(from_dict({"state_dir": str(tmp_path / "state-a"), "sync": {
        "target": str(remote), "watch": [str(w.out)], "quiet_period": "0.3s"}}), SystemClock())
    a.start()
    assert a.wait_idle(30).ok
    a.close()
    opt = remote / "checkpoint-20" / "optimizer.pt"
    data = bytearray(opt.read_bytes())
    data[100] ^= 0xFF
    opt.write_bytes(bytes(data))
    gate, engine, alerts, mailer = gate_for(tmp_path, remote, out, "wait")
    started = threading.Event()
    try:
        gate.gate(lambda: (started.set(), {})[1])
        st = wait_until(lambda: (s := gate.status())["state"] == "failed" and s, 10, what="failed")
        assert "optimizer.pt: sha256 differs" in st["error"] and not started.is_set()
        assert alerts.flush(10)
        assert any("every complete checkpoint" in s for s in mailer.subjects())
        assert not (out / "checkpoint-20").exists()
    finally:
        gate.close()
        engine.close()


def test_prometheus_shows_the_wait_and_the_restores_progress():
    from supervisor.fleet.metrics import exposition as render

    text = render({"resume": {"enabled": True, "state": "restoring",
                              "progress": {"bytes_done": 5, "bytes_total": 9}}})
    assert "train_supervisor_resume_waiting 0" in text
    assert "train_supervisor_resume_restored_bytes 5" in text and "train_supervisor_resume_restore_total_bytes 9" in text
    assert "train_supervisor_resume_waiting 1" in render({"resume": {"enabled": True, "state": "waiting"}})
