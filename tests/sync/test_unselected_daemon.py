"""A nanoGPT-style run whose `out/ckpt.pt` no sync.include glob selects, through the real daemon and a
real S3 server (issue 50, "Not selected, and verified, 0 files"): status, `sync --wait`, the finish
mail and the stop all name it, none says "verified" of the run or "in sync", and the stop waits until
the include is fixed (the daemon restarted with it), then sends it and stops."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.fixtures.daemon import to_toml
from tests.fixtures.inproc import wait_mail
from tests.idle.test_idle_e2e import config, lines, wait_idle
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

REPO = str(Path(__file__).resolve().parents[2])


def test_a_checkpoint_no_include_selects_is_named_everywhere_and_holds_the_stop(tmp_path, make_daemon, smtp_server,
                                                                                 fake_nvml, s3_server, s3_prefix):
    out = tmp_path / "out"
    ckpt = out / "ckpt.pt"
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nsys.path.insert(0, {REPO!r})\nfrom pathlib import Path\n"
                      "from tests.fixtures.hf_writer import torch_zip_bytes\n"
                      "p = Path('out/ckpt.pt')\np.parent.mkdir(exist_ok=True)\n"
                      "p.with_suffix('.tmp').write_bytes(torch_zip_bytes(300_000))\np.with_suffix('.tmp').rename(p)\n"
                      "print('iter 100: loss 1.23')\n")
    cfg = config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml,
                 training={"command": f"{sys.executable} {script}", "on_finish": "stop", "finish_grace": "1s"},
                 idle={"warn_after": "1h"},
                 stop={"final_sync_timeout": "20s"})
    cfg["sync"]["include"] = ["checkpoint-*/**"]   # an HF-only include: the nanoGPT save matches nothing
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    d.wait_training("FINISHED", timeout=60)

    # the finish mail: named, counted, and nothing of the run called verified
    subject, body = wait_mail(smtp_server, "training finished", timeout=60)
    body = body.replace("\r\n", "\n")
    assert "1 file NOT selected for sync" in subject, subject
    assert f"  {ckpt}\n" in body and "NOT SELECTED (stay on this machine): 1 file" in body, body
    assert "NOTHING of this run's output is on" in body and "verified" not in body, body
    assert "sync.include" in body and "WAITS" in body, body

    # status --json and the status screen
    sy = d.status()["sync"]
    assert sy["unselected"] == [str(ckpt)] and sy["unselected_files"] == 1, sy
    assert sy["unselected_bytes"] == ckpt.stat().st_size and sy["unselected_newer"] is True
    text = d.ctl("status").stdout
    assert f"1 file, {_size(ckpt)} in the watched folders is NOT selected: {ckpt}" in text, text

    # sync --wait: never a plain "in sync", and its own exit status
    r = d.ctl("sync", "--wait", "--timeout", "30")
    assert r.returncode == 5, (r.returncode, r.stdout, r.stderr)
    assert "in sync" not in r.stdout and r.stdout.startswith("synced what sync.include selects:"), r.stdout
    assert f"is NOT selected: {ckpt} (add a sync.include glob; see docs/sync.md)" in r.stderr, r.stderr

    # the stop waits: the only copy of the checkpoint is here
    subject, body = wait_mail(smtp_server, "NOT stopping: 1 file", timeout=60)
    body = body.replace("\r\n", "\n")
    assert "NOT selected for sync" in subject and f"  {ckpt}\n" in body, (subject, body)
    assert "stop.stop_even_if_sync_fails" in body and "verified" not in body, body
    st = d.status()
    assert st["idle"]["state"] == "STOPPING" and st["stop"]["phase"] == "final_sync", st["stop"]
    assert not (tmp_path / "stopped.txt").exists()

    # fixed as the mail says: an include that selects it, the daemon restarted; the stop resumes
    d.terminate()
    cfg["sync"]["include"] = ["checkpoint-*/**", "**/*.pt"]
    d.config_path.write_text(to_toml({**_base(d), **cfg}))
    d.start()
    wait_until(lambda: lines(tmp_path / "stopped.txt"), 90, what="the stop once the checkpoint is selected")
    subject, body = wait_mail(smtp_server, "stopping now (training finished)", timeout=30)
    assert "final sync verified, 1 file at" in subject and "NOT selected" not in body, (subject, body)
    assert {"ckpt.pt", "ckpt.pt._MANIFEST.json"} <= set(s3_server.objects(s3_prefix))
    wait_idle(d, lambda i: i["state"] == "STOPPED", what="STOPPED")


def _size(p: Path) -> str:
    from supervisor.durations import format_bytes

    return format_bytes(p.stat().st_size)


def _base(d) -> dict:
    return {"state_dir": str(d.state_dir), "socket": d.socket, "preemption": {"watch": ["none"]}}
