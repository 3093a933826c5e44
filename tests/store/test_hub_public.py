"""Issue 23, item 6: an existing public hf:// repo receives nothing. The real daemon, the loopback fake
Hub (real huggingface_hub client, LFS path) with a public repo made beforehand, mails read back from a
real SMTP server; check-config says it too, having asked the Hub."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.store.test_sync_hf import TOKEN, hf_sync
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@pytest.fixture(autouse=True)
def _hf_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")  # the fake Hub speaks LFS, not Xet
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


def test_a_public_repo_is_refused_with_a_mail_naming_it_and_the_key(tmp_path: Path, make_daemon, fake_hub,
                                                                     hf_writer, smtp_server):
    fake_hub.make_repo("alice/open", private=False)
    commits0 = fake_hub.commits("alice/open")
    token = tmp_path / "hf-token"
    token.write_text(TOKEN + "\n")
    hf_writer.checkpoint(1)
    hf_writer.age(60)
    d = make_daemon({
        "training": {"command": "sleep 300", "workdir": str(tmp_path), "on_finish": "none"},
        "gpu": {"nvml_library": str(tmp_path / "none.so")},
        "stop": {"action": "dry-run"},
        "sync": {**hf_sync(fake_hub, token, "hf://alice/open"), "watch": [str(hf_writer.out)],
                 "quiet_period": "1s"},
        "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                  "smtp_port": smtp_server.port, "security": "none"},
        "alerts": {"first_delay": "0s"},
    })

    def refusal():
        for m in list(smtp_server.messages):
            if "public repo" in str(m["Subject"]):
                return str(m["Subject"]), m.get_payload(decode=True).decode()
        return None
    subject, body = wait_until(refusal, 30, interval=0.2, what=f"the refusal mail; got {smtp_server.subjects()}")
    assert "hf://alice/open" in subject
    assert "alice/open" in body and "sync.hf_allow_public = true" in body
    assert TOKEN not in body
    sync = d.status()["sync"]
    assert sync["state"] == "failing" and "public" in json.dumps(sync), sync
    assert fake_hub.commits("alice/open") == commits0, "nothing may be committed to the public repo"
    assert not fake_hub.object_puts, "no byte may be sent to the public repo"

    r = d.ctl("check-config")
    assert r.returncode == 0, r.stderr
    assert "alice/open is a public repo" in r.stderr and "sync.hf_allow_public = true" in r.stderr, r.stderr
