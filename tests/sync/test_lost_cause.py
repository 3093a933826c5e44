"""A checkpoint deleted before it went up names the real cause (issue 50: Accelerate saving every
~7 s with total_limit=2 lost six checkpoints to a 30 s quiet period, and each LOST mail blamed the
healthy target and never named quiet_period). The cause from what the last scan knew (pure), then
the real engine with a healthy local target and a folder rotated away while it waited."""

from __future__ import annotations

import shutil

from supervisor.saves.complete import FileObs, Verdict
from supervisor.sync.lost import cause, rotation, vanished
from supervisor.sync.scan import Root, Unit
from tests.fixtures.sync_engine import ListMailer
from tests.waiting import wait_until

NOW = 1_800_000_000.0


def unit(verdict: Verdict, age: float = 12.0, rel: str = "checkpoints/checkpoint_3", kind: str = "dir") -> Unit:
    return Unit(Root("/w/out", ""), kind, rel, rel, files=[FileObs("model.safetensors", 10, NOW - age, None, True)],
                verdict=verdict)


def test_deleted_while_it_waited_out_its_quiet_period_names_the_quiet_period_not_the_target():
    u = unit(Verdict(False, "writer active (quiet in 18s)", 18.0, format="accelerate", quiet=30.0))
    why, advice = cause(u, "accelerate launch train.py", 30.0, "", NOW)
    assert why.startswith("Accelerate's ProjectConfiguration(total_limit=...) deleted it 12s after its last write")
    assert "sync.quiet_period = 30s" in why and "target was healthy" in why
    assert "lower sync.quiet_period" in advice and 'quiet_period = "6s"' in advice
    assert "fix the target" not in advice + why
    # the period already shortened by the cadence is named with the configured one
    u = unit(Verdict(False, "writer active (quiet in 2s)", 2.0, format="hf", quiet=3.5))
    why, _ = cause(u, "python train.py --save_total_limit 2", 30.0, "", NOW)
    assert "the training's --save_total_limit 2 deleted it" in why
    assert "sync.quiet_period = 30s, 4s at this save cadence" in why


def test_deleted_while_its_format_rule_waited_names_what_it_waited_for():
    wait = "the world size (set sync.world_size): random_states_0..1.pkl are there, and ..."
    u = unit(Verdict(False, f"waiting for {wait}", None, format="accelerate", waiting_for=wait, quiet=30.0))
    why, advice = cause(u, "", 30.0, "", NOW)
    assert "while its format's rule (accelerate) still waited for the world size" in why
    assert advice.startswith("To keep the next ones: set sync.world_size")


def test_deleted_while_it_went_up_to_a_healthy_target_names_the_link():
    u = unit(Verdict(True, "complete", format="lightning", quiet=2.0), rel="ckpts/epoch=0-step=10.ckpt", kind="file")
    why, advice = cause(u, "", 30.0, "", NOW)
    assert why.startswith("Lightning's ModelCheckpoint(save_top_k=...) deleted it 12s after its last write, while it "
                          "waited its turn or went up")
    assert "keep more checkpoints" in advice and "fix the target" not in advice


def test_deleted_while_the_target_failed_names_the_target():
    u = unit(Verdict(True, "complete", format="hf"))
    why, advice = cause(u, "train.py --save_total_limit=3", 30.0, "AccessDenied", NOW)
    assert why.startswith("the training's --save_total_limit 3 deletes the oldest") and "target was failing" in why
    assert advice.startswith("To keep the next ones: fix the target first") and "disk.prune" in advice
    assert rotation("orbax", "") == "Orbax's CheckpointManager(max_to_keep=...)"
    assert rotation("files", "").startswith("the trainer's rotation (save_total_limit, total_limit, save_top_k")


def test_a_checkpoint_file_deleted_before_it_went_up_is_lost_too():
    """Lightning's top-k deletes .ckpt files: a single checkpoint file counts; a log does not."""
    ck = unit(Verdict(True, "complete"), rel="epoch=0-step=10.ckpt", kind="file")
    log = unit(Verdict(True, "complete"), rel="train.log", kind="file")
    for u in (ck, log):
        u.selected = ["x"]  # type: ignore[list-item]
    assert vanished({"a": ck, "b": log}, {}, synced=lambda u: False) == [ck]


def test_a_folder_rotated_away_while_it_waited_is_mailed_with_the_quiet_period(tmp_path, make_engine):
    """A healthy local target, a 30 s quiet period, a save folder no rule vouches for, deleted by
    the trainer 1 s after it was written: the LOST mail names sync.quiet_period and its value and
    what to do, and does not tell anyone to fix the target."""
    out, remote = tmp_path / "out", tmp_path / "remote"
    (out / "save_1").mkdir(parents=True)
    (out / "save_1" / "weights.npy").write_bytes(b"\0" * 4096)
    mailer = ListMailer()
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "30s", "include": ["save_*/**"]},
                    mailer=mailer)
    wait_until(lambda: any(w["unit"] == "save_1" and w["reason"].startswith("writer active")
                           for w in e.status()["waiting"]), 20, what="save_1 waiting out its quiet period")
    shutil.rmtree(out / "save_1")  # the rotation's next save
    e.request_sync()
    wait_until(lambda: any(a["key"] == "sync:lost:save_1" for a in e.alerts.active()), 20, what="the lost alert")
    e.alerts.tick()
    wait_until(lambda: any("checkpoint LOST: save_1" in s for s in mailer.subjects()), 10, what="the LOST mail")
    body = next(b for s, b in mailer.sent if "LOST" in s)
    assert "sync.quiet_period = 30s" in body and "lower sync.quiet_period" in body, body
    assert "target was healthy" in body and "fix the target" not in body and "last error" not in body, body
    lost = e.status()["lost"]
    assert lost[0]["unit"] == "save_1" and "quiet_period" in lost[0]["cause"]
