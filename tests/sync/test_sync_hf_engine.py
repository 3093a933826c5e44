"""hf:// through the whole engine, where the engine's own behaviour is what is tested: the Hub's
rate limit (429 + Retry-After) honoured by the backoff with the alert only when it lasts, refused
credentials alerted once and at once, status naming the upload path, and several folders ready at
once landed in one commit with their manifests. The real huggingface_hub client (LFS path) against
the loopback Hub in tests/fixtures/fake_hub.py; time is a FakeClock moved by hand."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from supervisor.cli.render import sync_lines
from supervisor.clock import FakeClock
from supervisor.sync.policy import MANIFEST_NAME
from tests.fixtures.sync_engine import ListMailer
from tests.store.test_sync_hf import TOKEN, assert_on_hub, hf_sync
from tests.waiting import wait_until

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _hf_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")  # the fake Hub speaks LFS, not Xet
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # never the developer's stored token
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def token_file(tmp_path) -> Path:
    p = tmp_path / "hf-token"
    p.write_text(TOKEN + "\n")
    return p


def test_a_long_rate_limit_waits_its_retry_after_and_alerts_only_when_it_lasts(make_engine, hf_writer, fake_hub,
                                                                               token_file):
    hf_writer.checkpoint(1, model_bytes=2 * MiB)
    hf_writer.age(60)
    fake_hub.commit_429, fake_hub.retry_after = 100, "600"  # ten minutes: longer than the client waits inline
    clock, mails = FakeClock(start=time.time()), ListMailer()
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)], "fail_alert_after": "15m",
                     "retry_max_backoff": "1m"}, clock=clock, mailer=mails)
    wait_until(lambda: e.status()["state"] == "failing", 30, what="rate-limited")
    st = e.status()
    assert "rate-limits commit" in st["last_error"] and "600s" in st["last_error"]
    assert st["next_retry_in_s"] == 600, "Retry-After outranks retry_max_backoff"
    tries = len(fake_hub.commit_attempts)
    scans = e.stats["scans"]
    clock.advance(300)  # past the rescan interval: a pass runs, and sends nothing while the Hub said wait
    wait_until(lambda: e.stats["scans"] > scans, 20, what="a rescan during the backoff")
    assert len(fake_hub.commit_attempts) == tries, "retried before Retry-After"
    assert e.status()["next_retry_in_s"] == 300
    clock.advance(301)
    wait_until(lambda: len(fake_hub.commit_attempts) > tries, 20, what="retry after Retry-After")
    wait_until(lambda: e.status()["next_retry_in_s"] == 600, 20, what="backing off again")
    assert not e.alerts.active(), "a rate limit shorter than fail_alert_after is no alert"
    tries = len(fake_hub.commit_attempts)
    clock.advance(601)  # failing for 20 minutes now: past fail_alert_after
    wait_until(lambda: e.alerts.active(), 20, what="sync failing alert")
    # the alert comes from the clock alone; the retry this advance allows is the worker's, and on a loaded
    # machine it came after the next advance below, pushing its Retry-After past the test's last step
    wait_until(lambda: len(fake_hub.commit_attempts) > tries, 20, what="the retry after the second Retry-After")
    wait_until(lambda: e.status()["next_retry_in_s"] == 600, 20, what="backing off a third time")
    e.alerts.tick()
    wait_until(lambda: mails.subjects(), 10, what="alert mail")
    assert mails.subjects()[0].startswith("testbox: sync failing: hf://alice/run1 for 20m"), mails.subjects()
    puts = dict(fake_hub.object_puts)
    fake_hub.commit_429 = 0  # the limit is over
    clock.advance(601)
    wait_until(lambda: e.status()["state"] == "idle", 30, what="recovered")
    assert e.wait_idle(30).ok
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-1", hf_writer.contents["checkpoint-1"])
    assert dict(fake_hub.object_puts) == puts and set(puts.values()) == {1}, "retries re-sent content"
    assert fake_hub.commits("alice/run1") == 1
    wait_until(lambda: len(mails.subjects()) == 2, 10, what="resolved mail")


def test_refused_token_alerts_once_at_once_and_the_worker_lives(make_engine, hf_writer, fake_hub, token_file):
    fake_hub.users["hf_readonly"] = {"name": "alice", "role": "read", "orgs": []}
    hf_writer.checkpoint(4)
    hf_writer.age(60)
    token_file.write_text("hf_WRONG_SECRET\n")
    clock, mails = FakeClock(start=time.time()), ListMailer()
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)], "fail_alert_after": "1h"},
                    clock=clock, mailer=mails)
    wait_until(lambda: e.alerts.active(), 30, what="an alert without waiting for fail_alert_after")
    e.alerts.tick()
    wait_until(lambda: mails.subjects(), 10, what="refused mail")
    subject, body = mails.sent[0]
    assert subject == "testbox: sync refused: hf://alice/run1 rejects the credentials"
    assert "rejected the token from sync.hf_token_file" in body and "401" in body
    assert "hf_WRONG_SECRET" not in subject + body + json.dumps(e.status())
    # a read-only token: still refused, the same alert (no second mail), now naming the missing write access
    fake_hub.make_repo("alice/run1", private=True)
    token_file.write_text("hf_readonly\n")
    for i in range(3):
        clock.advance(400)  # past the backoff: it tries again, and is refused again
        wait_until(lambda i=i: e.health.backoff.failures == 2 + i, 20, what="another refused try")
        e.alerts.tick()
    assert e.thread is not None and e.thread.is_alive(), "the worker must survive"
    wait_until(lambda: "has no write access" in e.status()["last_error"], 10, what="403 named")
    assert [a["subject"] for a in e.alerts.active()] == ["sync refused: hf://alice/run1 rejects the credentials"]
    assert len(mails.subjects()) == 1, mails.subjects()
    token_file.write_text(TOKEN + "\n")
    e.request_sync()
    assert e.wait_idle(60).ok
    assert_on_hub(fake_hub, "alice/run1", "checkpoint-4", hf_writer.contents["checkpoint-4"])
    assert not e.alerts.active()
    e.alerts.tick()
    wait_until(lambda: len(mails.subjects()) == 2, 10, what="resolved mail")
    assert "RESOLVED" in mails.subjects()[1]


def test_folders_ready_together_land_in_one_commit_and_status_names_the_path(make_engine, hf_writer, fake_hub,
                                                                            token_file):
    for step in (10, 20, 30):
        hf_writer.checkpoint(step, model_bytes=MiB)
    hf_writer.adapter("lora")
    hf_writer.age(60)
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    history = fake_hub.history("alice/run1")
    assert len(history) == 2, [c.summary for c in history]  # the repo's first commit, then ours
    head = history[-1]
    assert head.summary.startswith("4 units: ")
    for unit in ("checkpoint-10", "checkpoint-20", "checkpoint-30", "lora"):
        assert_on_hub(fake_hub, "alice/run1", unit, hf_writer.contents[unit])
        assert e.ledger.manifest(unit)["commit"] == head.oid
        assert f"{unit}/{MANIFEST_NAME}" in head.tree
    st = e.status()
    assert st["target_info"]["upload_path"] == "lfs" and st["target_info"]["private"] is True
    assert "          via LFS (HF_HUB_DISABLE_XET is set)  model repo private, branch main" in \
        sync_lines({"now": time.time(), "sync": st})
    assert TOKEN not in json.dumps(st)
    # a later checkpoint alone: a commit of its own, named after it
    hf_writer.checkpoint(40, model_bytes=MiB)
    hf_writer.age(60, hf_writer.out / "checkpoint-40")
    assert e.wait_idle(60).ok
    assert fake_hub.history("alice/run1")[-1].summary.startswith("checkpoint-40: step 40")
    assert fake_hub.commits("alice/run1") == 2


def test_backoff_never_retries_before_retry_after_nor_parks_for_days():
    from supervisor.sync.backoff import RETRY_AFTER_MAX_S, Backoff

    b = Backoff()
    assert b.failed(100.0, cap=60.0, jitter=1.0, retry_after=600.0) == 600.0  # past the cap: the Hub said so
    assert b.failed(700.0, cap=60.0, jitter=1.0, retry_after=1.0) == 4.0      # the backoff's own, when longer
    assert b.failed(704.0, cap=60.0, jitter=1.0, retry_after=1e9) == RETRY_AFTER_MAX_S
    assert b.failed(800.0, cap=60.0, jitter=0.5) == 8.0 and b.failing_for(800.0) == 700.0


def test_twins_in_one_batch_go_up_once(make_engine, hf_writer, fake_hub, token_file):
    """Two checkpoints whose training_args.bin and rng_state.pth are the same bytes, ready at once:
    one LFS PUT per distinct sha256, both folders complete on the Hub (issue 23)."""
    import hashlib

    hf_writer.checkpoint(1)
    hf_writer.checkpoint(2)
    for name in ("training_args.bin", "rng_state.pth"):
        same = hf_writer.contents["checkpoint-1"][name]
        (hf_writer.out / "checkpoint-2" / name).write_bytes(same)
        hf_writer.contents["checkpoint-2"][name] = same
    hf_writer.age(60)
    e = make_engine({**hf_sync(fake_hub, token_file), "watch": [str(hf_writer.out)]})
    assert e.wait_idle(60).ok
    for unit in ("checkpoint-1", "checkpoint-2"):
        assert_on_hub(fake_hub, "alice/run1", unit, hf_writer.contents[unit])
    assert len(fake_hub.history("alice/run1")) == 2, "both units in one commit (one batch)"
    assert set(fake_hub.object_puts.values()) == {1}, fake_hub.object_puts
    lfs = {hashlib.sha256(data).hexdigest() for c in hf_writer.contents.values() for n, data in c.items()
           if n.endswith((".bin", ".pt", ".pth", ".safetensors"))}
    assert set(fake_hub.object_puts) == lfs
