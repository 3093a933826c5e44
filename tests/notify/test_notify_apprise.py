"""Alerts through Apprise to a real HTTP receiver on loopback (json:// and ntfy's publish API), with
the same dedup/repeat/resolved/cap/queue/retry as mail, each channel's health in status, and a
failing service that never blocks the daemon nor the other channels."""

from __future__ import annotations

import json
import re
import time

import pytest
import structlog

from supervisor.config import AlertsConfig, ConfigError, from_dict, redact_url, redacted
from supervisor.daemon.channels import build_channels
from supervisor.logging_setup import configure
from supervisor.notify.alerts import Alerts, AlertState, Mail, due_mails, queue
from supervisor.notify.apprise import AppriseChannel, check_urls
from supervisor.notify.channels import chat_text, scrub, url_secret_parts
from supervisor.notify.mail import SmtpMailer
from tests.fixtures.http_receiver import ntfy_reply
from tests.waiting import wait_until

CFG = AlertsConfig(first_delay=10.0, repeat_interval=3600.0, max_per_hour=3, retry_interval=60.0)


def alerts(clock, tmp_path, *channels, **kw) -> Alerts:
    kw.setdefault("background", False)
    return Alerts(CFG, clock, tmp_path / "state", hostname="gpu-7", channels=list(channels), **kw)


def health(a: Alerts, name: str) -> dict:
    return next(c for c in a.channel_status() if c["name"] == name)


# --- pure pieces -----------------------------------------------------------------------------------

def test_queue_fans_out_per_channel_and_caps_each_channel_alone():
    st = AlertState(channels=["email", "ntfy"])
    for i in range(5):
        queue(st, Mail(f"c{i}", "sync_failing", f"c{i}", "b", 0.0))
    assert [(m.key, m.channel) for m in st.outbox[:2]] == [("c0", "email"), ("c0", "ntfy")]
    st.sent_times = {"email": [-10.0, -5.0, -1.0]}  # the mail's cap is used up ...
    due = due_mails(st, 0.0, CFG)
    assert [m.channel for m in due] == ["ntfy"] * 3  # ... the chat channel has its own


def test_chat_text_is_short_and_points_to_the_full_text():
    body = "\n".join(f"line {i}: " + "x" * 40 for i in range(100))
    short = chat_text(body, 300, "gpu-7")
    assert len(short) <= 300 and short.endswith("(full text: supervisorctl alerts on gpu-7)")
    assert short.startswith("line 0: ") and "line 99" not in short
    assert chat_text("fits", 300) == "fits"


@pytest.mark.parametrize("url,shown", [
    ("slack://T1234567/B7654321/AbCdEfGhIjKlMnOp", "slack://***"),
    ("tgram://123456789:AAHsecretbottoken/-100200300", "tgram://***"),
    ("discord://1234/tokenpart", "discord://***"),
    ("ntfys://ntfy.sh/my-secret-topic", "ntfys://***"),
    ("json://user:pa55@hooks.example.com:8080/path?x=1", "json://hooks.example.com:8080/***"),
    ("https://hooks.example.com/services/T/B/C", "https://hooks.example.com/***"),
])
def test_urls_are_shown_redacted(url, shown):
    assert redact_url(url) == shown
    cfg = from_dict({"notify": {"urls": [url]}})
    assert redacted(cfg)["notify"]["urls"] == [shown]
    parts = url_secret_parts(url, shown)
    said = scrub(f"failed to post to {url} (user {url.split('://')[1][:12]})", parts)
    for piece in re.split(r"[/:@?&=]+", url.split("://", 1)[1]):
        if len(piece) >= 4 and piece not in shown:
            assert piece not in said


def test_config_rejects_a_bad_url_without_echoing_it():
    with pytest.raises(ConfigError) as e:
        from_dict({"notify": {"urls": ["not a url with s3cr3t"]}})
    assert "notify.urls[0]" in str(e.value) and "s3cr3t" not in str(e.value)


def test_check_urls_uses_apprise_and_names_the_position():
    probs = check_urls(["json://127.0.0.1:9/x", "nosuchservice://abc/def"])
    assert len(probs) == 1 and probs[0].startswith("notify.urls[1]:") and "nosuchservice://" in probs[0]


def test_urls_file_adds_urls_and_a_missing_file_is_a_problem_not_a_crash(tmp_path):
    f = tmp_path / "urls"
    f.write_text("# chat\njson://127.0.0.1:9/a\n\nntfy://127.0.0.1:9/topic\n")
    chans, probs = build_channels(from_dict({"notify": {"urls": ["json://127.0.0.1:9/b"], "urls_file": str(f)}}))
    assert [c.name for c in chans][:1] == ["json"] and len(chans) == 3 and probs == []
    assert len({c.name for c in chans}) == 3  # two json:// URLs get distinct names
    chans, probs = build_channels(from_dict({"notify": {"urls_file": str(tmp_path / "gone")}}))
    assert chans == [] and "notify.urls_file" in probs[0]


# --- a real receiver ----------------------------------------------------------------------------

def test_json_url_delivers_the_alert_and_its_resolution(receiver, clock, tmp_path):
    a = alerts(clock, tmp_path, AppriseChannel(f"json://127.0.0.1:{receiver.port}/hook"))
    for _ in range(15):
        a.fire("sync", "sync_failing", "warning", "sync failing", "S3 403 Forbidden\nretrying")
        a.tick()
        clock.advance(1)
    (req,) = receiver.got()  # dedup: one message while it holds
    d = req.json()
    assert req.path == "/hook" and d["title"] == "gpu-7: sync failing" and d["type"] == "warning"
    assert "403 Forbidden" in d["message"]
    a.resolve("sync")
    a.tick()
    last = receiver.got()[-1].json()
    assert last["title"] == "gpu-7: RESOLVED: sync failing" and last["type"] == "success"
    h = health(a, "json")
    assert h["state"] == "ok" and h["sent"] == 2 and h["queued"] == 0 and h["kind"] == "apprise"
    assert [e["what"] for e in a.recent() if e.get("channel") == "json"] == ["sent", "sent"]


def test_ntfy_api_shape(receiver, clock, tmp_path):
    receiver.reply = ntfy_reply(receiver)
    a = alerts(clock, tmp_path, AppriseChannel(f"ntfy://127.0.0.1:{receiver.port}/gpu-alerts"))
    a.event("oom", "cuda_oom", "critical", "CUDA out of memory", "Tried to allocate 2.00 GiB")
    a.tick()
    (req,) = receiver.got()
    d = req.json()
    assert (d["topic"], d["title"]) == ("gpu-alerts", "gpu-7: CUDA out of memory")
    assert "2.00 GiB" in d["message"] and health(a, "ntfy")["state"] == "ok"


def test_failing_receiver_is_retried_with_backoff_and_recovers(receiver, clock, tmp_path):
    receiver.reply = ntfy_reply(receiver)
    receiver.status = 429
    a = alerts(clock, tmp_path, AppriseChannel(f"ntfy://127.0.0.1:{receiver.port}/t"))
    a.event("fin", "training_finished", "info", "training finished", "exit 0")
    a.tick()
    h = health(a, "ntfy")
    assert h["state"] == "failing" and h["queued"] == 1 and "limit reached" in h["last_error"]
    assert h["next_try"] == clock.time() + 60
    clock.advance(30)
    a.tick()
    assert len(receiver.got()) == 1  # not before its retry time
    clock.advance(30)
    a.tick()  # still failing: the next wait doubles
    assert health(a, "ntfy")["next_try"] == clock.time() + 120 and health(a, "ntfy")["failures"] == 2
    receiver.status = 200
    clock.advance(120)
    a.tick()
    h = health(a, "ntfy")
    assert h["state"] == "ok" and h["queued"] == 0 and h["failures"] == 0
    assert [r.json()["title"] for r in receiver.got()] == ["gpu-7: training finished"] * 3


def test_service_down_then_up_survives_a_daemon_restart(receiver, clock, tmp_path):
    url = f"json://127.0.0.1:{receiver.port}/x"
    receiver.stop()
    a = alerts(clock, tmp_path, AppriseChannel(url))
    a.event("e", "cuda_oom", "critical", "CUDA out of memory", "b")
    a.tick()
    assert health(a, "json")["state"] == "failing" and a.outbox_size() == 1
    b = alerts(clock, tmp_path, AppriseChannel(url))  # restart while it is down: nothing is lost
    assert b.outbox_size() == 1 and health(b, "json")["state"] == "failing"
    receiver.start()
    clock.advance(60)
    b.tick()
    assert [r.json()["title"] for r in receiver.got()] == ["gpu-7: CUDA out of memory"]
    assert b.outbox_size() == 0 and health(b, "json")["state"] == "ok"


def test_a_dead_chat_service_does_not_hold_back_the_mail(smtp_server, receiver, clock, tmp_path):
    receiver.status = 500
    ecfg = from_dict({"email": {"to": ["o@example.com"], "smtp_host": "127.0.0.1", "smtp_port": smtp_server.port,
                                "security": "none", "subject_prefix": ""}}).email
    chans, _ = build_channels(from_dict({"notify": {"urls": [f"json://127.0.0.1:{receiver.port}/x"]}}),
                              mailer=SmtpMailer(ecfg, "h"))
    a = alerts(clock, tmp_path, *chans)
    a.event("e", "cuda_oom", "critical", "CUDA out of memory", "b")
    a.tick()
    assert smtp_server.subjects() == ["gpu-7: CUDA out of memory"]
    assert health(a, "email")["state"] == "ok" and health(a, "json")["state"] == "failing"
    assert "500" in health(a, "json")["last_error"] and a.outbox_size() == 1


def test_a_silent_service_never_blocks_the_caller(blackhole_port, clock, tmp_path):
    ch = AppriseChannel(f"json://127.0.0.1:{blackhole_port}/x", timeout=2)
    a = alerts(clock, tmp_path, ch, background=True)
    t0 = time.monotonic()
    a.event("x", "stopping", "critical", "stopping now", "b")
    a.fire("y", "disk_full", "warning", "disk", "b")
    assert time.monotonic() - t0 < 0.5
    assert a.flush(timeout=0.2) is False  # still trying; flush gives up on time
    wait_until(lambda: health(a, "json")["state"] == "failing", 15, what="the timeout to be recorded")


def test_url_secrets_never_reach_logs_status_or_state(receiver, clock, tmp_path, capsys):
    secret = "Sup3rS3cretT0ken"
    receiver.status = 401
    url = f"json://bot:{secret}@127.0.0.1:{receiver.port}/hooks/{secret}x"
    configure("debug", json=True)
    try:
        a = alerts(clock, tmp_path, AppriseChannel(url))
        a.event("e", "cuda_oom", "critical", "oom", "b")
        a.tick()
        status = a.channel_status()
    finally:
        structlog.reset_defaults()
    out = capsys.readouterr()
    assert receiver.got() and health(a, "json")["state"] == "failing"
    assert status[0]["target"] == f"json://127.0.0.1:{receiver.port}/***"
    state = tmp_path / "state"
    for text in (out.out, out.err, json.dumps(status), json.dumps(a.recent()),
                 *(p.read_text() for p in state.iterdir())):
        assert secret not in text


def test_check_config_asks_apprise(tmp_path):
    import subprocess
    import sys

    from tests.fixtures.daemon import REPO

    cfg = tmp_path / "c.toml"
    cfg.write_text('[notify]\nurls = ["json://127.0.0.1:9/ok", "nosuchservice://tok3n/x"]\n')
    r = subprocess.run([sys.executable, "-m", "supervisor.cli.main", "check-config", str(cfg)], capture_output=True,
                       text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and r.stderr.startswith("notify.urls[1]:") and "tok3n" not in r.stderr
