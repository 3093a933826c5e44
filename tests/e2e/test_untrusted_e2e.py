"""Hostile bytes in the watched folders, through the real daemon (issue 49): one file of each kind
the training user could write beside a good checkpoint. The good units still go up, status
answers at once, the finish stop completes, and no pass fails."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

from supervisor.saves.manifest_doc import FORMAT, ManifestFile, build
from tests.fixtures.hf_writer import HFWriter, safetensors_bytes
from tests.fixtures.inproc import wait_mail
from tests.fixtures.nvml import gpu
from tests.idle.test_idle_e2e import config, lines
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

DEEP = b'{"global_step": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"   # 200 KB, RecursionError in json


def hostile_tree(out: Path) -> dict[str, str]:
    """Checkpoints that each hold one hostile file; unit -> what is wrong with it."""
    w = HFWriter(out)
    w.checkpoint(10)  # the good one
    bad: dict[str, str] = {}
    d = w.checkpoint(20)
    (d / "trainer_state.json").write_bytes(DEEP)
    bad["checkpoint-20"] = "nested 100,000 deep"
    d = w.checkpoint(30)
    (d / "trainer_state.json").write_bytes(b'{"global_step": 1e999, "max_steps": 1e999, "log_history": []}')
    bad["checkpoint-30"] = "global_step 1e999"
    d = w.checkpoint(40)
    header = json.dumps({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, "X"]}}).replace('"X"', "1e999")
    hb = header.encode() + b" " * (-len(header) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + b"\0" * 4)
    bad["checkpoint-40"] = "data_offsets [0, 1e999]"
    d = w.checkpoint(50)
    (d / "zero_pp_rank_99999999999999999999_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    bad["checkpoint-50"] = "a rank number 20 digits long"
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_bytes(b"[" * 50_000)
    (out / "adapter" / "adapter_model.safetensors").write_bytes(safetensors_bytes({"a": 16}))
    bad["adapter"] = "adapter_config.json cut short and deep"
    return bad


def test_hostile_files_beside_a_good_checkpoint_never_stop_the_sync_status_or_the_finish_stop(
        tmp_path, make_daemon, smtp_server, fake_nvml, s3_server, s3_prefix):
    fake_nvml.write([gpu(util=0)])
    out = tmp_path / "out"
    bad = hostile_tree(out)
    go = tmp_path / "go"
    script = tmp_path / "train.py"
    script.write_text(f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n")
    cfg = config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml,
                 training={"command": f"{sys.executable} {script}", "on_finish": "stop", "finish_grace": "2s"},
                 idle={"count_ssh": False, "warn_after": "1h"})
    d = make_daemon(cfg)
    assert d.ctl("start").returncode == 0
    d.wait_training("RUNNING")
    # every unit goes up, the good one complete, each hostile one named and kept
    wait_until(lambda: "checkpoint-10/_MANIFEST.json" in s3_server.objects(s3_prefix), 60,
               what="the good checkpoint's manifest")
    t0 = time.monotonic()
    d.status()
    assert time.monotonic() - t0 < 1.0
    r = d.ctl("status")
    assert r.returncode == 0 and "internal error" not in r.stdout + r.stderr, r.stdout + r.stderr
    go.touch()
    d.wait_training("FINISHED", timeout=60)
    wait_until(lambda: lines(tmp_path / "stopped.txt"), 90, what="the finish stop's action")
    subject, _body = wait_mail(smtp_server, "stopping now (training finished)", timeout=30)
    assert "final sync verified" in subject
    objs = s3_server.objects(s3_prefix)
    for unit in ["checkpoint-10", *bad]:
        assert any(k.startswith(f"{unit}/") for k in objs), (unit, sorted(objs))
    good = json.loads(s3_server.get(f"{s3_prefix}/checkpoint-10/_MANIFEST.json"))
    assert good["format"] == FORMAT and good["complete"] is True
    wait_until(lambda: d.status()["idle"]["state"] == "STOPPED", 30, what="STOPPED")
    # each hostile file is named where the owner looks: its unit's manifest, and status
    for unit, name in [("checkpoint-20", "trainer_state.json"), ("checkpoint-40", "model.safetensors"),
                       ("adapter", "adapter_config.json")]:
        doc = json.loads(s3_server.get(f"{s3_prefix}/{unit}/_MANIFEST.json"))
        assert doc["complete"] is False and doc["damaged"] == [name], (unit, doc)
    partial = d.status()["sync"]["partial"]
    assert {"checkpoint-20", "checkpoint-40", "checkpoint-50"} <= {p.split()[0] for p in partial}, partial
    log = d.log_text()
    assert "sync_iteration_failed" not in log and "Traceback" not in log, log[-4000:]
    assert lines(tmp_path / "stopped.txt") == ["stopped"]


def put_unit(s3, prefix: str, unit: str, files: dict[str, bytes], manifest: bytes | None = None) -> None:
    """A unit on the target as the sync leaves it: its files, then its manifest (or the given bytes)."""
    c = s3.client()
    listed = []
    for name, data in files.items():
        c.put_object(Bucket=s3.bucket, Key=f"{prefix}/{unit}/{name}", Body=data)
        listed.append(ManifestFile(name, len(data), hashlib.sha256(data).hexdigest()))
    doc = manifest if manifest is not None else build(unit, listed, time.time(), host="box-a")
    c.put_object(Bucket=s3.bucket, Key=f"{prefix}/{unit}/_MANIFEST.json", Body=doc)


def test_a_hostile_target_never_kills_the_restore_a_good_checkpoint_beside_it_is_restored(
        tmp_path, make_daemon, s3_server, s3_prefix):
    files = dict(HFWriter(tmp_path / "src").checkpoint_files(10, model_bytes=1000, optimizer_bytes=1000))
    put_unit(s3_server, s3_prefix, "checkpoint-10", files)
    # newer units whose manifest or trainer_state.json no reader may choke on
    put_unit(s3_server, s3_prefix, "checkpoint-30", files, manifest=b'{"files": ' + b"[" * 100_000)
    put_unit(s3_server, s3_prefix, "checkpoint-40", files, manifest=b"[" * 100_000 + b"]" * 100_000)
    put_unit(s3_server, s3_prefix, "checkpoint-50", {**files, "trainer_state.json": b'{"global_step": 1e999}'},
             manifest=b'{"format": "train-supervisor-manifest/1", "complete": true, "files": 7}')
    out = tmp_path / "out"
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('resume from', os.environ.get('TRAIN_SUPERVISOR_RESUME_FROM'))\n")
    d = make_daemon({"training": {"command": f"{sys.executable} {script}", "autostart": True,
                                  "log": str(tmp_path / "train.log")},
                     "sync": {**s3_server.sync_config(s3_prefix), "watch": [str(out)], "quiet_period": "0.3s"},
                     "resume": {"from_target": True}, "alerts": {"first_delay": "0"}})
    d.wait_training("FINISHED", timeout=60)
    st = d.status()["resume"]
    assert st["state"] == "done" and st["result"]["unit"] == "checkpoint-10", st
    skipped = {s["unit"]: s["why"] for s in st["result"]["skipped"]}
    assert {"checkpoint-30", "checkpoint-40", "checkpoint-50"} <= set(skipped), skipped
    assert "nests deeper" in skipped["checkpoint-40"], skipped
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-10").iterdir()} == files
    assert f"resume from {out / 'checkpoint-10'}" in (tmp_path / "train.log").read_text()
    assert "Traceback" not in d.log_text()
