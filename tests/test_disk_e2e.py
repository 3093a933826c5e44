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
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from supervisor.clock import SystemClock
from supervisor.config import from_dict
from supervisor.context import Context
from supervisor.disk.watch import DiskWatch
from supervisor.notify.alerts import Alerts
from supervisor.statefile import StateStore
from supervisor.sync.engine import SyncEngine
from tests.fixtures.hf_writer import safetensors_bytes, torch_zip_bytes
from tests.fixtures.sync_engine import ListMailer, engine_config
from tests.waiting import wait_until

MIB = 1024**2
FS_BYTES = 64 * MIB
SAVES = 30
SAVE_EVERY = 0.5
BEST = 3                      # the Trainer's best_model_checkpoint from step 3 on


@pytest.fixture
def tmpfs():
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs")
    mnt = Path(tempfile.mkdtemp(prefix="tsv-disk-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0755", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); needs CAP_SYS_ADMIN")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)


class Trainer:
    """checkpoint-N/: model.safetensors and optimizer.pt (8 MiB together), trainer_state.json last."""

    def __init__(self, out: Path):
        self.out = out
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

    def save(self, step: int) -> bool:
        d = self.out / f"checkpoint-{step}"
        try:
            d.mkdir(exist_ok=True)
            for name, data in self.files(step):
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
        t0 = time.monotonic()
        for step in range(1, n + 1):
            if not self.save(step):
                return
            time.sleep(max(0.0, t0 + step * every - time.monotonic()))


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
        self.sync = SyncEngine.from_config(self.cfg, clock, self.alerts)
        self.trainer = Trainer(self.out)
        self.checks: list[tuple[str, list[str]]] = []   # (unit, problems) at each delete, from the journal line
        self.disk = DiskWatch(Context(self.cfg, clock, StateStore(self.cfg.state_dir), self.alerts), self.sync,
                              [str(self.out)], quiet=0.15, before_delete=self.check_target)
        self.alert_at: float | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def start(self) -> Rig:
        self.sync.start()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.disk.poll()
            if self.alert_at is None and any(a["kind"] == "disk_forecast" for a in self.alerts.active()):
                self.alert_at = time.monotonic()
            self._stop.wait(0.05)

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(10)
        self.sync.close()

    def check_target(self, entry: dict) -> None:
        """At the moment of a delete (the journal's intent line is written, the folder not yet
        removed): the target holds the unit complete, byte for byte, with its manifest."""
        unit = entry["unit"]
        problems = []
        objs = self.s3.objects(self.prefix)
        if f"{unit}/_MANIFEST.json" not in objs:
            problems.append("no manifest")
        for name, sha in self.trainer.sha[unit].items():
            key = f"{self.prefix}/{unit}/{name}"
            if f"{unit}/{name}" not in objs or hashlib.sha256(self.s3.get(key)).hexdigest() != sha:
                problems.append(f"{name} missing or different")
        last = json.loads(Path(self.disk.journal.path).read_text().splitlines()[-1])
        if last != entry:
            problems.append("the intent line is not the journal's last line")
        self.checks.append((unit, problems))


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
    # every checkpoint on the target, byte for byte, with its manifest
    want = {f"checkpoint-{s}" for s in range(1, SAVES + 1)}
    wait_until(lambda: {h["unit"] for h in r.sync.holdings() if h["on_target"]} >= {
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
    assert all(not problems for _, problems in r.checks), [c for c in r.checks if c[1]]
    assert all(e["verified_at"] <= e["at"] for e in journal)
    # never the best, never the newest keep_local
    left = sorted(int(p.name.split("-")[1]) for p in r.out.iterdir())
    assert BEST in left and left[-2:] == [SAVES - 1, SAVES]
    st = r.disk.status()
    fs = st["filesystems"][0]
    assert st["deleted"] == len(deleted) and fs["verified_off"] >= 2
    assert " verified off the machine" in fs["line"] and "per checkpoint every" in fs["line"]


def test_prune_off_the_alert_comes_before_the_first_enospc(rig):
    r = rig("off")
    r.trainer.run(SAVES, SAVE_EVERY)
    assert r.trainer.enospc_at is not None, "the disk never filled"
    assert r.alert_at is not None and r.alert_at < r.trainer.enospc_at
    a = next(a for a in r.alerts.active() if a["kind"] == "disk_forecast")
    assert a["subject"].startswith("disk full")
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
    wait_until(lambda: sum(h["on_target"] for h in r.sync.holdings()) >= 4, timeout=20, what="4 on the target")
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
