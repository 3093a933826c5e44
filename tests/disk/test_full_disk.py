"""state_dir on a disk that fills up: a real small tmpfs (root only: mounting needs it), filled with
a real file until the kernel says ENOSPC.

What must hold: the reserve is freed once so the daemon can still record; after that a save
fails with StateWriteError (naming the file, saying the disk is full) and the old file is intact;
a short write never passes for a whole one; a ledger record that cannot be written is a
TargetError (so the engine backs off and alerts) and the journal stays readable."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from supervisor import statefile
from supervisor.statefile import RESERVE_NAME, Reserve, StateStore, StateWriteError, atomic_write, write_all
from supervisor.store.base import TargetError
from supervisor.sync.ledger import Entry, Ledger, LedgerWriteError
from tests.fixtures.tmpfs import small_tmpfs

FS_BYTES = 16 * 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")


class SmallDisk:
    def __init__(self, root: Path):
        self.root = root
        self.filler = root / "filler"

    def free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def fill(self, leave_pages: int = 0) -> None:
        """Write zeros until ENOSPC, then give back `leave_pages` pages."""
        with open(self.filler, "ab", buffering=0) as f:
            block = bytes(1024 * 1024)
            while True:
                try:
                    n = f.write(block)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if len(block) == PAGE:
                        break
                    block = bytes(max(PAGE, len(block) // 4))
                    continue
                if n is not None and n < len(block):
                    block = bytes(max(PAGE, len(block) // 4))
        assert self.free() < PAGE
        if leave_pages:
            size = self.filler.stat().st_size
            os.truncate(self.filler, max(0, size - leave_pages * PAGE))

    def empty(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture
def disk():
    with small_tmpfs(FS_BYTES, "tsv-full-") as mnt:
        yield SmallDisk(mnt)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(statefile, "_reserves", [])


def test_reserve_is_preallocated_private_and_not_made_on_a_nearly_full_disk(disk):
    state = disk.root / "state"
    state.mkdir()
    r = Reserve(state)
    assert r.arm() is True and r.armed()
    p = state / RESERVE_NAME
    assert p.stat().st_size == statefile.RESERVE_BYTES
    assert p.stat().st_blocks * 512 >= statefile.RESERVE_BYTES  # real blocks, not a sparse file
    assert p.stat().st_mode & 0o777 == 0o600
    assert r.arm() is True  # already there: nothing to do
    p.unlink()
    disk.fill(leave_pages=(3 * statefile.RESERVE_BYTES // 2) // PAGE)  # room for it, not for it twice
    assert r.arm() is False and not p.exists()
    assert not list(state.glob("*.tmp"))


def test_full_disk_frees_the_reserve_once_then_save_fails_clearly_and_keeps_the_old_file(disk):
    state = disk.root / "state"
    store = StateStore(state)
    store.save("stop", {"phase": "final_sync", "n": 0})
    reserve = Reserve(state).register()
    assert reserve.arm()
    disk.fill()

    store.save("stop", {"phase": "acting", "n": 1})  # fits in what the reserve gave back
    assert json.loads((state / "stop.json").read_text()) == {"n": 1, "phase": "acting"}
    assert not reserve.armed() and "reserve was used" in (reserve.problem() or "")

    disk.fill()  # the trainer took the rest
    with pytest.raises(StateWriteError) as e:
        store.save("stop", {"phase": "done", "n": 2})
    assert isinstance(e.value, OSError) and e.value.disk_full and e.value.errno == errno.ENOSPC
    assert str(e.value) == f"cannot save {state / 'stop.json'}: No space left on device (the disk is full)"
    assert json.loads((state / "stop.json").read_text()) == {"n": 1, "phase": "acting"}  # old one intact
    assert "stop" in store.unsaved and "the disk is full" in store.unsaved["stop"]
    assert sorted(p.name for p in state.iterdir()) == ["stop.json"]  # no temp file left behind

    disk.empty()
    store.save("stop", {"phase": "done", "n": 2})
    assert store.unsaved == {}
    assert reserve.arm() and reserve.problem() is None


def test_short_write_is_never_taken_for_a_whole_one(disk):
    disk.fill(leave_pages=4)
    path = disk.root / "big.json"
    atomic_write(path, b"old")
    fd = os.open(disk.root / "raw", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        n = os.write(fd, bytes(64 * PAGE))  # the kernel takes what fits and says how much
        assert 0 < n < 64 * PAGE
        with pytest.raises(OSError) as e:
            write_all(fd, bytes(64 * PAGE))
        assert e.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
        os.unlink(disk.root / "raw")
    with pytest.raises(StateWriteError):
        atomic_write(path, bytes(64 * PAGE))
    assert path.read_bytes() == b"old"


def test_ledger_write_on_a_full_disk_is_a_target_error_and_the_journal_stays_readable(disk):
    state = disk.root / "state"
    led = Ledger(state, "s3://bucket/run")
    led.done("a", Entry(1, 1, "aa"))
    led.sync()
    disk.fill()
    big = "x" * 3000  # more than what is left in the journal's last page
    with pytest.raises(LedgerWriteError) as e:
        for i in range(100):
            led.done(f"b{i}", Entry(2, 2, "bb", src=big))
    assert isinstance(e.value, TargetError) and "sync ledger" in str(e.value)
    assert "No space left" in str(e.value)
    disk.empty()
    led.done("c", Entry(3, 3, "cc"))
    led.close()

    again = Ledger(state, "s3://bucket/run")
    try:
        assert again.get("a") is not None and again.get("c") is not None  # nothing after the tear is lost
        assert again.get("b99") is None  # never recorded: it will be sent again, never counted as sent
    finally:
        again.close()


def test_ledger_record_uses_the_reserve(disk):
    state = disk.root / "state"
    led = Ledger(state, "local:/t")
    reserve = Reserve(state).register()
    assert reserve.arm()
    disk.fill()
    big = "y" * 3000
    for i in range(50):  # 150 KB: fits in the freed reserve
        led.done(f"k{i}", Entry(1, 1, "h", src=big))
    assert not reserve.armed()
    led.close()
    again = Ledger(state, "local:/t")
    try:
        assert again.get("k49") is not None
    finally:
        again.close()


def test_compaction_without_room_for_a_second_journal_empties_it_in_place(disk):
    state = disk.root / "state"
    led = Ledger(state, "s3://b/compact")
    for i in range(300):
        led.done(f"f{i}", Entry(i, i, "h" * 64, src="s" * 200))
    led.sync()
    snap_bytes = len(json.dumps({"gen": 1, "target": "s3://b/compact",
                                 "files": {f"f{i}": Entry(i, i, "h" * 64, src="s" * 200).pack() for i in range(300)},
                                 "inflight": {}, "manifests": {}}, separators=(",", ":")))
    disk.fill(leave_pages=-(-snap_bytes // PAGE))  # room for the snapshot, none for a new journal
    led.compact()
    assert led.journal_path.stat().st_size < 200
    led.close()
    again = Ledger(state, "s3://b/compact")
    try:
        assert len(again.files) == 300
    finally:
        again.close()


def test_compaction_failure_is_not_fatal(disk, monkeypatch):
    state = disk.root / "state"
    led = Ledger(state, "s3://b/c2")
    for i in range(50):  # one file sent 50 times: a journal worth compacting
        led.done("f", Entry(i, i, "h" * 64, src="s" * 2000))
    monkeypatch.setattr(led, "_compact_at", 0)
    disk.fill()
    led.sync()  # compaction cannot write the snapshot: logged, journal kept, tried much later
    assert led._compact_at >= 100
    disk.empty()
    led.close()
    again = Ledger(state, "s3://b/c2")
    try:
        assert again.get("f") == Entry(49, 49, "h" * 64, src="s" * 2000)
    finally:
        again.close()


def test_real_daemon_on_a_full_state_disk_still_records_and_says_so(disk, tmp_path):
    from tests.fixtures.daemon import DaemonProc
    from tests.waiting import wait_until

    state = disk.root / "state"
    d = DaemonProc(tmp_path / "d", {"state_dir": str(state), "stop": {"action": "dry-run"},
                                    "gpu": {"nvml_library": str(tmp_path / "no-such-libnvidia-ml.so.1")}})
    try:
        d.start()
        reserve = state / RESERVE_NAME
        assert reserve.stat().st_size == statefile.RESERVE_BYTES and reserve.stat().st_mode & 0o777 == 0o600
        disk.fill()

        r = d.ctl("keepalive", "1h")
        assert r.returncode == 0, r.stderr
        until = d.status()["idle"]["keepalive_until"]
        assert json.loads((state / "idle.json").read_text())["keepalive_until"] == until  # on disk, thanks to the reserve
        assert not reserve.exists()
        problems = d.status()["daemon"]["problems"]
        assert any("reserve was used" in p for p in problems), problems

        disk.fill()  # and now even the reserve is gone
        r = d.ctl("keepalive", "2h")
        assert r.returncode == 0, r.stderr  # kept in memory; the daemon goes on
        st = d.status()
        assert st["idle"]["keepalive_until"] > until
        assert any("idle.json" in p and "the disk is full" in p for p in st["daemon"]["problems"]), st["daemon"]

        r = d.ctl("run", "--", "sleep", "60")  # a start on a full disk: the reason, not "internal error"
        assert r.returncode != 0 and "internal error" not in r.stderr, r.stderr
        assert "nothing was started" in r.stderr and ("disk is full" in r.stderr or "No space" in r.stderr), r.stderr
        assert d.status()["training"]["state"] not in ("STARTING", "RUNNING")

        disk.empty()
        assert d.ctl("keepalive", "3h").returncode == 0
        wait_until(lambda: not any("idle.json" in p for p in d.status()["daemon"]["problems"]), 10,
                   what="the unsaved idle.json to leave the problems once saved")
        assert json.loads((state / "idle.json").read_text())["keepalive_until"] == d.status()["idle"]["keepalive_until"]
        assert "state_dir_full" in d.log_text()
    finally:
        d.cleanup()


def test_sync_engine_with_a_full_ledger_disk_backs_off_alerts_and_recovers(disk, make_engine, hf_writer, tmp_path):
    """What the engine does today with LedgerWriteError (a TargetError): the same failure, backoff,
    alert and recovery path as an unreachable target, not an 'internal error' every second."""
    import time

    from supervisor.clock import FakeClock
    from supervisor.sync.policy import MANIFEST_NAME
    from tests.fixtures.sync_engine import ListMailer
    from tests.waiting import wait_until

    remote = tmp_path / "remote"
    clock = FakeClock(start=time.time())
    mails = ListMailer()
    hf_writer.checkpoint(1)
    hf_writer.age(60)
    e = make_engine({"target": str(remote), "watch": [str(hf_writer.out)], "fail_alert_after": "5m"},
                    clock=clock, mailer=mails, start=False, state=str(disk.root / "state"))
    disk.fill()
    e.start()
    wait_until(lambda: e.status()["state"] == "failing", 20, what="failing")
    assert "cannot record in the sync ledger" in e.status()["last_error"], e.status()
    assert "internal error" not in e.status()["last_error"]
    clock.advance(301)
    wait_until(lambda: e.alerts.active(), 10, what="sync failing alert")
    e.alerts.tick()
    wait_until(lambda: mails.subjects(), 10, what="alert mail")
    assert "sync failing" in mails.subjects()[0]
    disk.empty()
    clock.advance(600)  # past any backoff
    wait_until(lambda: (remote / "checkpoint-1" / MANIFEST_NAME).exists(), 20, what="recovery")
    wait_until(lambda: e.status()["state"] == "idle", 10, what="idle again")
