"""Signed webhooks: the Standard Webhooks signature (the spec's test vector, and a real receiver on
loopback that verifies every request with the spec's reference implementation, the
`standardwebhooks` package), retries with backoff under one webhook-id, and secrets kept out of
every log and error."""

from __future__ import annotations

import base64
import json
import time

import pytest
import structlog
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from supervisor.config import AlertsConfig, ConfigError, from_dict
from supervisor.daemon.channels import build_channels
from supervisor.logging_setup import configure
from supervisor.notify.alerts import Alerts
from supervisor.notify.channels import Message
from supervisor.notify.webhook import WebhookChannel, WebhookError, decode_secret, facts_for, payload, sign

CFG = AlertsConfig(first_delay=10.0, repeat_interval=3600.0, max_per_hour=3, retry_interval=60.0)
SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()


def test_signature_matches_the_spec_test_vector():
    # The example from the Standard Webhooks reference libraries' own tests.
    key = decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    got = sign(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert got == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


@pytest.mark.parametrize("text", ["whsec_!!!notbase64", "whsec_c2hvcnQ=", ""])
def test_bad_secrets_are_refused_with_a_recipe_and_without_the_secret(text):
    with pytest.raises(WebhookError) as e:
        decode_secret(text)
    assert "notify.webhook_secret_file" in str(e.value) and (not text[6:] or text[6:] not in str(e.value))


def test_config_requires_the_secret_with_the_url():
    with pytest.raises(ConfigError) as e:
        from_dict({"notify": {"webhook_url": "https://example.com/hook"}})
    assert "notify.webhook_secret_file: required" in str(e.value)
    with pytest.raises(ConfigError):
        from_dict({"notify": {"webhook_url": "ftp://example.com/hook", "webhook_secret_file": "/x"}})


def test_facts_are_the_status_sections_the_alert_is_about():
    st = {"now": 5.0, "sync": {"state": "failing"}, "training": {"state": "RUNNING"}, "idle": {}, "stop": {},
          "cost": {"spent": 1.0}, "gpus": []}
    assert facts_for("sync_failing", st) == {"sync": {"state": "failing"}, "at": 5.0}
    assert set(facts_for("stopping", st)) == {"idle", "stop", "sync", "cost", "at"}
    assert set(facts_for("training_finished", st)) == {"training", "cost", "at"}
    st["training"]["command"] = "python train.py --hf_token hf_secret"
    assert facts_for("training_failed", st)["training"] == {"state": "RUNNING"}
    assert facts_for("x", None) == {}


def test_payload_shape():
    m = Message("msg_1", "sync", "sync_failing", "warning", "resolved", "RESOLVED: sync failing", "ok now",
                "gpu-7", 1764700000.5, {"sync": {"state": "idle"}})
    p = payload(m)
    assert p["type"] == "alert.resolved" and p["timestamp"] == "2025-12-02T18:26:40.500000Z"
    assert p["data"]["status"] == {"sync": {"state": "idle"}} and p["data"]["host"] == "gpu-7"


# --- against a receiver that verifies -------------------------------------------------------------

def verifying(receiver, secret: str = SECRET):
    wh = Webhook(secret)
    seen: list[dict] = []

    def reply(req):
        if receiver.status != 200:
            return receiver.status, {}, b"busy"
        try:
            seen.append(wh.verify(req.body, req.headers))
        except WebhookVerificationError as e:
            return 400, {}, str(e).encode()
        return 204, {}, b""

    receiver.reply = reply
    return seen


@pytest.fixture
def secret_file(tmp_path):
    p = tmp_path / "whsec"
    p.write_text(SECRET + "\n")
    return p


def make(receiver, secret_file, clock, tmp_path, **kw) -> tuple[Alerts, WebhookChannel]:
    status = {"now": clock.time(), "training": {"state": "FINISHED", "exit_code": 0}, "cost": {"spent": 4.2},
              "sync": {"state": "idle", "pending_files": 0}}
    ch = WebhookChannel(f"http://127.0.0.1:{receiver.port}/hook", str(secret_file), timeout=3,
                        facts=lambda kind: facts_for(kind, status), **kw)
    return Alerts(CFG, clock, tmp_path / "state", hostname="gpu-7", channels=[ch], background=False), ch


def test_receiver_verifies_the_signed_alert_and_gets_the_facts(receiver, secret_file, clock, tmp_path):
    seen = verifying(receiver)
    a, _ = make(receiver, secret_file, clock, tmp_path)
    a.event("training:end:1", "training_finished", "info", "training finished", "exit 0 after 2h")
    a.tick()
    (got,) = seen
    assert got["type"] == "alert.event" and got["data"]["kind"] == "training_finished"
    assert got["data"]["status"]["training"] == {"state": "FINISHED", "exit_code": 0}
    assert got["data"]["status"]["cost"] == {"spent": 4.2}
    (req,) = receiver.got()
    assert req.headers["webhook-id"].startswith("msg_") and req.headers["content-type"] == "application/json"
    assert abs(int(req.headers["webhook-timestamp"]) - time.time()) < 60
    assert a.channel_status()[0]["state"] == "ok"


def test_a_wrong_secret_is_rejected_by_the_receiver(receiver, secret_file, clock, tmp_path):
    verifying(receiver, "whsec_" + base64.b64encode(b"another-secret-of-32-bytes-long!").decode())
    a, _ = make(receiver, secret_file, clock, tmp_path)
    a.event("e", "cuda_oom", "critical", "oom", "b")
    a.tick()
    h = a.channel_status()[0]
    assert h["state"] == "failing" and "HTTP 400" in h["last_error"]


def test_retried_with_backoff_under_the_same_id_and_a_fresh_timestamp(receiver, secret_file, clock, tmp_path):
    seen = verifying(receiver)
    receiver.status = 503
    wall = [1_900_000_000.0]
    a, ch = make(receiver, secret_file, clock, tmp_path)
    ch.wall = lambda: wall[0]
    a.fire("sync", "sync_failing", "warning", "sync failing", "S3 timed out")
    clock.advance(10)
    waits = []
    for _ in range(3):
        a.tick()
        waits.append(a.channel_status()[0]["next_try"] - clock.time())
        clock.advance(waits[-1])
        wall[0] += waits[-1]
    assert waits == [60, 120, 240]
    receiver.status = 200
    ch.wall = time.time  # the receiver checks the timestamp against its own clock
    a.tick()
    reqs = receiver.got()
    assert len(reqs) == 4 and len(seen) == 1
    assert len({r.headers["webhook-id"] for r in reqs}) == 1  # one message, four attempts
    assert len({r.headers["webhook-timestamp"] for r in reqs}) == 4
    assert seen[0]["type"] == "alert.firing" and seen[0]["data"]["status"]["sync"]["state"] == "idle"
    assert a.channel_status()[0] | {"last_ok_at": None} == a.channel_status()[0] | {
        "state": "ok", "queued": 0, "failures": 0, "last_ok_at": None}


def test_redirects_are_not_followed(receiver, secret_file, clock, tmp_path):
    receiver.reply = lambda req: (307, {"Location": "http://127.0.0.1:9/elsewhere"}, b"")
    a, _ = make(receiver, secret_file, clock, tmp_path)
    a.event("e", "cuda_oom", "critical", "oom", "b")
    a.tick()
    assert len(receiver.got()) == 1 and "HTTP 307" in a.channel_status()[0]["last_error"]


def test_secret_never_in_logs_errors_or_state(receiver, secret_file, clock, tmp_path, capsys):
    receiver.status = 500
    verifying(receiver)
    configure("debug", json=True)
    try:
        a, _ = make(receiver, secret_file, clock, tmp_path)
        a.event("e", "cuda_oom", "critical", "oom", "b")
        a.tick()
        secret_file.unlink()
        clock.advance(60)
        a.tick()
    finally:
        structlog.reset_defaults()
    errors = [e["error"] for e in a.recent() if e["what"] == "send_failed"]
    assert "HTTP 500" in errors[0] and "notify.webhook_secret_file" in errors[1]
    out = capsys.readouterr()
    key = SECRET.removeprefix("whsec_")
    for text in (out.out, out.err, json.dumps(a.channel_status()), json.dumps(a.recent()),
                 *(p.read_text() for p in (tmp_path / "state").iterdir())):
        assert key not in text


def test_build_channels_makes_the_webhook(tmp_path, secret_file):
    cfg = from_dict({"notify": {"webhook_url": "https://hooks.example.com/t/abc123secret",
                                "webhook_secret_file": str(secret_file)}})
    (ch,), probs = build_channels(cfg)
    assert ch.kind == "webhook" and ch.target == "https://hooks.example.com/***" and probs == []


# --- wired into the daemon ----------------------------------------------------------------------------

@pytest.mark.skipif(__import__("shutil").which("tmux") is None, reason="tmux is not installed")
def test_daemon_sends_a_finished_run_to_apprise_and_the_webhook(tmp_path, make_daemon, receiver, secret_file):
    from tests.fixtures.http_receiver import Receiver
    from tests.waiting import wait_until

    seen = verifying(receiver)
    chat = Receiver().start()
    try:
        d = make_daemon({
            "training": {"command": "echo done", "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                         "on_finish": "none"},
            "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1"), "poll_interval": "0.5s"},
            "stop": {"action": "dry-run"},
            "notify": {"urls": [f"json://127.0.0.1:{chat.port}/chat"],
                       "webhook_url": f"http://127.0.0.1:{receiver.port}/hook",
                       "webhook_secret_file": str(secret_file)},
        })
        assert d.ctl("start").returncode == 0
        wait_until(lambda: seen and chat.got(), 60, what="the webhook and the chat message")
        assert seen[0]["data"]["kind"] == "training_finished" and seen[0]["type"] == "alert.event"
        assert seen[0]["data"]["status"]["training"]["state"] == "FINISHED"  # facts as the alert went out
        assert "training" in chat.got()[0].json()["title"].lower()
        chans = {c["name"]: c for c in d.status()["notify"]["channels"]}
        assert chans["json"]["state"] == chans["webhook"]["state"] == "ok"
        assert chans["webhook"]["target"] == f"http://127.0.0.1:{receiver.port}/***"
    finally:
        chat.stop()
