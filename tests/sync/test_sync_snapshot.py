"""Snapshots of single checkpoint files (saves/snapshot.py, snapdir.py, counts.py) and the "target
behind" rule (targethealth.Behind), piece by piece on real files: the decisions exhaustively, a copy
discarded when its source moves during it, a link for a writer that replaces by rename, the disk
guard's fallback and the folder on another file system (a real small tmpfs), the alert and its words.
The engine end to end, with a real S3 target: test_sync_snapshot_e2e.py."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from supervisor.cli.render import sync_lines
from supervisor.clock import FakeClock
from supervisor.config import from_dict
from supervisor.notify.alerts import Alerts
from supervisor.notify.mails.sync import behind_line, target_behind
from supervisor.saves.complete import FileObs, Verdict
from supervisor.saves.counts import Lag, Track
from supervisor.saves.snapdir import MOUNT_DIR, room
from supervisor.saves.snapshot import Snapshots, SnapshotTarget, slot, snapshot_mode
from supervisor.store.base import LocalFile, SourceProblem, Uploaded
from supervisor.store.local import LocalTarget
from supervisor.sync.policy import Policy, is_cache_dir
from supervisor.sync.scan import Root, Selected, Unit
from supervisor.sync.status import Board
from supervisor.sync.targethealth import BEHIND_KEY, BEHIND_SAVES, Behind, behind_alerting
from tests.fixtures.hf_writer import sha256, torch_zip_bytes
from tests.fixtures.sync_engine import ListMailer
from tests.fixtures.tmpfs import small_tmpfs

MiB = 1 << 20


# --- the decisions -----------------------------------------------------------------------------------

@pytest.mark.parametrize("in_place", [None, True, False])
@pytest.mark.parametrize("aborted", [False, True])
def test_snapshot_mode_follows_how_the_file_last_changed(in_place, aborted):
    want = {True: "copy", False: "link", None: "copy" if aborted else None}[in_place]
    assert snapshot_mode(in_place, aborted) == want


@pytest.mark.parametrize("size,free,total,margin,ok", [
    (10, 1000, 10_000, 0, True),            # 5% of 10_000 = 500 kept: 990 left
    (600, 1000, 10_000, 0, False),          # 400 left < 500
    (500, 1000, 10_000, 0, True),           # exactly the margin left
    (10, 1000, 10_000, 991, False),         # the fixed margin is larger
    (0, 0, 0, 0, True),
    (1, 0, 0, 0, False),
])
def test_room_leaves_the_larger_margin(size, free, total, margin, ok):
    assert room(size, free, total, margin) is ok


@pytest.mark.parametrize("saves", range(0, 6))
@pytest.mark.parametrize("was", [False, True])
def test_behind_is_raised_past_the_limit_and_held_until_caught_up(saves, was):
    assert behind_alerting(saves, was) is (saves > BEHIND_SAVES or (was and saves > 0))


def test_a_track_counts_each_whole_version_once_and_the_lag_from_the_target():
    t = Track("ckpt.pt", "/o/ckpt.pt", "file")
    for i, v in enumerate([(10, 1, 7), (10, 2, 7), (10, 2, 7), (11, 3, 7)]):
        t.moved(v)
        t.saw(v, 100.0 + i)
    assert t.count == 3 and t.in_place is True
    t.on_target = 1
    lag = t.lag()
    assert (lag.saves, lag.since) == (2, 101.0)  # the first save the target lacks
    t.moved((11, 4, 8))  # a new inode: replaced by rename
    assert t.in_place is False
    t.on_target = 3
    assert t.lag().saves == 0 and t.lag().since is None


# --- units as the scan makes them -----------------------------------------------------------------------

def file_unit(path: Path, whole: bool = True) -> Unit:
    st = os.stat(path)
    s = Selected(str(path), path.name, path.name, st.st_size, st.st_mtime_ns, path.name, st.st_ino, st.st_ctime_ns)
    return Unit(Root(str(path.parent), ""), "file", path.name, path.name,
                [FileObs(path.name, st.st_size, st.st_mtime_ns / 1e9, None, whole)], [s], Verdict(True, "complete"))


def rewrite_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as fh:  # torch.save(obj, path): the same inode, truncated and written again
        fh.truncate(0)
        fh.write(data)


def replace_by_rename(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")  # Lightning's save: a new file renamed over the old
    tmp.write_bytes(data)
    os.rename(tmp, path)


class Sink:
    """An UploadSink that keeps what the target reports (what the uploader writes to the ledger)."""

    def __init__(self) -> None:
        self.results: dict[str, tuple[LocalFile, Uploaded]] = {}
        self.problems: list[tuple[LocalFile, SourceProblem]] = []

    def begin(self, f, info):
        pass

    def part(self, f, n, etag, checksum, size):
        pass

    def done(self, f, result):
        self.results[f.key] = (f, result)

    def problem(self, f, err):
        self.problems.append((f, err))

    def progress(self, f, nbytes):
        pass

    def in_flight(self, key):
        return None

    def cancelled(self):
        return False


def board() -> Board:
    return Board(threading.RLock(), True)


def snaps_for(tmp: Path, **kw) -> Snapshots:
    return Snapshots(str(tmp / "state"), Behind(board(), None, "test-target"), **kw)


def no(*_a, **_k):
    return None


def seen_twice(s: Snapshots, path: Path, second) -> Unit:
    """The scan saw the file, then a second version of it (written by `second`)."""
    s.look([file_unit(path)], lambda u: True)
    second()
    u = file_unit(path)
    s.look([u], lambda u: False)
    return u


def snapshot_files(tmp: Path) -> list[Path]:
    return [p for p in (tmp / "state" / "sync" / "snapshots").rglob("*") if p.is_file()]


# --- copies ----------------------------------------------------------------------------------------------

def test_a_file_rewritten_in_place_goes_up_from_a_whole_copy_recorded_as_the_source(tmp_path):
    src = tmp_path / "out" / "ckpt.pt"
    src.parent.mkdir()
    src.write_bytes(torch_zip_bytes(MiB, seed=0))
    s = snaps_for(tmp_path)
    v1 = torch_zip_bytes(MiB, seed=1)
    u = seen_twice(s, src, lambda: rewrite_in_place(src, v1))
    s.take([u], no)
    (snap,) = s.live.values()
    assert snap.mode == "copy" and snap.problem is None
    (copy,) = snapshot_files(tmp_path)
    st, cst = os.stat(src), os.stat(copy)
    assert copy.read_bytes() == v1 and cst.st_ino != st.st_ino and cst.st_mtime_ns == st.st_mtime_ns
    assert stat.S_IMODE(os.stat(copy.parent.parent).st_mode) == 0o700
    remote = tmp_path / "remote"
    sink = Sink()
    SnapshotTarget(LocalTarget(str(remote)), s).put_files(
        [LocalFile(str(src), "ckpt.pt", st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)], sink)
    rewrite_in_place(src, torch_zip_bytes(MiB, seed=2))  # the writer goes on: the copy is what went up
    f, res = sink.results["ckpt.pt"]
    assert (remote / "ckpt.pt").read_bytes() == v1 and res.sha256 == sha256(v1)
    assert (f.path, f.ino, f.ctime_ns) == (str(src), st.st_ino, st.st_ctime_ns)  # the source, as snapshotted
    s.release()
    assert snapshot_files(tmp_path) == [] and list((tmp_path / "state" / "sync" / "snapshots").iterdir()) == []


def test_a_file_changed_while_it_is_copied_is_discarded_and_not_sent(tmp_path):
    src = tmp_path / "out" / "ckpt.pt"
    src.parent.mkdir()
    src.write_bytes(torch_zip_bytes(MiB, seed=0))
    changed = []

    def during_copy(f: LocalFile, done: int) -> None:  # the trainer saves again while the copy runs
        if not changed:
            changed.append(done)
            rewrite_in_place(src, torch_zip_bytes(2 * MiB, seed=9))

    s = snaps_for(tmp_path, on_piece=during_copy)
    u = seen_twice(s, src, lambda: rewrite_in_place(src, torch_zip_bytes(MiB, seed=1)))
    judged = u.selected[0]
    s.take([u], no)
    (snap,) = s.live.values()
    assert changed and snap.problem is not None and snap.problem.kind == "changed"
    assert snapshot_files(tmp_path) == []  # discarded at once
    sink = Sink()
    remote = tmp_path / "remote"
    SnapshotTarget(LocalTarget(str(remote)), s).put_files(
        [LocalFile(judged.path, judged.key, judged.size, judged.mtime_ns, judged.ino, judged.ctime_ns)], sink)
    assert [e.kind for _f, e in sink.problems] == ["changed"] and not sink.results and not remote.exists()
    s.release()
    assert s.taken["discarded"] == 1


def test_a_file_never_seen_to_change_gets_no_snapshot(tmp_path):
    src = tmp_path / "out" / "model.safetensors"
    src.parent.mkdir()
    src.write_bytes(torch_zip_bytes(MiB))
    s = snaps_for(tmp_path)
    u = file_unit(src)
    s.look([u], lambda u: False)
    s.take([u], no)
    assert s.live == {} and not (tmp_path / "state" / "sync" / "snapshots").exists()


# --- links -----------------------------------------------------------------------------------------------

def test_a_file_replaced_by_rename_gets_a_hard_link_kept_until_the_path_moves_on(tmp_path):
    src = tmp_path / "out" / "last.ckpt"
    src.parent.mkdir()
    src.write_bytes(torch_zip_bytes(MiB, seed=0))
    s = snaps_for(tmp_path)
    u = seen_twice(s, src, lambda: replace_by_rename(src, torch_zip_bytes(MiB, seed=1)))
    ctime_judged = u.selected[0].ctime_ns
    s.take([u], no)
    (snap,) = s.live.values()
    (link,) = snapshot_files(tmp_path)
    st = os.stat(src)
    assert snap.mode == "link" and os.stat(link).st_ino == st.st_ino and st.st_nlink == 2
    # the link moved the inode's ctime: the version sent and recorded is the one the next scan sees
    assert u.selected[0].ctime_ns == st.st_ctime_ns == snap.source.ctime_ns
    assert st.st_ctime_ns >= ctime_judged
    s.release()
    assert snapshot_files(tmp_path) == [link]  # kept: removing it would move the ctime again
    s.look([file_unit(src)], lambda u: True)
    assert snapshot_files(tmp_path) == [link]
    replace_by_rename(src, torch_zip_bytes(MiB, seed=2))  # the next save: the link is of nothing here now
    s.look([file_unit(src)], lambda u: False)
    assert snapshot_files(tmp_path) == []


# --- the disk guard, and the folder on another file system ------------------------------------------------

def test_on_another_file_system_the_folder_is_at_its_top_and_a_full_disk_means_no_copy(tmp_path):
    with small_tmpfs(48 * MiB, "tsnap-") as mnt:
        src = mnt / "out" / "ckpt.pt"
        src.parent.mkdir()
        src.write_bytes(torch_zip_bytes(8 * MiB, seed=0))
        # the default margin (1 GiB) is more than this whole file system: no copy, said, sent as before
        s = snaps_for(tmp_path)
        u = seen_twice(s, src, lambda: rewrite_in_place(src, torch_zip_bytes(8 * MiB, seed=1)))
        s.take([u], no)
        assert s.live == {} and s.taken["skipped"] == 1
        note = s.saves.track("ckpt.pt").note
        assert note.startswith("no snapshot (") and "free" in note
        top = mnt / MOUNT_DIR
        assert top.is_dir() and stat.S_IMODE(os.stat(top).st_mode) == 0o700 and os.stat(top).st_uid == os.geteuid()
        assert list(top.iterdir()) == []
        # with room: the copy is made there, on the file's own file system
        s2 = snaps_for(tmp_path, margin_min=0)
        u = seen_twice(s2, src, lambda: rewrite_in_place(src, torch_zip_bytes(8 * MiB, seed=2)))
        s2.take([u], no)
        (snap,) = s2.live.values()
        assert snap.mode == "copy" and (top / slot(str(src)) / "ckpt.pt").read_bytes() == src.read_bytes()
        assert snap.read.path.startswith(f"/proc/{os.getpid()}/fd/")  # read through our descriptor
        s2.release()
        assert list(top.iterdir()) == []
        # the walk never enters it
        assert is_cache_dir(MOUNT_DIR) and not Policy(["**/*.pt"], [], []).enter_dir(MOUNT_DIR)


def test_a_folder_there_that_is_not_ours_is_refused_not_followed(tmp_path):
    with small_tmpfs(16 * MiB, "tsnap-") as mnt:
        src = mnt / "ckpt.pt"
        src.write_bytes(torch_zip_bytes(MiB, seed=0))
        elsewhere = mnt / "elsewhere"
        elsewhere.mkdir()
        os.symlink(elsewhere, mnt / MOUNT_DIR)  # put there by someone else
        s = snaps_for(tmp_path, margin_min=0)
        u = seen_twice(s, src, lambda: rewrite_in_place(src, torch_zip_bytes(MiB, seed=1)))
        s.take([u], no)
        assert s.live == {} and list(elsewhere.iterdir()) == []
        assert MOUNT_DIR in s.saves.track("ckpt.pt").note


# --- the target behind: status, words, the alert ----------------------------------------------------------

def test_behind_shows_raises_and_resolves_once_caught_up(tmp_path):
    clock = FakeClock()
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "alerts": {"first_delay": "0"}})
    alerts = Alerts(cfg.alerts, clock, cfg.state_dir, ListMailer(), hostname="box")
    b = board()
    behind = Behind(b, alerts, "s3://bucket/run")
    behind.update([Lag("ckpt.pt", "/o/ckpt.pt", 2, 100.0)], {"ckpt.pt"})
    assert b.behind == [] and alerts.active() == []
    behind.update([Lag("ckpt.pt", "/o/ckpt.pt", 3, 100.0)], {"ckpt.pt"})
    assert b.behind == [{"unit": "ckpt.pt", "path": "/o/ckpt.pt", "saves": 3, "since": 100.0}]
    (a,) = alerts.active()
    assert a["key"] == BEHIND_KEY + "ckpt.pt" and "3 saves behind" in a["subject"]
    behind.update([Lag("ckpt.pt", "/o/ckpt.pt", 1, 100.0)], {"ckpt.pt"})  # held until caught up
    assert b.behind[0]["saves"] == 1 and len(alerts.active()) == 1
    behind.update([Lag("ckpt.pt", "/o/ckpt.pt", 0, None)], {"ckpt.pt"})
    assert b.behind == [] and alerts.active() == []
    # a restarted daemon resolves an earlier one's alert once the unit is on the target (or gone)
    behind.update([Lag("ckpt.pt", "/o/ckpt.pt", 4, 100.0)], {"ckpt.pt"})
    again = Behind(board(), alerts, "s3://bucket/run")
    assert again.on == {"ckpt.pt"}
    again.update([], set())
    assert alerts.active() == []


def test_the_words_in_status_and_the_mail():
    assert behind_line("/w/out/ckpt.pt", 45) == \
        "target 45 saves behind for /w/out/ckpt.pt: the file is rewritten faster than it uploads"
    st = {"now": 1000.0, "sync": {"target": "s3://b/r", "state": "uploading", "target_behind": [
        {"unit": "ckpt.pt", "path": "/w/out/ckpt.pt", "saves": 45, "since": 280.0}]}}
    assert ("          target 45 saves behind for /w/out/ckpt.pt: the file is rewritten faster than it uploads "
            "(behind for 12m00s; save less often, or give the upload more bandwidth)") in sync_lines(st)
    m = target_behind("s3://b/r", "/w/out/ckpt.pt", 45, 280.0, "no snapshot (1 GB free)")
    assert m.subject == "sync: target 45 saves behind for ckpt.pt"
    assert "45 times since the version s3://b/r holds" in m.body and "no snapshot (1 GB free)" in m.body
