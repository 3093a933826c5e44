"""Issue 23, item 8: the rsync target's /tmp fallback for its SSH control folder. After another run
removed it, a local user (another uid) re-creates it first, open to them or as a symlink to their own
folder: root's ControlMaster socket must never land there (real ssh to the loopback sshd)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from supervisor.config import SyncConfig
from supervisor.config.target import parse_target
from supervisor.store import rsync_ssh
from supervisor.store.rsync import RsyncTarget

STRANGER = 4242   # a uid that is not ours


@pytest.mark.parametrize("planted", ["open-folder", "symlink", "strangers-0700-folder"])
def test_a_control_folder_a_local_user_made_first_is_never_used(sshd_server, tmp_path, monkeypatch, planted):
    if os.geteuid() != 0:
        pytest.skip("needs root: plants the folder as another uid")
    shared = Path(tempfile.mkdtemp(prefix="tsv-"))   # a /tmp of our own (short: a socket path)
    shared.chmod(0o1777)                             # world-writable and sticky, like /tmp
    monkeypatch.setattr(rsync_ssh, "TMP_ROOT", str(shared))
    cfg = SyncConfig(**sshd_server.sync_config(tmp_path / "remote"))
    deep = tmp_path / ("w" * 60) / ("x" * 40) / "sync" / "tmp"   # too long for a socket path: /tmp fallback
    t = RsyncTarget(parse_target(cfg.target), cfg, deep)
    cm = shared / f"tsync-ssh-{os.getuid()}"
    assert t.control_dir == str(cm)
    try:
        out = subprocess.run([*t.ssh_argv(), t.remote_host, "true"], capture_output=True, timeout=30)
        assert out.returncode == 0, out.stderr
        t.close()                           # another run's close() removes the folder ...
        assert not cm.exists()
        own = tmp_path / "theirs"           # ... and a local user makes it again first
        if planted == "symlink":
            own.mkdir(mode=0o777)
            os.chown(own, STRANGER, STRANGER)
            cm.symlink_to(own)
            os.lchown(cm, STRANGER, STRANGER)
        else:
            cm.mkdir(mode=0o700)
            if planted == "open-folder":
                cm.chmod(0o777)
            os.chown(cm, STRANGER, STRANGER)
        argv = t.ssh_argv()
        assert not any("ControlPath" in a for a in argv), argv
        out = subprocess.run([*argv, t.remote_host, "true"], capture_output=True, timeout=30)
        assert out.returncode == 0, out.stderr   # still syncs, without a shared connection
        for d in (cm, own):
            if d.exists():
                assert not [p for p in Path(os.path.realpath(d)).iterdir()], "a socket of ours landed there"
    finally:
        t.close()
        shutil.rmtree(shared, ignore_errors=True)
