"""Alert decisions (pure plan/due_mails/queue) and Alerts delivering through SmtpMailer to a real
aiosmtpd server, with hours of FakeClock time."""

from __future__ import annotations

import json
import os
import time

import pytest
import structlog
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.clock import FakeClock
from supervisor.config import AlertsConfig, from_dict
from supervisor.logging_setup import configure
from supervisor.notify.alerts import (
    OUTBOX_MAX,
    STALE_AFTER_RESTART,
    UNCAPPED_KINDS,
    Alerts,
    AlertState,
    Mail,
    Record,
    due_mails,
    plan,
    queue,
    sanitize_subject,
)
from supervisor.notify.mail import SmtpMailer

CFG = AlertsConfig(first_delay=10.0, repeat_interval=3600.0, max_per_hour=3, retry_interval=60.0)
PASSWORD = "s3cr3t-smtp-pa55word"


def cond(key: str, t: float, kind: str = "sync_failing") -> Record:
    return Record(key, kind, "warning", f"subject {key}", "body", True, t, t)


# --- pure decisions --------------------------------------------------------------------------

def test_condition_first_mail_waits_first_delay_then_repeats_then_resolves():
    st_ = AlertState({"k": cond("k", 0.0)})
    assert plan(st_, 9.9, CFG) == []
    (m,) = plan(st_, 10.0, CFG)
    assert m.subject == "subject k" and not m.replaceable
    assert plan(st_, 10.0 + 3599, CFG) == []
    (m2,) = plan(st_, 10.0 + 3600, CFG)
    assert m2.subject == "STILL: subject k" and m2.replaceable
    assert [x.subject for x in st_.outbox] == ["subject k", "STILL: subject k"]
    r = st_.records["k"]
    r.active, r.resolve_pending = False, True
    (m3,) = plan(st_, 5000.0, CFG)
    assert m3.subject == "RESOLVED: subject k" and "Resolved at" in m3.body
    # the queued reminder said nothing the resolution does not; the first mail stays
    assert [x.subject for x in st_.outbox] == ["subject k", "RESOLVED: subject k"]
    assert plan(st_, 99999.0, CFG) == []


def test_blip_inside_first_delay_sends_nothing():
    st_ = AlertState({"k": cond("k", 0.0)})
    plan(st_, 5.0, CFG)
    r = st_.records["k"]
    r.active, r.resolve_pending = False, True
    assert plan(st_, 6.0, CFG) == [] and plan(st_, 10_000.0, CFG) == []


def test_cleared_records_are_forgotten_after_a_day():
    st_ = AlertState({"k": cond("k", 0.0)})
    st_.records["k"].active = False
    plan(st_, 86399.0, CFG)
    assert "k" in st_.records
    plan(st_, 86400.0, CFG)
    assert st_.records == {}


def test_stale_condition_after_restart_is_resolved_with_a_note():
    r = cond("k", 0.0)
    r.last_mailed, r.mails, r.stale_since = 10.0, 1, 100.0
    st_ = AlertState({"k": r})
    assert plan(st_, 100.0 + STALE_AFTER_RESTART - 1, CFG) == []
    (m,) = plan(st_, 100.0 + STALE_AFTER_RESTART, CFG)
    assert m.subject.startswith("RESOLVED:") and "since the daemon restarted" in m.body


def _mail(key: str, kind: str = "sync_failing", **kw) -> Mail:
    return Mail(key, kind, key, "b", 0.0, **kw)


def test_due_mails_respects_cap_retry_time_and_uncapped_kinds():
    st_ = AlertState()
    for i in range(5):
        queue(st_, _mail(f"c{i}"))
    queue(st_, _mail("fin", "training_finished"))
    queue(st_, _mail("later", "stopping", next_try=100.0))
    st_.sent_times = {"email": [-3599.0]}  # one mail sent within the last hour
    due = due_mails(st_, 0.0, CFG)
    assert [m.key for m in due] == ["c0", "c1", "fin"]
    assert due[-1].uncapped and "later" not in [m.key for m in due]
    assert [m.key for m in due_mails(st_, 1.0, CFG)] == ["c0", "c1", "c2", "fin"]  # the old one aged out
    assert "later" in [m.key for m in due_mails(st_, 100.0, CFG)]


def test_cap_holds_when_the_wall_clock_goes_back():
    st_ = AlertState(sent_times={"email": [5000.0, 5001.0, 5002.0]})  # "future": the clock was set back
    queue(st_, _mail("x"))
    assert due_mails(st_, 0.0, CFG) == []
    assert st_.sent_times == {"email": [0.0, 0.0, 0.0]}


def test_queue_supersedes_replaceable_mails_for_the_same_key():
    st_ = AlertState()
    queue(st_, _mail("k"))
    queue(st_, _mail("k", replaceable=True))
    queue(st_, _mail("other", replaceable=True))
    dropped = queue(st_, _mail("k", replaceable=True))
    assert len(dropped) == 1 and [m.key for m in st_.outbox] == ["k", "other", "k"]


def test_outbox_is_bounded_and_keeps_lifecycle_mails():
    st_ = AlertState()
    queue(st_, _mail("stop", "stopping"))
    for i in range(OUTBOX_MAX + 20):
        queue(st_, _mail(f"c{i}"))
    assert len(st_.outbox) == OUTBOX_MAX
    assert st_.outbox[0].key == "stop" and st_.outbox[-1].key == f"c{OUTBOX_MAX + 19}"


def test_sanitize_subject():
    assert sanitize_subject("a\r\nBcc: x\x00\u2028y\x85z\t") == "a Bcc: x y z"
    assert len(sanitize_subject("x" * 500)) == 150


class ListMailer:
    """In-memory Mailer for the property test (SMTP itself is exercised below)."""

    def __init__(self, clock: FakeClock):
        self.clock, self.up, self.sent = clock, True, []

    def send(self, subject: str, body: str) -> None:
        if not self.up:
            raise ConnectionRefusedError("down")
        self.sent.append((self.clock.time(), subject))


ops = st.lists(st.tuples(st.sampled_from(["fire", "resolve", "event", "lifecycle", "wait", "down", "up"]),
                         st.integers(0, 3), st.floats(0, 2000)), max_size=60)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_property_cap_dedup_and_eventual_delivery(steps):
    with structlog.testing.capture_logs() as logs:
        _run_steps(steps)
    assert not [e for e in logs if e["event"] == "alerts_tick_failed"]  # tick() hides crashes: look


def _run_steps(steps) -> None:
    clock = FakeClock(1_000_000.0)
    mailer = ListMailer(clock)
    a = Alerts(CFG, clock, None, mailer, background=False)
    for op, k, dt in steps:
        key = f"k{k}"
        if op == "fire":
            a.fire(key, "gpu_mem", "warning", key, "b")
        elif op == "resolve":
            a.resolve(key)
        elif op == "event":
            a.event(f"e{k}", "oom", "critical", f"e{k}", "b")
        elif op == "lifecycle":
            a.event(f"life{clock.time()}", "stopping", "critical", "life", "b")
        elif op == "wait":
            clock.advance(dt)
        else:
            mailer.up = op == "up"
        a.tick()
    mailer.up = True
    for k in range(4):
        a.resolve(f"k{k}")
    for _ in range(300):  # let every retry become due; the cap drains at max_per_hour
        if not a.outbox_size():
            break
        clock.advance(600)
        a.tick()
    assert a.outbox_size() == 0
    capped = [t for t, s in mailer.sent if s != "life"]
    for t in capped:  # any one-hour window holds at most max_per_hour capped mails
        assert len([u for u in capped if t <= u < t + 3600]) <= CFG.max_per_hour
    by_key: dict[str, list[tuple[float, str]]] = {}
    for t, s in mailer.sent:
        by_key.setdefault(s.removeprefix("STILL: ").removeprefix("RESOLVED: "), []).append((t, s))
    for key, mails in by_key.items():
        if key.startswith("k"):
            assert not mails[0][1].startswith(("RESOLVED", "STILL"))  # a first mail before anything else


# --- Alerts with SmtpMailer and a real SMTP server ---------------------------------------------

def mailer_for(port: int) -> SmtpMailer:
    cfg = from_dict({"email": {"to": ["owner@example.com"], "smtp_host": "127.0.0.1", "smtp_port": port,
                               "security": "none", "timeout": "2s", "subject_prefix": "[ts]"}})
    return SmtpMailer(cfg.email, hostname="box")


def make(smtp_server, clock, tmp_path, cfg: AlertsConfig = CFG, **kw) -> Alerts:
    kw.setdefault("background", False)
    return Alerts(cfg, clock, tmp_path / "state", mailer_for(smtp_server.port), hostname="gpu-7", **kw)


def test_dedup_repeat_and_resolved_over_smtp(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    for _ in range(20):  # checked every few seconds while it holds
        a.fire("disk:/workspace", "disk_full", "critical", "disk /workspace 97% full", "3 GiB left")
        a.tick()
        clock.advance(1)
    assert smtp_server.subjects() == ["[ts] gpu-7: disk /workspace 97% full"]
    assert [x["key"] for x in a.active()] == ["disk:/workspace"]
    clock.advance(3600 - 11)
    a.fire("disk:/workspace", "disk_full", "critical", "disk /workspace 98% full", "2 GiB left")
    a.tick()
    assert len(smtp_server.messages) == 1
    clock.advance(2)
    a.tick()
    assert smtp_server.subjects()[-1] == "[ts] gpu-7: STILL: disk /workspace 98% full"
    a.resolve("disk:/workspace")
    a.tick()
    assert smtp_server.subjects()[-1] == "[ts] gpu-7: RESOLVED: disk /workspace 98% full"
    assert a.active() == [] and len(smtp_server.messages) == 3
    assert [e["what"] for e in a.recent()].count("mailed") == 3


def test_event_dedup_within_repeat_interval(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    assert a.event("oom:cuda", "cuda_oom", "critical", "CUDA out of memory", "Tried to allocate 2 GiB")
    assert not a.event("oom:cuda", "cuda_oom", "critical", "CUDA out of memory", "again")
    a.tick()
    clock.advance(3600)
    assert a.event("oom:cuda", "cuda_oom", "critical", "CUDA out of memory", "an hour later")
    a.tick()
    assert len(smtp_server.wait_for(2)) == 2
    assert [e["what"] for e in a.recent() if e["what"] in ("event", "suppressed")] == \
        ["event", "suppressed", "event"]


def test_hourly_cap_and_lifecycle_mails_pass_it(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    for i in range(6):
        a.event(f"gpu{i}", "gpu_mem", "warning", f"GPU {i} memory at its limit", "b")
    a.tick()
    assert len(smtp_server.messages) == 3
    a.event("idle-warning:1", "idle_warning", "warning", "idle: stopping at 14:00", "keepalive 2h")
    a.event("stopping:1", "stopping", "critical", "stopping now", "b")
    a.tick()
    assert smtp_server.subjects()[-2:] == ["[ts] gpu-7: idle: stopping at 14:00", "[ts] gpu-7: stopping now"]
    assert a.outbox_size() == 3
    clock.advance(3599)
    a.tick()
    assert len(smtp_server.messages) == 5
    clock.advance(1)
    a.tick()
    assert len(smtp_server.messages) == 8 and a.outbox_size() == 0
    assert UNCAPPED_KINDS >= {"idle_warning", "stopping", "stop_cancelled", "training_finished"}


def test_smtp_down_then_up_delivers_later_and_survives_a_restart(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    smtp_server.stop()
    a.event("train:failed", "training_failed", "critical", "training failed (exit 1)", "tail of log")
    a.fire("sync", "sync_failing", "warning", "sync failing", "403")
    clock.advance(10)
    a.tick()
    assert a.outbox_size() == 2
    failed = [e for e in a.recent() if e["what"] == "mail_failed"]
    assert len(failed) == 1 and "Connection refused" in failed[0]["error"]  # one try, then wait
    # the daemon restarts while the server is down: nothing is lost
    b = make(smtp_server, clock, tmp_path)
    assert b.outbox_size() == 2
    smtp_server.start()
    b.tick()  # the mail not tried yet goes; the failed one waits for its retry time
    assert smtp_server.subjects() == ["[ts] gpu-7: sync failing"]
    clock.advance(60)
    b.tick()
    assert smtp_server.subjects()[1:] == ["[ts] gpu-7: training failed (exit 1)"]
    assert b.outbox_size() == 0


def test_failed_delivery_backs_off(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    smtp_server.stop()
    a.event("e", "cuda_oom", "critical", "oom", "b")
    tries = []
    for _ in range(8):
        a.tick()
        tries.append(a.state.outbox[0].next_try - clock.time())
        clock.advance(tries[-1])
    assert tries[:4] == [60, 120, 240, 480] and max(tries) <= 3600


def test_event_never_blocks_on_a_silent_server(blackhole_port, clock, tmp_path):
    cfg = from_dict({"email": {"to": ["o@example.com"], "smtp_host": "127.0.0.1", "smtp_port": blackhole_port,
                               "security": "none", "timeout": "3s"}})
    a = Alerts(CFG, clock, tmp_path, SmtpMailer(cfg.email, "h"))  # background delivery, as in the daemon
    t0 = time.monotonic()
    a.event("x", "stopping", "critical", "stopping now", "b")
    a.fire("y", "disk_full", "warning", "disk", "b")
    a.resolve("y")
    assert time.monotonic() - t0 < 0.5
    assert a.flush(timeout=0.2) is False  # still trying; flush gives up on time


def test_flush_delivers_before_a_stop(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path, background=True)
    a.event("stopping:1", "stopping", "critical", "stopping now", "final sync verified")
    assert a.flush(timeout=10)
    assert smtp_server.subjects() == ["[ts] gpu-7: stopping now"]


def test_flapping_condition_does_not_mail_twice(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    a.fire("mem", "gpu_mem", "warning", "GPU memory at its limit", "b")
    clock.advance(10)
    a.tick()
    a.resolve("mem")  # background=False: the resolved mail waits for the tick ...
    a.fire("mem", "gpu_mem", "warning", "GPU memory at its limit", "b")  # ... and it is back
    a.tick()
    clock.advance(60)
    a.tick()
    assert smtp_server.subjects() == ["[ts] gpu-7: GPU memory at its limit"]
    assert [x["key"] for x in a.active()] == ["mem"]


def test_header_injection_from_log_text(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    evil = "RuntimeError: CUDA out of memory\r\nBcc: everyone@example.com\r\nSubject: free money"
    a.event("oom", "cuda_oom", "critical", evil, "log:\r\n" + evil)
    a.tick()
    (msg,) = smtp_server.wait_for(1)
    assert msg["Bcc"] is None and len(msg.get_all("Subject")) == 1
    assert smtp_server.envelopes[0][1] == ["owner@example.com"]
    assert "free money" in " ".join(str(msg["Subject"]).split())


def test_stale_condition_after_restart_resolves(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    a.fire("mem", "host_mem", "warning", "host memory low", "b")
    clock.advance(10)
    a.tick()
    b = make(smtp_server, clock, tmp_path)  # restart; nobody reports the condition any more
    clock.advance(STALE_AFTER_RESTART)
    b.tick()
    assert smtp_server.subjects()[-1] == "[ts] gpu-7: RESOLVED: host memory low"
    c = make(smtp_server, clock, tmp_path)
    assert c.active() == []


def test_condition_reported_again_after_restart_stays(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    a.fire("mem", "host_mem", "warning", "host memory low", "b")
    clock.advance(10)
    a.tick()
    b = make(smtp_server, clock, tmp_path)
    b.fire("mem", "host_mem", "warning", "host memory low", "b")
    clock.advance(STALE_AFTER_RESTART)
    b.tick()
    assert len(smtp_server.messages) == 1 and [x["key"] for x in b.active()] == ["mem"]


def test_cap_survives_a_restart(smtp_server, clock, tmp_path):
    a = make(smtp_server, clock, tmp_path)
    for i in range(3):
        a.event(f"e{i}", "cuda_oom", "critical", f"oom {i}", "b")
    a.tick()
    b = make(smtp_server, clock, tmp_path)
    b.event("e9", "cuda_oom", "critical", "oom 9", "b")
    b.tick()
    assert len(smtp_server.messages) == 3 and b.outbox_size() == 1


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"records": {"k": {"key": 1}}}',
                                     b'{"outbox": [{"key": "k"}]}', b'{"sent_times": ["soon"]}'])
def test_corrupt_state_file_is_set_aside(content, smtp_server, clock, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "alerts.json").write_bytes(content)
    a = make(smtp_server, clock, tmp_path)
    assert a.active() == [] and a.outbox_size() == 0
    assert a.problems and "alerts.json" in a.problems[0]
    assert list(state.glob("alerts.json.corrupt-*"))
    a.event("e", "cuda_oom", "critical", "still works", "b")
    a.tick()
    assert smtp_server.subjects() == ["[ts] gpu-7: still works"]
    assert json.loads((state / "alerts.json").read_text())["records"]["e"]["mails"] == 1


def test_garbage_lines_in_alert_log_are_skipped(clock, tmp_path):
    (tmp_path / "alerts.jsonl").write_bytes(b'{"what": "mailed", "key": "a"}\n\xff garbage\n[1]\n{"what"')
    a = Alerts(CFG, clock, tmp_path, None)
    assert a.recent() == [{"what": "mailed", "key": "a"}]


def test_without_smtp_alerts_reach_the_journal_and_the_alert_list(clock, tmp_path, capsys):
    configure("info", json=True)
    try:
        a = Alerts(CFG, clock, tmp_path, None, hostname="h")
        a.event("fin", "training_finished", "info", "training finished", "exit 0")
        a.fire("disk", "disk_full", "critical", "disk full", "b")
        clock.advance(10)
        a.tick()
    finally:
        structlog.reset_defaults()
    journal = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {(j["event"], j.get("subject")) for j in journal} >= {("alert", "training finished"),
                                                                  ("alert", "disk full")}
    whats = [(e["what"], e["key"]) for e in a.recent()]
    assert ("not_mailed", "fin") in whats and ("not_mailed", "disk") in whats
    on_disk = [json.loads(x) for x in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert ("not_mailed", "disk") in [(e["what"], e["key"]) for e in on_disk]
    assert a.outbox_size() == 0
    assert (tmp_path / "alerts.jsonl").stat().st_mode & 0o777 == 0o600


def test_the_alert_log_is_private_after_its_rotation(clock, tmp_path):
    a = Alerts(CFG, clock, tmp_path, None, hostname="h")
    (tmp_path / "alerts.jsonl").write_bytes(b"{}\n" * (2 * 1024 * 1024 + 1))  # over 4 MiB: rotates next
    os.chmod(tmp_path / "alerts.jsonl", 0o600)
    a.event("one", "training_finished", "info", "training finished", "exit 0")
    assert (tmp_path / "alerts.jsonl.1").exists()
    a.event("two", "training_finished", "info", "training finished", "exit 0")
    assert (tmp_path / "alerts.jsonl").stat().st_mode & 0o777 == 0o600


def test_smtp_password_never_reaches_logs_or_state(smtp_factory, tls_ca, clock, tmp_path, capsys):
    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD + "\n")
    srv = smtp_factory("starttls", auth=("trainer", "not-" + PASSWORD))  # the server rejects our password
    ecfg = from_dict({"email": {"to": ["o@example.com"], "smtp_host": "127.0.0.1", "smtp_port": srv.port,
                                "security": "starttls", "username": "trainer", "password_file": str(pw_file),
                                "ca_file": tls_ca.ca_file}}).email
    state = tmp_path / "state"
    configure("debug", json=True)
    try:
        a = Alerts(CFG, clock, state, SmtpMailer(ecfg, "h"), background=False)
        a.event("e", "cuda_oom", "critical", "oom", "b")
        a.tick()  # 535 from the server
        pw_file.unlink()
        clock.advance(60)
        a.tick()  # password file gone
        pw_file.write_text(PASSWORD)
        srv.authenticator.password = PASSWORD
        clock.advance(120)
        a.tick()  # delivered
    finally:
        structlog.reset_defaults()
    out = capsys.readouterr()
    assert len(srv.wait_for(1)) == 1
    errors = [e["error"] for e in a.recent() if e["what"] == "mail_failed"]
    assert "535" in errors[0] and "email.password_file" in errors[1]
    assert "alert_mail_failed" in out.out
    for text in (out.out, out.err, json.dumps(a.recent()), *(p.read_text() for p in state.iterdir())):
        assert PASSWORD not in text


def test_bad_severity_does_not_crash_the_caller(clock, tmp_path):
    a = Alerts(CFG, clock, tmp_path, None)
    a.fire("k", "x", "urgent!!", "s", "b")
    assert a.active()[0]["severity"] == "warning"



def test_mails_never_carry_a_key_from_a_command_line():
    clock = FakeClock(1_000_000.0)
    mailer = ListMailer(clock)
    a = Alerts(CFG, clock, None, mailer, background=False)
    a.event("stop:now:1", "stopping", "warning", "stopping now",
            "Stop action: command `vastai stop instance 7 --api-key 0123456789abcdef`\n")
    a.fire("sync:failing", "sync_failing", "warning", "sync failing: https://u:hunter2pass@host/x", "b")
    a.tick()
    assert mailer.sent and all("0123456789abcdef" not in s and "hunter2pass" not in s for _, s in mailer.sent)
    assert "0123456789abcdef" not in a.state.outbox.__repr__()
