"""The whole flow through the daemon, on SeaweedFS: machine A trains (examples/tiny_trainer.py, a
CPU job shaped like the HF Trainer) and syncs; once checkpoint-20 is on the target, A dies (daemon
and training killed, no final sync), and a half-uploaded checkpoint-30 (no manifest) lies on the
target. "Machine B" (a fresh state dir, an empty output folder, the same config with autostart)
restores checkpoint-20 byte-identical, skips checkpoint-30 naming it, starts the training with
TRAIN_SUPERVISOR_RESUME_FROM, whose log shows it continuing from global step 20, and the run
finishes with its later checkpoints on the target beside checkpoint-20, whose objects are not
rewritten. A real HF Trainer + PEFT is not used here (no torch in CI): the tiny trainer reads the
variable the way `trainer.train(resume_from_checkpoint=...)` does and logs the Trainer's words."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from supervisor.resume.gate import ENV
from tests.fixtures.procs import kill_under
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "examples" / "tiny_trainer.py"


def config(s3, prefix: str, out: Path, step_time: float, autostart: bool) -> dict:
    cmd = f"{sys.executable} {TRAINER} --output {out} --steps 40 --save-steps 10 --step-time {step_time} " \
          "--logging-steps 5"
    return {"hostname": "box-b" if autostart else "box-a",
            "training": {"command": cmd, "autostart": autostart},
            "sync": {**s3.sync_config(prefix), "watch": [str(out)], "quiet_period": "0.3s", "rescan_interval": "1s"},
            "resume": {"from_target": True}, "alerts": {"first_delay": "0"}}


def manifests(s3, prefix: str) -> set[str]:
    return {k.split("/")[0] for k in s3.objects(prefix) if k.endswith("/_MANIFEST.json")}


def test_a_killed_machines_run_continues_on_a_fresh_one_from_its_newest_complete_checkpoint(
        make_daemon, s3_server, s3_prefix, tmp_path):
    out_a, out_b = tmp_path / "a-out", tmp_path / "b-out"
    a = make_daemon(config(s3_server, s3_prefix, out_a, 0.3, autostart=False), sub="a")
    started = a.req("start")
    assert started.get("resuming")  # nothing local: the target is asked first (empty: a first run)
    wait_until(lambda: "checkpoint-20" in manifests(s3_server, s3_prefix), 40, interval=0.2,
               what="checkpoint-20 on the target")
    assert a.status()["resume"]["state"] == "fresh"
    # machine A dies: the daemon and the training, no final sync
    a.kill9()
    subprocess.run(["tmux", "-S", str(a.state_dir / "tmux.sock"), "kill-server"], capture_output=True)
    kill_under(a.tmp, settle=0)
    assert "checkpoint-30" not in manifests(s3_server, s3_prefix)
    c = s3_server.client()
    for name in ("model.safetensors", "config.json"):  # half of checkpoint-30, as a crash mid-upload leaves it
        c.put_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/checkpoint-30/{name}",
                     Body=(out_a / "checkpoint-20" / name).read_bytes())
    on_target = {n: s3_server.get(f"{s3_prefix}/checkpoint-20/{n}")
                 for n in (k.split("/", 1)[1] for k in s3_server.objects(s3_prefix) if k.startswith("checkpoint-20/"))
                 if n != "_MANIFEST.json"}
    head = {k: c.head_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/{k}")["LastModified"]
            for k in s3_server.objects(s3_prefix) if k.startswith("checkpoint-20/")}

    b = make_daemon(config(s3_server, s3_prefix, out_b, 0.05, autostart=True), sub="b")
    b.wait_training("FINISHED", timeout=60)
    st = b.status()["resume"]
    assert st["state"] == "done", st
    assert st["result"]["unit"] == "checkpoint-20"
    assert st["result"]["skipped"] == [{"unit": "checkpoint-30", "why": "no _MANIFEST.json: a partial upload"}]
    assert st["line"].startswith("resumed on box-b from checkpoint-20 (step 20 of 40), saved ")
    assert " on box-a; lost since that save: ~" in st["line"]
    assert st["resume_from"] == str(out_b / "checkpoint-40")  # the next start would get the newest one
    restored = {p.name: p.read_bytes() for p in (out_b / "checkpoint-20").iterdir()}
    assert restored == on_target
    log = Path(b.status()["training"]["log"]).read_text()
    assert "Continuing training from global step 20" in log
    wait_until(lambda: {"checkpoint-30", "checkpoint-40"} <= manifests(s3_server, s3_prefix), 30, interval=0.2,
               what="the resumed run's checkpoints on the target")
    assert {k: c.head_object(Bucket=s3_server.bucket, Key=f"{s3_prefix}/{k}")["LastModified"]
            for k in s3_server.objects(s3_prefix) if k.startswith("checkpoint-20/")} == head
    state = json.loads(s3_server.get(f"{s3_prefix}/checkpoint-40/trainer_state.json"))
    assert state["global_step"] == 40
    mails = [r["subject"] for r in b.req("alerts")["recent"]]
    assert any("resumed on box-b from checkpoint-20" in s for s in mails), mails
    listing = b.ctl("resume", "--list")
    assert listing.returncode == 0 and "checkpoint-40" in listing.stdout, listing
    dry = b.ctl("resume", "--dry-run")
    assert dry.returncode == 0 and f"would restore checkpoint-40 (step 40) -> {out_b / 'checkpoint-40'}" in dry.stdout
    again = b.ctl("resume", "--checkpoint", "checkpoint-20")
    assert again.returncode == 0 and "already here checkpoint-20" in again.stdout, again
    assert "resume    resumed on box-b from checkpoint-20" in b.ctl("status").stdout


def test_the_training_gets_the_newest_local_checkpoint_and_no_stale_variable(make_daemon, tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / "checkpoint-7").mkdir(parents=True)
    (out / "checkpoint-7" / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    (out / "checkpoint-9").mkdir()  # no trainer_state.json: not complete
    probe = tmp_path / "env.txt"
    cmd = f"{sys.executable} -c \"import os; open('{probe}', 'w').write(os.environ.get('{ENV}', 'UNSET'))\""
    d = make_daemon({"training": {"command": cmd},
                     "sync": {"target": str(tmp_path / "remote"), "watch": [str(out)]}}, sub="d")
    d.req("start")
    d.wait_training("FINISHED")
    assert probe.read_text() == str(out / "checkpoint-7")
    (out / "checkpoint-7" / "trainer_state.json").unlink()
    d.env[ENV] = "/stale/from/the/daemon/env"
    d.terminate()
    d.start()
    d.req("start")
    wait_until(lambda: d.status()["training"]["run_id"] == 2 and d.status()["training"]["state"] == "FINISHED", 20)
    assert probe.read_text() == "UNSET"
