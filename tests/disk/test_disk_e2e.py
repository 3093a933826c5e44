"""The training disk never fills up, end to end: a real 64 MiB tmpfs (root mounts it), a trainer
writing 8 MiB checkpoints Trainer-style (trainer_state.json last, best_model_checkpoint in it),
the real sync engine uploading to SeaweedFS, and the disk duty forecasting, alerting and pruning.

Shrunk in time only (the sizes are the issue's): a save every SAVE_EVERY seconds instead of ~2 s,
the sync's quiet period 0.2 s, the duty polled every 0.05 s."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.disk.watch import DiskWatch
from supervisor.notify.alerts import Alerts
from supervisor.statefile import StateStore
from supervisor.sync.engine import engine_for
from tests.fixtures.context import ConfiguredContext
from tests.fixtures.hf_writer import safetensors_bytes, torch_zip_bytes
from tests.fixtures.sync_engine import ListMailer, engine_config
from tests.fixtures.tmpfs import small_tmpfs
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
MIB = 1024**2
FS_BYTES = 64 * MIB
SAVES = 30
SAVE_EVERY = 1.0
BEST = 3                      # the Trainer's best_model_checkpoint from step 3 on


@pytest.fixture
def tmpfs():
    with small_tmpfs(FS_BYTES, "tsv-disk-") as mnt:
        yield mnt


class Trainer:
    """checkpoint-N/: model.safetensors and optimizer.pt (8 MiB together), trainer_state.json last."""

    def __init__(self, out: Path, report_dir: Path | None = None):
        self.out = out
        self.report_dir = report_dir or out.parent
        out.mkdir(parents=True, exist_ok=True)
        self.sha: dict[str, dict[str, str]] = {}     # checkpoint -> file -> sha256 of what was written
        self.enospc_at: float | None = None
        self.saved = 0

    def files(self, step: int) -> list[tuple[str, bytes]]:
        state = {"global_step": step, "best_model_checkpoint": str(self.out / f"checkpoint-{BEST}") if step >= BEST
                 else None, "log_history": [{"loss": 1.0 / step, "step": step}]}
        return [("model.safetensors", safetensors_bytes({"w": 7 * MIB + 512 * 1024}, step)),
                ("optimizer.pt", torch_zip_bytes(512 * 1024 - 2048, step)),
                ("trainer_state.json", json.dumps(state).encode())]

    def save(self, step: int, files: list[tuple[str, bytes]] | None = None) -> bool:
        d = self.out / f"checkpoint-{step}"
        try:
            d.mkdir(exist_ok=True)
            for name, data in files or self.files(step):
                with open(d / name, "wb") as f:
                    f.write(data)
                self.sha.setdefault(d.name, {})[name] = hashlib.sha256(data).hexdigest()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            self.enospc_at = time.monotonic()
            return False
        self.saved += 1
        return True

    def run(self, n: int, every: float) -> None:
        """Save n checkpoints, one every `every` seconds, in a process of its own (as a trainer
        is: this test process's threads then share no lock with it), until ENOSPC."""
        subprocess.run([sys.executable, "-c", TRAINER, str(self.out), str(n), str(every), str(self.report)],
                       env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, timeout=n * every + 60)
        self.read_report()

    @property
    def report(self) -> Path:
        return self.report_dir / "trainer.jsonl"

    def read_report(self) -> None:
        """What the trainer process reported so far (a save is reported once it is whole)."""
        self.saved = 0
        for line in self.report.read_text().splitlines():
            e = json.loads(line)
            if "enospc_at" in e:
                self.enospc_at = e["enospc_at"]
            else:
                self.sha[e["checkpoint"]] = e["sha"]
                self.saved += 1


# the trainer process: Trainer.save, timed; reports each save's sha256s and the first ENOSPC
# (time.monotonic is CLOCK_MONOTONIC: comparable with this process's)
TRAINER = r"""
import sys, json, time
from pathlib import Path
from tests.disk.test_disk_e2e import Trainer
out, n, every, report = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
t = Trainer(out)
t0 = time.monotonic()
with open(report, "w") as rep:
    for step in range(1, n + 1):
        data = t.files(step)          # made before its turn: the save itself is only the writing
        time.sleep(max(0.0, t0 + (step - 1) * every - time.monotonic()))
        if not t.save(step, data):
            rep.write(json.dumps({"enospc_at": t.enospc_at}) + "\n")
            break
        rep.write(json.dumps({"checkpoint": f"checkpoint-{step}", "sha": t.sha[f"checkpoint-{step}"]}) + "\n")
        rep.flush()
"""


class Rig:
    def __init__(self, tmp: Path, mnt: Path, s3, prefix: str, prune: str):
        self.out = mnt / "out"
        self.s3, self.prefix = s3, prefix
        data = engine_config(tmp, {**s3.sync_config(prefix), "watch": [str(self.out)], "quiet_period": "0.2s"},
                             disk={"prune": prune, "keep_local": 2})
        self.cfg = from_dict(data)
        clock = SystemClock()
        self.mailer = ListMailer()
        self.alerts = Alerts(self.cfg.alerts, clock, self.cfg.state_dir, self.mailer, hostname="testbox")
        self.sync = engine_for(self.cfg, clock, self.alerts)
        self.trainer = Trainer(self.out, tmp)
        self.checks: list[tuple[str, list[str]]] = []   # (unit, problems) at each delete, from the journal line
        self.disk = DiskWatch(ConfiguredContext(clock, StateStore(self.cfg.state_dir), self.alerts, self.cfg), self.cfg.disk, self.sync,
                              [str(self.out)], quiet=0.15, before_delete=self.check_target)
        self.alert_at: float | None = None   # when the "disk full" mail reached the mailer
        self.min_free: int | None = None     # the least free space the poller saw (a measure of the margin)
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def start(self) -> Rig:
        self.sync.start()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            st = self.disk.poll()
            for fs in st["filesystems"]:
                self.min_free = fs["free_bytes"] if self.min_free is None else min(self.min_free, fs["free_bytes"])
            self.alerts.tick()   # the daemon's alerts duty: delivers what is due
            if self.alert_at is None and any("disk full" in s for s in self.mailer.subjects()):
                self.alert_at = time.monotonic()   # the mail arrived
            self._stop.wait(0.05)

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(10)
        self.sync.close()

    def check_target(self, entry: dict) -> None:
        """At the moment of a delete (the journal's intent line is written, the folder not yet
        removed): what the target holds of the unit, by one listing (kept short: the trainer's
        next save waits on nobody). After the run each object is read back and hashed; an ETag
        unchanged since this moment (an MD5 of the content here) proves the bytes were there then."""
        unit = entry["unit"]
        objs = self.s3.objects(f"{self.prefix}/{unit}")
        last = json.loads(Path(self.disk.journal.path).read_text().splitlines()[-1])
        self.checks.append((unit, objs, last == entry))

    def check_deletes(self, verified: dict[str, dict]) -> list[str]:
        """The target held every deleted unit complete, byte for byte, with its manifest, at the
        delete. `verified`: the target's objects now, each already read back and hashed equal to
        what the trainer wrote: an ETag (MD5) unchanged since the delete means those bytes."""
        problems = []
        self.trainer.read_report()
        for unit, objs, intent_last in self.checks:
            if not intent_last:
                problems.append(f"{unit}: the intent line was not the journal's last line")
            if "_MANIFEST.json" not in objs:
                problems.append(f"{unit}: no manifest on the target at the delete")
            for name in self.trainer.sha[unit]:
                o = objs.get(name)
                if o is None:
                    problems.append(f"{unit}/{name}: not on the target at the delete")
                elif verified[f"{unit}/{name}"]["etag"] != o["etag"]:
                    problems.append(f"{unit}/{name}: other bytes on the target at the delete")
        return problems


@pytest.fixture
def rig(tmp_path, tmpfs, s3_server, s3_prefix):
    made: list[Rig] = []

    def make(prune: str) -> Rig:
        r = Rig(tmp_path, tmpfs, s3_server, s3_prefix, prune).start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_prune_on_thirty_saves_fit_a_disk_for_seven_and_all_reach_the_target(rig):
    r = rig("synced")
    r.trainer.run(SAVES, SAVE_EVERY)
    assert r.trainer.enospc_at is None and r.trainer.saved == SAVES
    print(f"least free seen: {r.min_free / MIB:.1f} MiB")
    # every checkpoint on the target, byte for byte, with its manifest
    want = {f"checkpoint-{s}" for s in range(1, SAVES + 1)}
    wait_until(lambda: {h.unit for h in r.sync.holdings() if h.on_target} >= {
        p.name for p in r.out.iterdir()}, timeout=30, what="the last checkpoints on the target")
    objs = r.s3.objects(r.prefix)
    for unit in sorted(want):
        assert f"{unit}/_MANIFEST.json" in objs, unit
        for name, sha in r.trainer.sha[unit].items():
            assert hashlib.sha256(r.s3.get(f"{r.prefix}/{unit}/{name}")).hexdigest() == sha, (unit, name)
    # every delete was journaled and the target held the unit complete at that moment
    journal = [json.loads(x) for x in Path(r.disk.journal.path).read_text().splitlines()]
    deleted = [e for e in journal if e["event"] == "deleted"]
    assert len(deleted) >= SAVES - 8 and len(r.checks) == len([e for e in journal if e["event"] == "delete"])
    assert r.check_deletes(objs) == []
    assert all(e["verified_at"] <= e["at"] for e in journal)
    # never the best, never the newest keep_local
    left = sorted(int(p.name.split("-")[1]) for p in r.out.iterdir())
    assert BEST in left and left[-2:] == [SAVES - 1, SAVES]
    st = r.disk.status()
    fs = st["filesystems"][0]
    assert st["deleted"] == len(deleted) and fs["verified_off"] >= 2
    assert " verified off the machine" in fs["line"] and "per checkpoint every" in fs["line"]
    # prune kept up with a healthy sync: no "disk full" alert left standing
    assert fs["prune_keeps_up"] and not [a for a in r.alerts.active() if a["kind"] == "disk_forecast"]


def test_prune_off_the_alert_comes_before_the_first_enospc(rig):
    r = rig("off")
    r.trainer.run(SAVES, SAVE_EVERY)
    assert r.trainer.enospc_at is not None, "the disk never filled"
    assert r.alert_at is not None and r.alert_at < r.trainer.enospc_at
    a = next(a for a in r.alerts.active() if a["kind"] == "disk_forecast")
    assert a["subject"].startswith("disk full")
    body = next(b for subj, b in r.mailer.sent if "disk full" in subj)
    assert "What fills it:" in body and "checkpoints (" in body and "already off the machine" in body
    assert 'prune = "synced"' in body   # what would free space
    assert not any(e for e in r.disk.journal.recent(50))  # prune off: nothing deleted
    assert len(list(r.out.iterdir())) >= 6


def _disk_alert_body(r: Rig) -> str | None:
    for rec in list(r.alerts.state.records.values()):
        if rec.kind == "disk_forecast" and rec.active:
            return rec.body
    return None


def test_target_down_nothing_is_deleted_and_the_alert_says_why(rig, s3_server):
    r = rig("synced")
    for step in range(1, 5):
        assert r.trainer.save(step)
        time.sleep(0.05)   # a rhythm for the forecast
    wait_until(lambda: sum(h.on_target for h in r.sync.holdings()) >= 4, timeout=20, what="4 on the target")
    s3_server.stop()
    try:
        step = 5
        while r.disk.last_prune is None and r.trainer.save(step):
            step += 1
            time.sleep(0.1)
        body = wait_until(lambda: (b := _disk_alert_body(r)) and "Nothing was deleted" in b and b, timeout=30,
                          what="the disk alert saying why nothing was deleted")
        assert "the target cannot be checked" in body, body
        assert not [e for e in r.disk.journal.recent(50) if e["event"] in ("delete", "deleted")]
        assert {f"checkpoint-{s}" for s in range(1, step)} <= {p.name for p in r.out.iterdir()}
    finally:
        s3_server.start()
