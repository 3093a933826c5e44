"""A file rewritten in place with its mtime set back (issue 49): same size, same mtime, other bytes.
The ctime is part of the version the engine and the ledger know, so the new bytes go up and the
final sync never calls the old ones verified."""

from __future__ import annotations

import os
import time

from tests.fixtures.hf_writer import HFWriter


def test_bytes_rewritten_under_an_old_mtime_are_sent_again_and_verified_as_the_new_ones(make_engine, tmp_path):
    remote = tmp_path / "remote"
    w = HFWriter(tmp_path / "out")
    w.checkpoint(10)
    w.age(60)
    e = make_engine({"target": str(remote), "watch": [str(w.out)], "quiet_period": "0.5s"})
    r = e.wait_idle(60)
    assert r.ok, r
    f = w.out / "checkpoint-10" / "config.json"
    assert (remote / "checkpoint-10" / "config.json").read_bytes() == f.read_bytes()
    st = os.stat(f)
    new = bytes(reversed(f.read_bytes()))  # same length, other bytes
    time.sleep(0.01)  # a ctime that differs from the upload's, on file systems with coarse clocks
    with open(f, "r+b") as fh:
        fh.write(new)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime set back: only the ctime moved
    assert (os.stat(f).st_size, os.stat(f).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    r = e.final_sync([str(w.out)], 60)
    assert r.ok, r
    assert (remote / "checkpoint-10" / "config.json").read_bytes() == new
