"""What the sync opens in a folder the training user writes (issue 35, findings 3 and 4).

A FIFO swapped in for a checkpoint file after the scan must not hold a worker in its open (it
would wait for a writer forever, and with it the final sync and the stop), and a sparse file
(`truncate -s 1T`) must not cost a terabyte of upload: it is left out of its folder's upload,
named in the manifest and alerted with both sizes."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from supervisor.saves.complete import SPARSE_MIN, sparse
from supervisor.store.base import LocalFile, SourceProblem, open_source
from supervisor.sync.walk import read_whole
from supervisor.untrusted.fileopen import NotRegular, open_regular
from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.sync_engine import ListMailer
from tests.waiting import wait_until


def in_time(fn, seconds: float = 10.0):
    """fn's result, or a failure naming the hang when it takes longer (a thread that blocks in an
    open of a FIFO is let go: the test's FIFO is then opened for writing to release it)."""
    box: dict = {}

    def run() -> None:
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} blocked for {seconds}s"
    if "e" in box:
        raise box["e"]
    return box.get("v")


def test_open_regular_refuses_a_fifo_at_once_and_names_it(tmp_path):
    p = tmp_path / "optimizer.pt"
    os.mkfifo(p)
    with pytest.raises(NotRegular, match="FIFO"):
        in_time(lambda: open_regular(str(p)))
    (tmp_path / "real").write_bytes(b"x")
    fd = open_regular(str(tmp_path / "real"))
    assert os.get_blocking(fd)
    os.close(fd)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(OSError):
        open_regular(str(tmp_path / "link"))


def test_a_file_swapped_for_a_fifo_after_the_scan_is_a_source_problem(tmp_path):
    p = tmp_path / "checkpoint-10" / "optimizer.pt"
    p.parent.mkdir()
    p.write_bytes(b"PK" + b"\0" * 100)
    st = p.stat()
    f = LocalFile(str(p), "checkpoint-10/optimizer.pt", st.st_size, st.st_mtime_ns, st.st_ino)
    p.unlink()
    os.mkfifo(p)
    with pytest.raises(SourceProblem, match="FIFO") as e:
        in_time(lambda: open_source(f))
    assert e.value.kind == "unreadable"
    assert in_time(lambda: read_whole(str(p), "zip", 102)) is None  # the scanner's header read, too


def test_the_local_target_skips_the_fifo_and_goes_on(tmp_path, make_engine):
    from supervisor.config.target import parse_target
    from supervisor.store import make_target

    e = make_engine({"target": str(tmp_path / "remote"), "watch": [str(tmp_path / "out")]}, start=False)
    target = make_target(parse_target(str(tmp_path / "remote")), e.cfg, e.state_dir)
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"a" * 10)
    b.write_bytes(b"b" * 10)
    files = [LocalFile(str(p), f"u/{p.name}", 10, p.stat().st_mtime_ns, p.stat().st_ino) for p in (a, b)]
    a.unlink()
    os.mkfifo(a)

    class Sink:
        def __init__(self):
            self.finished, self.problems = [], []

        def begin(self, f, info): pass
        def part(self, *a): pass
        def done(self, f, r): self.finished.append(f.key)  # noqa: E704
        def problem(self, f, err): self.problems.append(str(err))  # noqa: E704
        def progress(self, f, n): pass
        def in_flight(self, key): return None  # noqa: E704
        def twin(self, f, sha): return None  # noqa: E704
        def cancelled(self): return False  # noqa: E704

    sink = Sink()
    in_time(lambda: target.put_files(files, sink))
    assert sink.finished == ["u/b.bin"] and "FIFO" in sink.problems[0]


def test_a_fifo_flipped_in_and_out_while_the_sync_runs_holds_nothing_up(tmp_path, make_engine):
    out = tmp_path / "out"
    remote = tmp_path / "remote"
    w = HFWriter(out)
    w.checkpoint(10)
    e = make_engine({"target": str(remote), "watch": [str(out)], "rescan_interval": "0.2s"})
    victim = out / "checkpoint-10" / "optimizer.pt"
    data = victim.read_bytes()
    stop = threading.Event()

    def flip() -> None:  # a regular file, then a FIFO under the same name, again and again
        n = 0
        while not stop.is_set():
            tmp = victim.with_name(f".flip-{n}")
            if n % 2:
                tmp.write_bytes(data)
            else:
                os.mkfifo(tmp)
            os.replace(tmp, victim)
            n += 1
            time.sleep(0.003)
        tmp = victim.with_name(".flip-last")
        tmp.write_bytes(data)
        os.replace(tmp, victim)

    t = threading.Thread(target=flip, daemon=True)
    t.start()
    try:
        time.sleep(1.0)  # let passes meet the flipping file
        w.checkpoint(20)
        wait_until(lambda: (remote / "checkpoint-20" / "_MANIFEST.json").exists(), 60,
                   what="checkpoint-20 on the target while checkpoint-10 flips")
    finally:
        stop.set()
        t.join(10)
    r = e.wait_idle(60)
    assert r.ok, r.error
    assert (remote / "checkpoint-10" / "optimizer.pt").read_bytes() == data


# --- sparse files ---------------------------------------------------------------------------------------

def test_the_sparse_rule():
    assert sparse(1 << 40, 4096)
    assert sparse(SPARSE_MIN, SPARSE_MIN // 8 - 1)
    assert not sparse(SPARSE_MIN - 1, 0)                  # small: costs nothing worth a word
    assert not sparse(1 << 30, (1 << 30) // 2)            # compressed 2x on ZFS: a real file
    assert not sparse(1 << 30, 1 << 30)


def test_a_one_terabyte_sparse_file_beside_a_real_checkpoint_is_left_out_and_named(tmp_path, make_engine):
    out = tmp_path / "out"
    remote = tmp_path / "remote"
    w = HFWriter(out)
    ck = w.checkpoint(10)
    hole = ck / "pad.bin"
    with open(hole, "wb") as fh:
        fh.truncate(1 << 40)
    if os.stat(hole).st_blocks * 512 >= (1 << 40) // 8:
        pytest.skip("this file system does not keep sparse files")
    os.utime(ck / "trainer_state.json")  # the marker after the pad, as a trainer would leave it
    mailer = ListMailer()
    e = make_engine({"target": str(remote), "watch": [str(out)]}, mailer=mailer)
    t0 = time.monotonic()
    r = e.wait_idle(60)
    assert r.ok, r.error
    assert time.monotonic() - t0 < 30  # not a terabyte's worth of copying
    assert not (remote / "checkpoint-10" / "pad.bin").exists()
    assert (remote / "checkpoint-10" / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
    doc = json.loads((remote / "checkpoint-10" / "_MANIFEST.json").read_bytes())
    assert doc["complete"] is False and doc["damaged"] == ["pad.bin"]
    assert "sparse" in doc["partial"] and "1.0 TiB" in doc["partial"], doc["partial"]
    assert "pad.bin" not in {f["path"] for f in doc["files"]}
    assert "checkpoint-10" in e.status()["partial"]
    subject = wait_until(lambda: next((s for s in mailer.subjects() if "sparse" in s), None), 20,
                         what="the sparse-file alert")
    assert "pad.bin" in subject and "1.0 TiB" in subject
    # nothing waits on it: a final sync of the folder completes
    fin = e.final_sync([str(out)], 60)
    assert fin.ok, fin.error
