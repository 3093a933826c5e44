"""The end-to-end resume with a real Hugging Face Trainer + PEFT (LoRA) run on the CPU
(tests/fixtures/hf_peft_train.py), through the daemon, on SeaweedFS: machine A trains and syncs and
is killed after checkpoint-20 is on the target; a half-uploaded checkpoint-30 (no manifest) lies
there; machine B (a fresh state dir, an empty output folder) restores checkpoint-20 byte-identical,
skips checkpoint-30, starts the training, and the Trainer's own log says it resumed at global step
20; the run finishes with checkpoint-30 and -40 on the target and checkpoint-20 not rewritten.

Needs torch, transformers and peft: in this interpreter, or in the one named by TSUP_HF_PYTHON
(e.g. a venv made with `pip install torch==2.13.0 transformers peft accelerate`); skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.procs import kill_under
from tests.waiting import wait_until

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "hf_peft_train.py"


def hf_python() -> str | None:
    for py in filter(None, [os.environ.get("TSUP_HF_PYTHON"), sys.executable]):
        r = subprocess.run([py, "-c", "import torch, transformers, peft"], capture_output=True, timeout=120)
        if r.returncode == 0:
            return py
    return None


PY = hf_python()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PY is None, reason="torch, transformers and peft are not installed "
                                                    "(set TSUP_HF_PYTHON to an interpreter that has them)")]


def config(s3, prefix: str, out: Path, host: str, slow_after: int, autostart: bool) -> dict:
    return {"hostname": host,
            "training": {"command": f"{PY} {SCRIPT} {out} 40 {slow_after}", "autostart": autostart,
                         "env": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
            "sync": {**s3.sync_config(prefix), "watch": [str(out)], "quiet_period": "0.3s", "rescan_interval": "1s"},
            "resume": {"from_target": True}, "alerts": {"first_delay": "0"}}


def manifests(s3, prefix: str) -> set[str]:
    return {k.split("/")[0] for k in s3.objects(prefix) if k.endswith("/_MANIFEST.json")}


def test_a_real_trainer_with_peft_continues_from_global_step_20_on_a_fresh_machine(
        make_daemon, s3_server, s3_prefix, tmp_path):
    out_a, out_b = tmp_path / "a-out", tmp_path / "b-out"
    a = make_daemon(config(s3_server, s3_prefix, out_a, "box-a", 20, autostart=False), sub="a")
    a.req("start")
    wait_until(lambda: "checkpoint-20" in manifests(s3_server, s3_prefix), 120, interval=0.2,
               what="checkpoint-20 on the target")
    a.kill9()
    subprocess.run(["tmux", "-S", str(a.state_dir / "tmux.sock"), "kill-server"], capture_output=True)
    kill_under(a.tmp, settle=0)
    assert "checkpoint-30" not in manifests(s3_server, s3_prefix)
    c = s3_server.client()
    c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/checkpoint-30/adapter_model.safetensors",
                 Body=(out_a / "checkpoint-20" / "adapter_model.safetensors").read_bytes()[:1000])
    on_target = {k.split("/", 1)[1]: s3_server.get(f"{s3_prefix}/{k}") for k in s3_server.objects(s3_prefix)
                 if k.startswith("checkpoint-20/") and not k.endswith("_MANIFEST.json")}
    head = {k: c.head_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/{k}")["LastModified"]
            for k in s3_server.objects(s3_prefix) if k.startswith("checkpoint-20/")}

    b = make_daemon(config(s3_server, s3_prefix, out_b, "box-b", 0, autostart=True), sub="b")
    tr = b.wait_training("FINISHED", timeout=180)
    assert tr["exit_code"] == 0
    st = b.status()["resume"]
    assert st["state"] == "done" and st["result"]["unit"] == "checkpoint-20", st
    assert [s["unit"] for s in st["result"]["skipped"]] == ["checkpoint-30"]
    assert st["line"].startswith("resumed on box-b from checkpoint-20 (step 20 of 40)")
    assert {p.name: p.read_bytes() for p in (out_b / "checkpoint-20").iterdir()} == on_target
    log = Path(tr["log"]).read_text()
    assert "Resuming training from checkpoint with epoch 0 and global step 20" in log or \
        "Continuing training from global step 20" in log  # transformers 5.x / 4.x
    wait_until(lambda: {"checkpoint-30", "checkpoint-40"} <= manifests(s3_server, s3_prefix), 60, interval=0.2,
               what="the resumed run's checkpoints on the target")
    assert {k: c.head_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/{k}")["LastModified"]
            for k in s3_server.objects(s3_prefix) if k.startswith("checkpoint-20/")} == head
