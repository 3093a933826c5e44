"""A single checkpoint file saved faster than it uploads, through the real engine (issue 50).

nanoGPT's `torch.save(ckpt, out_dir/'ckpt.pt')` rewrites the same inode at every eval; with a slow
uplink every upload of it was cut short and the target sat 45 iterations behind while status said
"last ok 0s ago". Here a writer rewrites a torch zip in place while its upload runs (a real S3 target,
throttled by sync.bandwidth_limit): the upload goes on from a snapshot and lands whole and verified,
status says how many saves the target is behind, an alert is raised, and both clear once the newest
save is there. A writer that replaces the file by rename gets a hard link, not a copy; the real
torch.save (TSUP_HF_PYTHON) is driven save by save the same way. Time: the engine's clock is a
FakeClock; the writer waits on conditions, never sleeps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cli.render import sync_lines
from supervisor.clock import FakeClock
from supervisor.sync.targethealth import BEHIND_KEY
from tests.fixtures.hf_writer import sha256, torch_zip_bytes
from tests.waiting import wait_until

MiB = 1 << 20
HF_PYTHON = os.environ.get("TSUP_HF_PYTHON")


def rewrite_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as fh:  # what torch.save(obj, path) does: the same inode, truncated, written
        fh.truncate(0)
        fh.write(data)


def replace_by_rename(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")  # Lightning's save: a new file, renamed over the old one
    tmp.write_bytes(data)
    os.rename(tmp, path)


def snapshots(tmp: Path, name: str) -> list[Path]:
    return [p for p in (tmp / "state" / "sync" / "snapshots").rglob(name) if p.is_file()]


def behind(e) -> list[dict]:
    return e.status().get("target_behind") or []


def counted(e, key: str) -> int:
    """The saves of `key` the engine has seen whole (a writer that saves again within a few
    milliseconds, before the hint is read, is one save for the engine: real evals are seconds apart)."""
    t = e.up.snaps.saves.track(key)
    return t.count if t is not None else 0


class LedgerLog:
    """The versions of one key the ledger recorded on the target, in order (polled while waiting)."""

    def __init__(self, e, key: str):
        self.e, self.key, self.shas = e, key, []

    def poll(self) -> None:
        entry = self.e.ledger.files.get(self.key)
        if entry is not None and (not self.shas or self.shas[-1] != entry.sha256):
            self.shas.append(entry.sha256)

    def until(self, fn, timeout: float, what: str):
        def check():
            self.poll()
            return fn()
        return wait_until(check, timeout, interval=0.02, what=what)


def s3_engine(make_engine, s3_server, s3_prefix, out: Path):
    # 12 MiB in 5 MiB parts at 4 MiB/s: each upload takes ~3 s, reading the file part by part
    return make_engine({**s3_server.sync_config(s3_prefix, part_size="5M", multipart_threshold="5M",
                                                bandwidth_limit="4M"),
                        "watch": [str(out)], "quiet_period": "0s"}, clock=FakeClock())


def test_a_file_rewritten_in_place_faster_than_it_uploads_goes_up_whole_and_the_lag_is_told(
        make_engine, s3_server, s3_prefix, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ckpt = out / "ckpt.pt"
    versions = [torch_zip_bytes(12 * MiB, seed=i) for i in range(5)]
    shas = [sha256(v) for v in versions]
    ckpt.write_bytes(versions[0])
    e = s3_engine(make_engine, s3_server, s3_prefix, out)
    assert e.wait_idle(60).ok
    key = f"{s3_prefix}/ckpt.pt"
    assert sha256(s3_server.get(key)) == shas[0]
    led = LedgerLog(e, "ckpt.pt")
    led.poll()

    rewrite_in_place(ckpt, versions[1])  # the next eval: the same inode
    led.until(lambda: e.status()["state"] == "uploading" and snapshots(tmp_path, "ckpt.pt"), 30,
              "the new save going up from its snapshot")
    for i in (2, 3, 4):  # three more evals while it goes up: each counted as a save, none stops it
        rewrite_in_place(ckpt, versions[i])
        wait_until(lambda i=i: counted(e, "ckpt.pt") == i + 1, 10, what=f"save {i} counted")
    lag = led.until(lambda: [b for b in behind(e) if b["saves"] >= 3], 30, "the target behind in status")
    assert lag[0]["unit"] == "ckpt.pt" and lag[0]["path"] == str(ckpt) and lag[0]["since"]
    st = e.status()
    text = "\n".join(sync_lines({"now": e.clock.time(), "sync": st}))
    assert f"saves behind for {ckpt}: the file is rewritten faster than it uploads" in text
    assert [a for a in e.alerts.active() if a["key"] == BEHIND_KEY + "ckpt.pt"]

    # the writer stops: the newest save goes up, and the lag and its alert clear
    led.until(lambda: not behind(e) and e.ledger.files["ckpt.pt"].sha256 == shas[4], 60,
              "the newest save on the target")
    assert sha256(s3_server.get(key)) == shas[4] and s3_server.uploads(s3_prefix) == []
    assert not [a for a in e.alerts.active() if a["key"].startswith(BEHIND_KEY)]
    # what went up: v0, then v1 whole although rewritten three times under its upload, then the newest
    assert led.shas[:2] == shas[:2] and led.shas[-1] == shas[4] and set(led.shas) <= set(shas), led.shas
    assert e.wait_idle(30).ok and snapshots(tmp_path, "ckpt.pt") == []  # each copy removed once sent
    snaps = e.up.snaps.taken
    assert snaps["copy"] >= 2 and snaps["discarded"] == 0 and snaps["link"] == 0, snaps


def test_a_file_replaced_by_rename_goes_up_from_a_hard_link(make_engine, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ckpt = out / "last.ckpt"
    versions = [torch_zip_bytes(2 * MiB, seed=i) for i in range(3)]
    replace_by_rename(ckpt, versions[0])
    remote = tmp_path / "remote"
    e = make_engine({"target": str(remote), "watch": [str(out)], "quiet_period": "0s", "bandwidth_limit": "4M"},
                    clock=FakeClock())
    assert e.wait_idle(60).ok and (remote / "last.ckpt").read_bytes() == versions[0]
    replace_by_rename(ckpt, versions[1])  # a new inode: a link holds the judged one, no copy
    wait_until(lambda: (remote / "last.ckpt").exists() and sha256((remote / "last.ckpt").read_bytes()) ==
               sha256(versions[1]), 30, what="the second save on the target")
    assert e.wait_idle(30).ok
    (link,) = snapshots(tmp_path, "last.ckpt")
    st = os.stat(ckpt)
    assert os.stat(link).st_ino == st.st_ino and st.st_nlink == 2  # the same inode: nothing copied
    taken = dict(e.up.snaps.taken)
    assert taken["link"] == 1 and taken["copy"] == 0
    # the link moved the inode's ctime; what the ledger holds is that version: no second upload
    sent = e.stats["files_uploaded"]
    e.request_sync()
    assert e.wait_idle(30).ok and e.stats["files_uploaded"] == sent
    replace_by_rename(ckpt, versions[2])  # the next save: the old link goes, a new one holds this inode
    wait_until(lambda: sha256((remote / "last.ckpt").read_bytes()) == sha256(versions[2]), 30,
               what="the third save on the target")
    assert e.wait_idle(30).ok
    (link,) = snapshots(tmp_path, "last.ckpt")
    assert os.stat(link).st_ino == os.stat(ckpt).st_ino and os.stat(ckpt).st_nlink == 2


SAVER = """
import hashlib, sys, torch
path, n = sys.argv[1], int(sys.argv[2])
for line in sys.stdin:
    i = int(line)
    torch.save({"iter_num": i, "model": {"w": torch.full((n,), float(i))}}, path)  # in place, like nanoGPT
    print(hashlib.sha256(open(path, "rb").read()).hexdigest(), flush=True)
"""


@pytest.mark.skipif(not HF_PYTHON, reason="TSUP_HF_PYTHON is not set (tests/run.sh builds .venv-hf with torch)")
def test_the_real_torch_save_in_place_through_the_engine(make_engine, s3_server, s3_prefix, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ckpt = out / "ckpt.pt"
    saver = subprocess.Popen([HF_PYTHON or sys.executable, "-c", SAVER, str(ckpt), str(3 * MiB)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert saver.stdin is not None and saver.stdout is not None
    written: list[str] = []

    def save(i: int) -> None:
        saver.stdin.write(f"{i}\n")
        saver.stdin.flush()
        written.append(saver.stdout.readline().strip())  # the save is whole on disk when it answers

    try:
        save(0)
        e = s3_engine(make_engine, s3_server, s3_prefix, out)
        assert e.wait_idle(60).ok
        led = LedgerLog(e, "ckpt.pt")
        save(1)
        led.until(lambda: e.status()["state"] == "uploading" and snapshots(tmp_path, "ckpt.pt"), 30,
                  "the save going up from its snapshot")
        for i in (2, 3, 4):
            save(i)
            wait_until(lambda i=i: counted(e, "ckpt.pt") == i + 1, 10, what=f"save {i} counted")
        led.until(lambda: behind(e), 30, "the target behind in status")
        led.until(lambda: not behind(e) and e.ledger.files["ckpt.pt"].sha256 == written[-1], 60,
                  "the newest save on the target")
        assert sha256(s3_server.get(f"{s3_prefix}/ckpt.pt")) == written[-1]
        assert written[1] in led.shas and set(led.shas) <= set(written), (led.shas, written)
    finally:
        saver.stdin.close()
        saver.wait(30)
