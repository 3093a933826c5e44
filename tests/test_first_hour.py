"""The first hour on a rented box (issue 29), end to end through a real train-supervisord, driven
from outside as a new user would: a run folder one level inside the watched folder, a target with
nothing watched, `supervisorctl run` from a user's shell, the target down when the training ends.
Every wait is on a condition with a deadline."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_until

pytestmark = [pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]

REPO = str(Path(__file__).resolve().parents[1])


def wait_mail(smtp, text: str, timeout: float = 30) -> tuple[str, str]:
    def find():
        for m in list(smtp.messages):
            subject = str(m["Subject"]).replace("\r\n", "")
            if text in subject:
                return subject, m.get_payload(decode=True).decode("utf-8", "replace")
        return None
    return wait_until(find, timeout, interval=0.1, what=f"a mail with {text!r}; got {smtp.subjects()}")


def writer_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text("import sys\n"
                      f"sys.path.insert(0, {REPO!r})\n"
                      "from pathlib import Path\n"
                      "from tests.fixtures.hf_writer import HFWriter\n" + body)
    return script


def base_config(tmp_path: Path, smtp, fake_nvml, **sections) -> dict:
    cfg = {
        "training": {"command": "sleep 600", "workdir": str(tmp_path), "log": str(tmp_path / "train.log"),
                     "on_finish": "stop", "finish_grace": "1s"},
        "gpu": {"nvml_library": fake_nvml.lib_path, "poll_interval": "0.2s"},
        "idle": {"poll_interval": "0.3s", "count_ssh": False, "count_training_output": False},
        "stop": {"action": "command", "command": f"echo stopped >> {tmp_path / 'stopped.txt'}",
                 "retry_interval": "1s", "final_sync_timeout": "5s"},
        "email": {"to": ["me@example.com"], "from": "sup@gpu-box", "smtp_host": "127.0.0.1",
                  "smtp_port": smtp.port, "security": "none"},
        "alerts": {"first_delay": "0s"},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def test_a_run_folder_inside_the_watched_folder_is_synced_and_named(tmp_path, make_daemon, smtp_server,
                                                                     fake_nvml):
    """watch = out, output_dir = out/tiny: the nested checkpoints go up with their manifests, the
    mails name the newest checkpoint of each run folder, and a checkpoint folder the include
    patterns leave out is named in status and in the finished and stopping mails."""
    out, target = tmp_path / "out", tmp_path / "target"
    out.mkdir()
    script = writer_script(tmp_path, f"HFWriter(Path({str(out / 'tiny')!r})).checkpoint(5)\n"
                                     f"HFWriter(Path({str(out / 'tiny')!r})).checkpoint(10)\n"
                                     f"HFWriter(Path({str(out / 'old')!r})).checkpoint(1)\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": f"{sys.executable} {script}"},
                      sync={"target": str(target), "watch": [str(out)], "quiet_period": "1s",
                            "exclude": ["old/checkpoint-1/**"]},
                      stop={"final_sync": [str(out)]})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    d.wait_training("FINISHED", timeout=60)
    subject, body = wait_mail(smtp_server, "training finished")
    assert "final sync verified" in body, body
    assert "tiny/checkpoint-10" in body and "tiny/checkpoint-5\n" not in body, body
    assert "NOT synced" in body and str(out / "old" / "checkpoint-1") in body, body
    for step in (5, 10):
        assert (target / "tiny" / f"checkpoint-{step}" / "_MANIFEST.json").is_file()
        assert (target / "tiny" / f"checkpoint-{step}" / "trainer_state.json").is_file()
    assert not (target / "old").exists()
    st = d.status()
    assert st["sync"]["unselected"] == [str(out / "old" / "checkpoint-1")]
    assert "NOT SYNCED" in d.ctl("status").stdout
    subject, body = wait_mail(smtp_server, "stopping now (training finished)")
    assert "tiny/checkpoint-10" in body and str(out / "old" / "checkpoint-1") in body, body


def test_a_target_with_nothing_watched_watches_the_workdir_or_the_daemon_refuses(tmp_path, make_daemon, smtp_server,
                                                                                  fake_nvml):
    """Never "in sync, 0 files" while checkpoints sit on the machine: with no sync.watch the
    training's workdir is watched (its checkpoints reach the target and `sync --wait` says so);
    with no workdir either, check-config and the daemon refuse the config, naming sync.watch."""
    work, target = tmp_path / "work", tmp_path / "target"
    work.mkdir()
    script = writer_script(tmp_path, "HFWriter(Path('run')).checkpoint(3)\n")
    cfg = base_config(tmp_path, smtp_server, fake_nvml,
                      training={"command": f"{sys.executable} {script}", "workdir": str(work),
                                "on_finish": "none"},
                      sync={"target": str(target), "quiet_period": "1s"})
    d = make_daemon(cfg)
    assert "sync.watch not set: watching" in d.ctl("check-config").stdout
    assert d.status()["sync"]["watch"] == [str(work)]
    assert d.ctl("start").returncode == 0
    d.wait_training("FINISHED", timeout=60)
    r = d.ctl("sync", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "run" / "checkpoint-3" / "_MANIFEST.json").is_file()

    bad = base_config(tmp_path, smtp_server, fake_nvml, training={"command": "python train.py", "workdir": ""},
                      sync={"target": str(target)})
    b = make_daemon(bad, start=False, sub="bad")
    r = b.ctl("check-config")
    assert r.returncode == 2 and "sync.watch: empty" in r.stderr, r.stderr
    b.start(wait=False)
    assert b.proc.wait(30) == 2
    assert "sync.watch: empty" in b.log_text()
