"""check-config's warnings for what is allowed but will not do what the owner expects (issue 37,
finding 8 and the rotation hint): `poweroff` inside a container, naming the provider's own stop,
a checkpoint rotation that can outrun the target, and no systemctl hint where no systemd runs.

The container side is real: supervisorctl runs in a mount namespace whose /run has no
systemd (a container) or has /run/systemd/system (a systemd machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import from_dict
from supervisor.config.hints import in_container, provider, rotation_warning, stop_warning

CTL = str(Path(sys.executable).with_name("supervisorctl"))


def cfg(**top):
    return from_dict({"state_dir": "/var/lib/train-supervisor", **top})


def test_poweroff_in_a_container_names_the_providers_stop():
    c = cfg()
    runpod = stop_warning(c, {"RUNPOD_POD_ID": "abc123"}, container=True)
    assert "RunPod container" in runpod and '"runpodctl stop pod $RUNPOD_POD_ID"' in runpod
    assert 'stop.action = "command"' in runpod
    vast = stop_warning(c, {"CONTAINER_ID": "7"}, container=True)
    assert "vast.ai container" in vast and "vastai stop instance $CONTAINER_ID" in vast
    assert provider({"VAST_CONTAINERLABEL": "C.7"}).name == "vast.ai"
    unknown = stop_warning(c, {}, container=True)
    assert "no systemd runs here" in unknown and "runpodctl" in unknown and "vastai" in unknown
    assert stop_warning(c, {"RUNPOD_POD_ID": "abc123"}, container=False) == ""
    assert stop_warning(cfg(stop={"action": "command", "command": "runpodctl stop pod x"}),
                        {"RUNPOD_POD_ID": "x"}, container=True) == ""
    assert stop_warning(cfg(stop={"action": "dry-run"}), {}, container=True) == ""


def test_a_rotation_that_can_outrun_the_target_is_named():
    t = {"target": "s3://bucket/run", "watch": ["/workspace/out"]}
    w = rotation_warning(cfg(sync=t, training={"command": "python train.py --save_total_limit=2 --output_dir out"}))
    assert "--save_total_limit 2" in w and "s3://bucket/run" in w and 'disk.prune = "synced"' in w
    assert rotation_warning(cfg(sync=t, training={"command": "python train.py --save-total-limit 5"}))
    assert rotation_warning(cfg(sync=t, training={"command": "python train.py"})) == ""
    assert rotation_warning(cfg(training={"command": "python train.py --save_total_limit 2"})) == ""  # no target


def test_in_container_reads_the_root_it_is_given(tmp_path):
    assert in_container(str(tmp_path))
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    assert not in_container(str(tmp_path))


needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                   reason="needs unshare (util-linux) as root")


def in_namespace(systemd: bool, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """argv in a mount namespace whose /run is a fresh tmpfs, with or without systemd's marker."""
    mark = "mkdir -p /run/systemd/system && " if systemd else ""
    script = f'mount -t tmpfs tmpfs /run && {mark}exec "$@"'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                       capture_output=True, text=True, timeout=60, env=env)
    if ("mount:" in r.stderr and "permission denied" in r.stderr.lower()) or \
            r.stderr.startswith("unshare: cannot change root filesystem propagation"):
        # a chroot (fresh-machine's) has no mount of its own to make private
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace here: {r.stderr.strip()[-200:]}")
    return r


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TRAIN_SUPERVISOR_") and k not in ("RUNPOD_POD_ID", "CONTAINER_ID", "VAST_CONTAINERLABEL",
                                                                  "RUNPOD_API_KEY", "CONTAINER_API_KEY")}
    return {**env, **extra}


@needs_unshare
def test_check_config_warns_in_a_container_and_not_on_a_systemd_machine(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('state_dir = "/var/lib/train-supervisor"\n')
    r = in_namespace(False, [CTL, "check-config", str(p)], _env(RUNPOD_POD_ID="pod42"))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    # the default "auto" stop has no RunPod key here: it falls back to poweroff, which does nothing to a pod
    assert "warning: stop.action = \"auto\": this is a RunPod pod (env RUNPOD_POD_ID)" in r.stderr, r.stderr
    assert "runpodctl stop pod $RUNPOD_POD_ID" in r.stderr and "RUNPOD_API_KEY" in r.stderr
    assert "stop: poweroff, pod pod42 (does NOT end billing here; the whole pod bills on)" in r.stdout
    p.write_text('state_dir = "/var/lib/train-supervisor"\n[stop]\naction = "poweroff"\n')
    r = in_namespace(False, [CTL, "check-config", str(p)], _env())
    assert "warning: stop.action = \"poweroff\": no systemd runs here" in r.stderr, r.stderr
    r = in_namespace(True, [CTL, "check-config", str(p)], _env())
    assert r.returncode == 0 and "poweroff" not in r.stderr, r.stderr


@needs_unshare
def test_no_systemctl_hint_where_no_systemd_runs(tmp_path):
    sock = str(tmp_path / "nobody.sock")
    hint = "(is the daemon running? "
    r = in_namespace(False, [CTL, "--socket", sock, "status"], _env())
    assert r.returncode == 4 and f"{hint}start it with train-supervisor-start)" in r.stderr, r.stderr
    r = in_namespace(True, [CTL, "--socket", sock, "status"], _env())
    assert r.returncode == 4 and "systemctl status train-supervisor" in r.stderr, r.stderr
