"""A spot machine about to be taken: the pure decisions, then the whole path with real parts: loopback
metadata servers speaking EC2's IMDSv2, GCP's Metadata-Flavor and Azure's Scheduled Events, a real
sync engine on SeaweedFS, a real process group for the training signal, and a real daemon process
for the SIGTERM path and the next boot's mail."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from supervisor.interfaces import Holding
from supervisor.notify.alerts import Severity
from supervisor.notify.mails import preemption as words
from supervisor.spot.decide import (
    NoticeRecord,
    container_host,
    next_boot,
    outcome,
    sigterm_is_notice,
    tally,
    unit_of_cgroup,
)
from supervisor.sync.policy import MANIFEST_NAME
from tests.fixtures.daemon import make_daemon  # noqa: F401 - the fixture
from tests.fixtures.metadata import metadata_servers  # noqa: F401 - the fixture
from tests.fixtures.spot import MiB, ProcTraining, make_rig, manifest_on, notice_to_newest, write_checkpoint
from tests.waiting import wait_until

NOW = 1_800_000_000.0


# --- pure -----------------------------------------------------------------------------------------
def _h(unit, complete=True, on_target=False, mtime=NOW - 100, settling=False, reason=""):
    return Holding(unit, f"/out/{unit}", complete, on_target, mtime, 10, reason, settling)


def test_tally_names_the_newest_by_step_and_what_did_not_make_it():
    rec = NoticeRecord("ec2", "terminate", "", NOW, NOW + 120)
    hs = [_h("checkpoint-90", on_target=True), _h("checkpoint-100", mtime=NOW - 200),
          _h("checkpoint-110", complete=False, reason="waiting for trainer_state.json")]
    tally(rec, hs, NOW + 5)
    assert rec.newest == "checkpoint-100" and not rec.newest_on_target and rec.newest_off_at is None
    assert rec.made_it == ["checkpoint-90"]
    assert rec.not_made == ["checkpoint-110: not complete here (waiting for trainer_state.json)",
                            "checkpoint-100: complete here, not (wholly) on the target yet"]
    hs[1] = _h("checkpoint-100", on_target=True)
    tally(rec, hs, NOW + 9)
    assert rec.newest_on_target and rec.newest_off_at == NOW + 9


def test_outcome_waits_for_the_sync_then_says_synced_or_deadline():
    rec = NoticeRecord("gcp", "preempt", "", NOW, NOW + 30)
    done = [_h("checkpoint-1", on_target=True)]
    assert outcome(rec, done, NOW + 1) == ""               # the emergency pass has not looked yet
    assert outcome(rec, done, NOW + 4) == "synced"
    assert outcome(rec, [_h("checkpoint-2")], NOW + 4) == ""                # complete, not sent yet
    assert outcome(rec, [*done, _h("c", complete=False, settling=True)], NOW + 4) == ""  # about to complete
    assert outcome(rec, [_h("checkpoint-2")], NOW + 30) == "deadline"
    rec.signal = "SIGUSR1"  # asked to save: wait for what it saves
    assert outcome(rec, done, NOW + 4) == ""
    assert outcome(rec, [*done, _h("checkpoint-3", on_target=True, mtime=NOW + 3)], NOW + 5) == "synced"


def test_next_boot_tells_once_or_resumes_the_same_boot():
    rec = NoticeRecord("ec2", "terminate", "", NOW, NOW + 120, boot_id="b1", hostname="h")
    assert next_boot(None, "b1", "h", NOW) == ""
    assert next_boot(rec, "b2", "h", NOW + 10) == "tell"       # another machine (or a reboot)
    assert next_boot(rec, "b1", "h", NOW + 10) == "resume"     # the daemon restarted mid-notice
    assert next_boot(rec, "b1", "h", NOW + 200) == "tell"      # same boot, but the time is long up
    rec.told_next_boot = True
    assert next_boot(rec, "b2", "h", NOW + 10) == ""


def test_sigterm_is_a_notice_only_when_not_from_systemd_and_on_a_spot_host():
    assert not sigterm_is_notice("auto", False, False, "")          # a kill on a workstation
    assert sigterm_is_notice("auto", False, True, "")               # a metadata service answers
    assert sigterm_is_notice("auto", False, False, "RunPod")
    assert not sigterm_is_notice("auto", True, True, "RunPod")      # systemd stops the unit or machine
    assert sigterm_is_notice("notice", False, False, "")
    assert not sigterm_is_notice("exit", False, True, "vast.ai")
    assert container_host({"RUNPOD_POD_ID": "abc"}) == "RunPod"
    assert container_host({"VAST_CONTAINERLABEL": "C.1"}) == "vast.ai"
    assert container_host({}) == ""


def test_unit_of_cgroup():
    assert unit_of_cgroup("0::/system.slice/train-supervisor.service\n") == "train-supervisor.service"
    assert unit_of_cgroup("12:pids:/\n1:name=systemd:/system.slice/x.service/sub\n") == "x.service"
    assert unit_of_cgroup("0::/user.slice/user-0.slice/session-3.scope\n") is None
    assert unit_of_cgroup("0::/\n") is None


def test_mails_say_what_is_done_and_what_made_it():
    m = words.notice("ec2", "terminate", "spot instance-action terminate", NOW, NOW + 120, "SIGUSR1", "",
                     "checkpoint-300", False, ["checkpoint-100: complete here, not (wholly) on the target yet"],
                     "s3://b/run")
    assert m.subject.startswith("PREEMPTION: this machine will be taken at") and "(in 2m" in m.subject
    assert "sent SIGUSR1" in m.body and "checkpoint-300, goes up first" in m.body
    m = words.notice("signal", "sigterm", "", NOW, NOW + 30, "", "", "", False, [], "")
    assert "training_signal is not set" in m.body and "No sync.target" in m.body
    m = words.outcome(NOW, NOW + 120, "deadline", NOW + 120, "checkpoint-300", False, ["checkpoint-200"],
                      ["checkpoint-300: complete here, not (wholly) on the target yet"], "s3://b/run")
    assert m.subject == "PREEMPTION: newest checkpoint checkpoint-300 did NOT make it off the machine"
    m = words.previous(NOW, "gcp", "preempt", "", "box", "checkpoint-300", True, ["checkpoint-300"], [], "synced")
    assert "The previous machine was preempted at" in m.subject and m.subject.endswith("checkpoint-300 made it")


def test_status_lines_only_while_a_notice_runs_or_after_one():
    from supervisor.cli.render import preemption_lines, render_status

    assert preemption_lines({"now": NOW, "preemption": {"notice": None, "previous": None}}) == []
    rec = {"provider": "ec2", "kind": "terminate", "noticed_at": NOW - 10, "deadline": NOW + 110,
           "newest": "checkpoint-300", "newest_on_target": False, "outcome": "",
           "not_made": ["checkpoint-300: complete here, not (wholly) on the target yet"]}
    lines = preemption_lines({"now": NOW, "preemption": {"notice": rec}})
    assert "NOTICE (ec2 terminate)" in lines[0] and "newest checkpoint-300 NOT on the target yet" in lines[0]
    assert "emergency sync running" in lines[0] and "checkpoint-300: complete here" in lines[1]
    screen = render_status({"now": NOW, "training": {"state": "STOPPED"},
                            "preemption": {"previous": {**rec, "newest_on_target": True, "outcome": "synced"}}})
    assert "the previous machine was preempted at" in screen and "newest checkpoint-300 made it" in screen


# --- the whole path on real servers ------------------------------------------------------------------
def _arm(server, provider: str) -> None:
    if provider == "ec2":
        when = dt.datetime.fromtimestamp(time.time() + 120, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        server.notice = {"action": "terminate", "time": when}
    elif provider == "gcp":
        server.notice = "TRUE"
    else:
        server.notice = {"EventId": "E-1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                         "EventStatus": "Scheduled", "NotBefore": ""}


@pytest.mark.parametrize("provider", ["ec2", "gcp", "azure"])
def test_notice_alerts_uncapped_signals_the_training_and_sends_the_newest_first(
        provider, metadata_servers, s3_server, s3_prefix, tmp_path):  # noqa: F811
    staged = write_checkpoint(tmp_path / "staged", 500, 256 * 1024)      # what the training saves on SIGUSR1
    rig = make_rig(tmp_path, s3_server, s3_prefix, provider, metadata_servers[provider].url, max_per_hour=1,
                   part_size="5M")
    training = ProcTraining(tmp_path, rig.out, staged)
    rig.guard.training = training
    try:
        # the hourly cap is spent: the notice must get through anyway
        rig.alerts.event("filler", "other", Severity.WARNING, "filler", "uses the hour's one mail")
        wait_until(lambda: rig.mailer.subjects() == ["spotbox: filler"], 10, what="the filler mail")
        for step, age in ((100, 1200), (200, 600)):
            write_checkpoint(rig.out, step, 1 * MiB, age_s=age)
        write_checkpoint(rig.out, 300, 8 * MiB, age_s=60)   # the newest complete one when the notice comes
        rig.engine.request_sync()
        wait_until(lambda: rig.engine.holdings(), 10, what="a scan")
        rig.guard.poll()
        assert rig.guard.record is None, "no notice yet"
        _arm(metadata_servers[provider], provider)
        got = notice_to_newest(rig, s3_server, s3_prefix, "checkpoint-300", ["checkpoint-100", "checkpoint-200"],
                               timeout=60)
        print(f"\n{provider}: notice -> newest checkpoint complete on the target: {got['notice_to_newest_s']:.2f}s")
        wait_until(lambda: any("PREEMPTION: this machine" in s for s in rig.mailer.subjects()), 10,
                   what="the notice mail, past the hourly cap")
        assert training.flag.exists(), "the training got SIGUSR1"
        # then the rest, and what the training saved on the signal
        wait_until(lambda: rig.guard.record.outcome, 40, what="the outcome")
        rec = rig.guard.record
        assert rec.outcome == "synced" and rec.signal == "SIGUSR1" and rec.newest_at_notice == "checkpoint-300"
        assert rec.newest == "checkpoint-500" and rec.newest_on_target and rec.not_made == []
        assert set(rec.made_it) == {"checkpoint-100", "checkpoint-200", "checkpoint-300", "checkpoint-500"}
        # newest first: checkpoint-300 was whole on the target before a byte of the older ones went up
        t300 = max(s3_server.chunk_times(f"{s3_prefix}/checkpoint-300/{MANIFEST_NAME}"))
        for old in ("checkpoint-100", "checkpoint-200"):
            assert t300 <= min(s3_server.chunk_times(f"{s3_prefix}/{old}/model.safetensors")), old
        wait_until(lambda: any("newest checkpoint checkpoint-500 is off the machine" in s
                               for s in rig.mailer.subjects()), 10, what="the outcome mail")
        # the record is saved again once the mail is handed over (told): wait for that write
        wait_until(lambda: json.loads((rig.state / "preemption.json").read_text()).get("told"), 10,
                   what="the record saved as told")
        saved = json.loads((rig.state / "preemption.json").read_text())
        assert saved["provider"] == provider and saved["outcome"] == "synced" and saved["told"]
        assert rig.guard.status()["notice"]["newest"] == "checkpoint-500"
    finally:
        training.stop()
        rig.close()


def test_deadline_with_the_target_down_says_what_did_not_make_it(
        metadata_servers, s3_server, s3_prefix, tmp_path):  # noqa: F811
    from tests.fixtures.ports import free_port

    class Down:  # the same S3 config, pointed at a port where nothing listens
        bucket = s3_server.bucket

        def sync_config(self, prefix, **extra):
            return {**s3_server.sync_config(prefix, **extra), "endpoint_url": f"http://127.0.0.1:{free_port()}"}

    gcp = metadata_servers["gcp"]
    rig = make_rig(tmp_path, Down(), s3_prefix, "gcp", gcp.url, signal_name="", part_size="5M")
    try:
        write_checkpoint(rig.out, 100, 64 * 1024)
        gcp.notice = "TRUE"
        rig.guard.poll()
        assert rig.guard.active
        rec = rig.guard.record
        rec.deadline = time.time() + 4   # GCP's 30 s, shortened
        wait_until(lambda: rec.outcome, 30, what="the outcome at the deadline")
        assert rec.outcome == "deadline" and rec.made_it == []
        assert rec.not_made == ["checkpoint-100: complete here, not (wholly) on the target yet"]
        wait_until(lambda: any("checkpoint-100 did NOT make it" in s for s in rig.mailer.subjects()), 10,
                   what="the outcome mail")
    finally:
        rig.close()


# --- SIGTERM to a real daemon, and the next boot --------------------------------------------------------
TRAIN = r"""
import os, shutil, signal, sys, time
out, staged = sys.argv[1], sys.argv[2]
asked = []
signal.signal(signal.SIGUSR1, lambda *a: asked.append(1))
print("ready", flush=True)
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    if asked:
        asked.clear()
        dst = os.path.join(out, "checkpoint-200")
        os.makedirs(dst, exist_ok=True)
        for n in sorted(os.listdir(staged), key=lambda n: n == "trainer_state.json"):
            shutil.copyfile(os.path.join(staged, n), os.path.join(dst, n))
        print("saved checkpoint-200 on SIGUSR1", flush=True)
    time.sleep(0.2)
"""


def test_sigterm_to_the_daemon_is_a_notice_and_the_next_boot_tells_the_owner(
        make_daemon, metadata_servers, s3_server, s3_prefix, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    write_checkpoint(out, 100, 1 * MiB)                       # older, still in its quiet period
    staged = write_checkpoint(tmp_path / "staged", 200, 2 * MiB)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ec2 = metadata_servers["ec2"]
    d = make_daemon({
        "training": {"command": f"{sys.executable} {script} {out} {staged}", "workdir": str(tmp_path),
                     "autostart": True},
        "sync": {**s3_server.sync_config(s3_prefix, part_size="5M"), "watch": [str(out)], "quiet_period": "5m"},
        # the EC2 metadata service answers (no notice): a spot host, so a SIGTERM not from systemd is one
        "preemption": {"watch": [], "metadata_urls": {"ec2": ec2.url, "gcp": "http://127.0.0.1:9",
                                                      "azure": "http://127.0.0.1:9"},
                       "training_signal": "SIGUSR1", "poll_interval": "1s", "sigterm_grace": "60s"},
    })
    d.wait_training("RUNNING")
    log = Path(d.status()["training"]["log"])
    wait_until(lambda: "ready" in log.read_text(errors="replace"), 30, what="the training's handler")
    wait_until(lambda: d.status()["preemption"]["detected"] == ["ec2"], 30, what="EC2 detected")
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(90)
    print(f"\nSIGTERM -> daemon exited after the emergency sync: {time.monotonic() - t0:.1f}s")
    rec = json.loads((d.state_dir / "preemption.json").read_text())
    assert rec["provider"] == "signal" and rec["kind"] == "sigterm" and rec["signal"] == "SIGUSR1"
    assert rec["outcome"] == "synced", rec
    assert rec["newest"] == "checkpoint-200" and rec["newest_on_target"]
    assert set(rec["made_it"]) == {"checkpoint-100", "checkpoint-200"}
    assert "saved checkpoint-200 on SIGUSR1" in log.read_text(errors="replace")
    assert manifest_on(s3_server, s3_prefix, "checkpoint-200") and manifest_on(s3_server, s3_prefix, "checkpoint-100")
    kinds = [json.loads(line).get("kind") for line in (d.state_dir / "alerts.jsonl").read_text().splitlines()]
    assert "preemption" in kinds and "preemption_outcome" in kinds
    # the next boot: a new machine with this state dir restored (another boot id in the record)
    rec["boot_id"] = "the-machine-that-was-taken"
    (d.state_dir / "preemption.json").write_text(json.dumps(rec))
    d.start()
    prev = d.status()["preemption"]["previous"]
    assert prev["newest"] == "checkpoint-200" and prev["told_next_boot"]
    recent = d.req("alerts")["recent"]
    subjects = [a.get("subject", "") for a in recent if a.get("kind") == "preempted_previous"]
    assert subjects and "The previous machine was preempted at" in subjects[0] and \
        subjects[0].endswith("newest checkpoint checkpoint-200 made it"), subjects
    # told once: a restart of this machine says nothing again (SIGINT: a plain stop, never a notice)
    _plain_stop(d)
    d.start()
    assert d.status()["preemption"]["previous"] is None
    _plain_stop(d)


def _plain_stop(d) -> None:
    """SIGINT, then wait for the daemon's exit itself (a loaded 2-core runner may take a while to
    schedule it; the daemon no longer waits for duties in flight), naming where it stood if not."""
    d.proc.send_signal(signal.SIGINT)
    wait_until(lambda: d.proc.poll() is not None, 90, interval=0.1,
               what=f"the daemon's exit after SIGINT; its log ends: {d.log_text()[-1500:]}")


def test_a_damaged_record_is_set_aside_and_named(tmp_path):
    from supervisor.clock import FakeClock
    from supervisor.config import from_dict
    from supervisor.notify.alerts import Alerts
    from supervisor.spot.guard import SpotGuard
    from supervisor.statefile import StateStore
    from tests.fixtures.context import ConfiguredContext

    cfg = from_dict({"state_dir": str(tmp_path), "preemption": {"watch": ["none"]}})
    (tmp_path / "preemption.json").write_text(json.dumps({"provider": "ec2", "noticed_at": "yesterday"}))
    clock = FakeClock()
    store = StateStore(tmp_path)
    g = SpotGuard(ConfiguredContext(clock, store, Alerts(cfg.alerts, clock, None), cfg), cfg.preemption, sync=None, training=None,
                  hostname="h")
    assert g.record is None and g.watcher is None
    assert any("noticed_at" in p and "set aside" in p for p in store.problems)
    assert not (tmp_path / "preemption.json").exists()
    g.boot()  # nothing to tell, nothing raised
    assert g.status()["previous"] is None and g.status()["detected"] is None


def test_a_daemon_restarted_mid_notice_on_the_same_boot_goes_on_with_it(tmp_path):
    from supervisor.clock import FakeClock
    from supervisor.config import SyncConfig, from_dict
    from supervisor.notify.alerts import Alerts
    from supervisor.spot.guard import SpotGuard
    from supervisor.statefile import StateStore
    from supervisor.sync.engine import SyncEngine
    from tests.fixtures.context import ConfiguredContext

    clock = FakeClock(start=NOW, boot=("boot-1", 50.0))
    cfg = from_dict({"state_dir": str(tmp_path), "preemption": {"watch": ["none"]}})
    rec = NoticeRecord("ec2", "terminate", "", NOW - 20, NOW + 100, boot_id="boot-1", hostname="h")
    StateStore(tmp_path).save("preemption", dataclasses.asdict(rec))
    engine = SyncEngine(SyncConfig(), state_dir=str(tmp_path), clock=clock)  # no target: nothing to send
    g = SpotGuard(ConfiguredContext(clock, StateStore(tmp_path), Alerts(cfg.alerts, clock, None), cfg), cfg.preemption, engine, None, "h")
    try:
        g.boot()
        assert g.active and engine._emergency and g.status()["notice"]["provider"] == "ec2"
        wait_until(lambda: g.record.outcome, 10, what="the outcome")
        assert g.record.outcome == "synced" and g.status()["previous"] is None
    finally:
        g.close()
