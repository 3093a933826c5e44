"""Where a machine finds out where it is (issue 52): the real default path /sys/class/dmi/id, faked in a
private mount namespace (a tmpfs over /sys/class, a fake tree bind-mounted on dmi/id), read by a
real process; and on a plain machine nothing at all is called: Python's own audit events (socket
connects, name lookups) are recorded in a fresh interpreter and must stay empty."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                   reason="needs unshare (util-linux) as root")

# choose() as the daemon calls it (default DMI root, PID 1's environment), with every socket
# connect and name lookup it makes recorded through the interpreter's audit hook
PROBE = """
import json, sys
calls = []
sys.addaudithook(lambda ev, args: calls.append([ev, repr(args)[:120]])
                 if ev in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "urllib.Request") else None)
from supervisor.config import from_dict
from supervisor.stop.resolve import choose
cfg = from_dict({"state_dir": "/tmp/x", "stop": json.loads(sys.argv[1])}).stop
plan = choose(cfg, json.loads(sys.argv[2]), quiet=True)
print(json.dumps({"block": plan.block(), "calls": calls}))
"""


def probe(stop: dict, env: dict, prefix: list[str] | None = None) -> dict:
    argv = [*(prefix or []), sys.executable, "-c", PROBE, json.dumps(stop), json.dumps(env)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)})
    if prefix and r.returncode != 0 and ("mount" in r.stderr or "cannot change root filesystem propagation" in r.stderr):
        # a chroot (fresh-machine's) has no mount of its own to make private
        pytest.skip(f"cannot make a private mount namespace here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_plain_machine_calls_nothing(tmp_path):
    if Path("/sys/class/dmi/id").exists():
        from supervisor.stop.providers import detect

        if detect.by_dmi(detect.dmi_words()) is not None:
            pytest.skip("this test machine is itself a cloud VM (its DMI words name a provider)")
    out = probe({}, {})
    assert out["calls"] == [], out
    assert out["block"]["name"] is None and out["block"]["action"] == "poweroff"
    # a named provider whose credential is missing is not called either
    out = probe({"provider": "runpod", "instance_id": "p1"}, {})
    assert out["calls"] == [] and "RUNPOD_API_KEY" in out["block"]["credential"], out


def in_fake_dmi(tree: Path) -> list[str]:
    """A prefix that runs the rest in a private mount namespace where /sys/class/dmi/id is `tree`."""
    script = ("mount -t tmpfs tmpfs /sys/class && mkdir -p /sys/class/dmi/id && "
              f"mount --bind {tree} /sys/class/dmi/id && exec \"$@\"")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


@needs_unshare
def test_gcp_found_by_the_real_dmi_path_in_a_private_mount_namespace(tmp_path, stand_in):
    tree = tmp_path / "dmi"
    tree.mkdir()
    (tree / "sys_vendor").write_text("Google\n")
    (tree / "product_name").write_text("Google Compute Engine\n")
    s = stand_in("gcp")
    out = probe({"metadata_url": s.metadata_url, "api_url": s.api_url}, {}, in_fake_dmi(tree))
    b = out["block"]
    assert b["name"] == "gcp" and b["detected_by"] == "DMI product_name Google Compute Engine", b
    assert b["action"] == "provider" and b["instance"] == "train-1" and b["ends_billing"] is True
    assert b["line"] == "Google Compute Engine API, VM train-1 (ends compute billing; persistent disks and " \
                        "static IPs still billed)"
    # the metadata service was asked with its header (the stand-in refuses any request without it)
    md = [(m, p) for m, p, _, _ in s.calls if p.startswith("/computeMetadata")]
    assert ("GET", "/computeMetadata/v1/instance/service-accounts/default/token") in md
    assert s.mutations() == []
    assert any(ev == "socket.connect" for ev, _ in out["calls"])   # the probe does see a call when one is made


@needs_unshare
def test_azure_found_by_its_asset_tag_warns_when_no_managed_identity_answers(tmp_path):
    tree = tmp_path / "dmi"
    tree.mkdir()
    (tree / "chassis_asset_tag").write_text("7783-7084-3265-9085-8269-3286-77\n")
    (tree / "sys_vendor").write_text("Microsoft Corporation\n")
    from tests.fixtures.smtp import free_port

    nothing = f"http://127.0.0.1:{free_port()}"   # the metadata service does not answer
    out = probe({"metadata_url": nothing}, {}, in_fake_dmi(tree))
    b = out["block"]
    assert b["name"] == "azure" and b["action"] == "poweroff" and b["ends_billing"] is False
    assert "billed in full" in b["warning"] and "managed identity" in b["warning"]
    # asked only the metadata service it was pointed at, once per piece, with the 1 s timeout
    assert all("127.0.0.1" in c[1] for c in out["calls"] if c[0] == "socket.connect"), out["calls"]
