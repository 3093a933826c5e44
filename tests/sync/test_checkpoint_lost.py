"""A checkpoint deleted before it left the machine (issue 37): the trainer's rotation deletes the
oldest checkpoint while the target refuses our keys. A real S3 server refusing, real Trainer-shaped
folders; the alert comes at the next scan, naming the folder and the rotation in the command."""

from __future__ import annotations

import shutil

from supervisor.sync.lost import likely_cause, vanished
from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.sync_engine import ListMailer
from tests.waiting import wait_until


def test_a_checkpoint_rotated_away_before_it_went_up_is_alerted_at_once(tmp_path, make_engine, s3_server, s3_prefix):
    out = tmp_path / "out"
    w = HFWriter(out)
    w.checkpoint(10)
    w.checkpoint(20)
    bad = tmp_path / "bad-credentials"
    bad.write_text("[default]\naws_access_key_id = tsupervisor\naws_secret_access_key = wrong-secret\n")
    mailer = ListMailer()
    sync = {**s3_server.sync_config(s3_prefix, watch=[str(out)]), "credentials_file": str(bad)}
    e = make_engine(sync, mailer=mailer,
                    training={"command": "python train.py --output_dir out --save_total_limit 1"})
    wait_until(lambda: e.status()["state"] == "failing", 30, what="the target refusing")
    wait_until(lambda: e.status()["pending_files"] > 0, 30, what="both checkpoints seen")
    shutil.rmtree(out / "checkpoint-10")  # what the Trainer's rotation does at its next save
    e.request_sync()
    wait_until(lambda: any(a["key"].startswith("sync:lost:") for a in e.alerts.active()), 30, what="the lost alert")
    e.alerts.tick()  # the daemon's duty delivers; here the test is the daemon
    wait_until(lambda: any("checkpoint LOST: checkpoint-10" in s for s in mailer.subjects()), 10,
               what="the lost-checkpoint mail")
    body = next(b for s, b in mailer.sent if "LOST" in s)
    assert str(out / "checkpoint-10") in body and "--save_total_limit 1" in body and "disk.prune" in body
    lost = e.status()["lost"]
    assert [x["unit"] for x in lost] == ["checkpoint-10"] and lost[0]["files"] > 0
    assert not any("checkpoint-20" in s for s in mailer.subjects())


def test_only_units_not_on_the_target_and_not_retired_count_as_lost(tmp_path):
    from supervisor.saves.complete import Verdict
    from supervisor.sync.scan import Root, Unit

    root = Root(str(tmp_path), "")

    def unit(key: str, retired: bool = False, files: bool = True) -> Unit:
        return Unit(root, "dir", key, key, selected=["x"] if files else [], verdict=Verdict(True, ""),  # type: ignore[list-item]
                    retired=retired)

    before = {"a": unit("a"), "b": unit("b"), "c": unit("c", retired=True), "d": unit("d", files=False),
              "e": unit("e")}
    after = {"e": before["e"]}
    assert [u.key for u in vanished(before, after, synced=lambda u: u.key == "b")] == ["a"]
    assert "--save_total_limit 3" in likely_cause("train.py --save_total_limit=3")
    assert "save_total_limit" in likely_cause("")
