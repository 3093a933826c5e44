"""The one-shot no-change pass answered from its stamp (supervisor/cli/sync_stamp.py): the same answer
without the engine when nothing changed; the engine whenever anything did (a file, a new file, the
ledger, the config), when the last pass left something waiting, or when a daemon holds the ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.toml_writer import to_toml

REPO = Path(__file__).resolve().parents[2]
PROBE = ("import json, sys; from supervisor.sync.__main__ import main; rc = main(sys.argv[1:]); "
         "print('@@' + json.dumps({'rc': rc, 'engine': 'supervisor.sync.engine' in sys.modules}))")


def once(cfg: Path, **env: str) -> tuple[dict, bool]:
    """(the pass's answer, whether the engine was built)."""
    r = subprocess.run([sys.executable, "-c", PROBE, "--config", str(cfg), "--once", "--timeout", "60"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO), **env})
    answer, probe = r.stdout.split("@@")
    p = json.loads(probe)
    assert p["rc"] == 0, r.stderr
    return json.loads(answer.strip().splitlines()[-1]), p["engine"]


def setup(tmp_path: Path, **sync) -> tuple[HFWriter, Path]:
    w = HFWriter(tmp_path / "out")
    w.checkpoint(10)
    w.checkpoint(20)
    w.age(60)
    cfg = tmp_path / "c.toml"
    cfg.write_text(to_toml({"state_dir": str(tmp_path / "state"), "log_level": "warning",
                            "sync": {"target": str(tmp_path / "remote"), "watch": [str(w.out)], "quiet_period": "1s",
                                     **sync}}))
    return w, cfg


def test_nothing_changed_the_same_answer_without_the_engine(tmp_path):
    _, cfg = setup(tmp_path)
    first, built = once(cfg)
    assert built and first["ok"] and first["uploaded_files"] > 0
    again, built = once(cfg)
    assert not built
    assert again == {**first, "uploaded_files": 0}


def test_any_change_goes_the_engines_way(tmp_path):
    w, cfg = setup(tmp_path)
    once(cfg)
    assert once(cfg)[1] is False
    (w.out / "checkpoint-20" / "README.md").write_text("rewritten\n")  # a file changed (new mtime, size)
    w.age(60)
    r, built = once(cfg)
    assert built and r["ok"] and r["uploaded_files"] > 0
    assert once(cfg)[1] is False
    w.checkpoint(30)  # a new checkpoint
    w.age(60)
    r, built = once(cfg)
    assert built and r["uploaded_files"] > 0 and "checkpoint-30" in r["newest"][0]
    assert once(cfg)[1] is False
    cfg.write_text(cfg.read_text().replace('quiet_period = "1s"', 'quiet_period = "2s"'))  # the config
    assert once(cfg)[1] is True
    assert once(cfg)[1] is False
    # another HF cache named in the environment: the folders never entered change, so may the selection
    assert once(cfg, HF_HUB_CACHE=str(tmp_path / "hub"))[1] is True
    assert once(cfg, HF_HUB_CACHE=str(tmp_path / "hub"))[1] is False
    assert once(cfg)[1] is True  # back to the environment of before: the engine again, then its stamp
    assert once(cfg)[1] is False
    ledger = next((tmp_path / "state" / "sync").glob("*/journal.jsonl"))
    with open(ledger, "a") as f:  # someone else's pass (a daemon since gone) wrote the ledger
        f.write("\n")
    assert once(cfg)[1] is True


def test_a_pass_that_left_a_checkpoint_waiting_writes_no_stamp(tmp_path):
    w, cfg = setup(tmp_path)
    w.checkpoint(30, stop_before="trainer_state.json")  # a save cut short: it waits for its trainer_state.json
    r, built = once(cfg)
    assert built and r["ok"]
    assert not (tmp_path / "state" / "sync" / "once-stamp.json").exists()
    assert once(cfg)[1] is True  # it must be looked at again: it may be whole by now


def test_a_daemon_holding_the_ledger_is_never_answered_from_the_stamp(tmp_path):
    import fcntl

    _, cfg = setup(tmp_path)
    once(cfg)
    lock = next((tmp_path / "state" / "sync").glob("*/lock"))
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = subprocess.run([sys.executable, "-m", "supervisor.sync", "--config", str(cfg), "--once"],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 3 and "in use by another process" in r.stderr, r
    finally:
        os.close(fd)


# a checkpoint written while the pass runs: after the engine's scan, before the stamp is written
DURING = ("import sys; from pathlib import Path; from supervisor.sync.engine import SyncEngine; once = SyncEngine.once\n"
          "def late(self, t):\n"
          "    r = once(self, t)\n"
          "    from tests.fixtures.hf_writer import HFWriter\n"
          "    w = HFWriter(Path(sys.argv[-1]))\n"
          "    w.checkpoint(30)\n"
          "    w.age(60)\n"
          "    return r\n"
          "SyncEngine.once = late\n")


def test_a_checkpoint_written_during_the_pass_is_never_answered_from_the_stamp(tmp_path):
    w, cfg = setup(tmp_path)
    code = DURING + PROBE.replace("main(sys.argv[1:])", "main(sys.argv[1:-1])")
    r = subprocess.run([sys.executable, "-c", code, "--config", str(cfg), "--once", "--timeout", "60", str(w.out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert json.loads(r.stdout.split("@@")[1])["rc"] == 0, r.stderr
    assert (w.out / "checkpoint-30" / "trainer_state.json").exists()
    again, built = once(cfg)
    assert built, "a tree the pass never scanned was stamped as in sync"
    assert again["ok"] and again["uploaded_files"] > 0
    assert (tmp_path / "remote" / "checkpoint-30" / "_MANIFEST.json").exists()
