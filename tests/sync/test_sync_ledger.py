"""The ledger survives anything: restarts, torn lines, kill -9 mid-write, a crash inside compaction,
a corrupt snapshot, and a second process trying to use it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from supervisor.sync.ledger import Entry, Ledger, LedgerBusy
from tests.fixtures.sync_engine import REPO
from tests.waiting import wait_until


def e(i: int) -> Entry:
    return Entry(size=i, mtime_ns=i * 1000, sha256=f"{i:064x}", etag=f"etag{i}", src=f"/w/f{i}", at=float(i))


def test_roundtrip_and_queries(tmp_path):
    lg = Ledger(tmp_path, "s3://b/p@aws")
    lg.begin("a/x", 5, 5000, {"mode": "mp", "upload_id": "U"})
    lg.part("a/x", 1, "etag1", "crc1", 5)
    lg.done("b/y", e(7))
    lg.manifest_done("b", "d1", 1.0)
    lg.close()
    lg = Ledger(tmp_path, "s3://b/p@aws")
    assert lg.current("b/y", 7, 7000) == e(7)
    assert lg.current("b/y", 7, 7001) is None  # another version of the file: not held
    assert lg.in_flight("a/x")["parts"] == {"1": ["etag1", "crc1", 5]}
    assert lg.in_flight("a/x")["info"]["upload_id"] == "U"
    assert lg.manifest("b")["digest"] == "d1"
    assert lg.totals() == (1, 7)
    assert lg.keys_under("b") == ["b/y"] and lg.keys_under("") == ["b/y"]
    lg.forget("b/y")
    lg.manifest_forget("b")
    lg.close()
    lg = Ledger(tmp_path, "s3://b/p@aws")
    assert lg.get("b/y") is None and lg.manifest("b") is None and lg.totals() == (0, 0)
    lg.close()


def test_each_target_has_its_own_ledger(tmp_path):
    a = Ledger(tmp_path, "s3://b/p@http://127.0.0.1:1")
    a.done("k", e(1))
    a.close()
    b = Ledger(tmp_path, "s3://b/p@aws")
    assert b.get("k") is None
    b.close()


def test_torn_last_line_is_skipped_and_does_not_swallow_the_next(tmp_path):
    lg = Ledger(tmp_path, "t")
    lg.done("a", e(1))
    lg.close()
    with open(lg.journal_path, "ab") as f:
        f.write(b'{"op":"done","k":"b","e":[2,2000,"')  # kill -9 in the middle of a write
    lg = Ledger(tmp_path, "t")
    assert lg.get("a") == e(1) and lg.get("b") is None and lg.skipped_lines == 1
    lg.done("c", e(3))
    lg.close()
    lg = Ledger(tmp_path, "t")
    assert lg.get("c") == e(3)
    lg.close()


def test_compaction_and_a_crash_between_its_two_steps(tmp_path):
    lg = Ledger(tmp_path, "t")
    for i in range(50):
        lg.done(f"k{i}", e(i))
    lg.forget("k0")
    journal_before = lg.journal_path.read_bytes()
    lg.compact()
    lg.done("after", e(99))
    lg.close()
    lg2 = Ledger(tmp_path, "t")
    assert lg2.get("k0") is None and lg2.get("k49") == e(49) and lg2.get("after") == e(99)
    assert lg2.totals()[0] == 50
    lg2.close()
    # crash after the new snapshot was written but before the journal was emptied: the old
    # journal (older generation) must not be replayed on top of the snapshot
    lg2 = Ledger(tmp_path, "t")
    lg2.compact()
    lg2.close()
    lg.journal_path.write_bytes(journal_before)  # the pre-compaction journal, generation 0
    lg3 = Ledger(tmp_path, "t")
    assert lg3.get("k0") is None and lg3.get("after") == e(99) and lg3.totals()[0] == 50
    lg3.close()


def test_corrupt_snapshot_is_set_aside(tmp_path):
    lg = Ledger(tmp_path, "t")
    lg.done("a", e(1))
    lg.compact()
    lg.close()
    lg.snapshot_path.write_text("{not json")
    lg = Ledger(tmp_path, "t")
    assert lg.get("a") is None  # lost: a re-upload, never a false "uploaded"
    assert list(lg.dir.glob("snapshot.json.corrupt-*"))
    lg.close()


def test_second_process_is_refused(tmp_path):
    lg = Ledger(tmp_path, "t")
    code = ("import sys; from supervisor.sync.ledger import Ledger, LedgerBusy\n"
            "try:\n    Ledger(sys.argv[1], 't')\nexcept LedgerBusy as e:\n    print(e); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 3 and "in use by another process" in r.stdout
    lg.close()
    with pytest.raises(LedgerBusy):
        a = Ledger(tmp_path, "t")
        try:
            Ledger(tmp_path, "t")
        finally:
            a.close()


WRITER = """
import sys, json
from supervisor.sync.ledger import Entry, Ledger
lg = Ledger(sys.argv[1], "t")
i = 0
while True:
    lg.begin(f"k{i}", i, i, {"n": i})
    lg.done(f"k{i}", Entry(i, i, "%064x" % i, "", "", 0.0))
    if i % 37 == 0:
        lg.sync()
    if i % 500 == 499:
        lg.compact()
    print(i, flush=True)
    i += 1
"""


@pytest.mark.parametrize("after", [3, 200, 700])
def test_kill9_mid_write_leaves_a_consistent_ledger(tmp_path, after):
    """SIGKILL a process appending as fast as it can (compacting now and then): what it
    confirmed is there, in order, with no gaps; what it never confirmed is not."""
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    seen = []
    assert p.stdout is not None
    wait_until(lambda: seen.append(int(p.stdout.readline())) or seen[-1] >= after, 30, interval=0)
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    lg = Ledger(tmp_path, "t")
    done = sorted(int(k[1:]) for k in lg.files)
    assert done == list(range(len(done))), "a gap: a record was lost before a later one"
    assert len(done) >= seen[-1] + 1  # everything it printed (after done()) survived
    for k in lg.inflight:
        assert int(k[1:]) == len(done), "only the one being written can be in flight"
    lg.close()


def test_journal_lines_are_json_objects(tmp_path):
    lg = Ledger(tmp_path, "t")
    lg.done("weird \"key\"\n/ü", e(1))
    lg.close()
    lines = lg.journal_path.read_text().splitlines()
    assert all(isinstance(json.loads(x), dict) for x in lines)
    lg = Ledger(tmp_path, "t")
    assert lg.get("weird \"key\"\n/ü") == e(1)
    lg.close()


def test_twin_finds_another_key_with_the_same_content_after_any_change(tmp_path):
    """twin(): the key a server-side copy may come from. Only a key whose recorded content is
    exactly this (sha256 and size), never the key being uploaded, and nothing once forgotten or
    replaced; the same after a reopen (journal replay) and after compaction (snapshot)."""
    lg = Ledger(tmp_path, "s3://b/p@aws")
    tok = Entry(size=300_000, mtime_ns=1, sha256="a" * 64, etag="0" * 32, src="/w/1/tokenizer.json", at=1.0)
    lg.done("checkpoint-1/tokenizer.json", tok)
    assert lg.twin("a" * 64, 300_000, besides="checkpoint-2/tokenizer.json") == ("checkpoint-1/tokenizer.json", tok)
    assert lg.twin("a" * 64, 300_000, besides="checkpoint-1/tokenizer.json") is None  # itself
    assert lg.twin("a" * 64, 299_999, besides="x") is None  # same hash, other size: not the same content
    assert lg.twin("b" * 64, 300_000, besides="x") is None
    lg.done("checkpoint-2/tokenizer.json", tok)
    assert lg.twin("a" * 64, 300_000, besides="x")[0] == "checkpoint-2/tokenizer.json"  # the newest holder
    lg.forget("checkpoint-1/tokenizer.json")  # keep_last deleted the oldest
    assert lg.twin("a" * 64, 300_000, besides="x")[0] == "checkpoint-2/tokenizer.json"
    lg.done("checkpoint-1/tokenizer.json", tok)
    lg.forget("checkpoint-1/tokenizer.json")  # the newest holder gone: the other one still is
    assert lg.twin("a" * 64, 300_000, besides="x")[0] == "checkpoint-2/tokenizer.json"
    lg.forget("checkpoint-2/tokenizer.json")
    assert lg.twin("a" * 64, 300_000, besides="x") is None
    lg.done("checkpoint-3/tokenizer.json", tok)
    lg.done("checkpoint-4/tokenizer.json", tok)
    lg.done("checkpoint-4/tokenizer.json", Entry(300_000, 3, "d" * 64, "2" * 32, "/w/4/tokenizer.json", 3.0))
    assert lg.twin("a" * 64, 300_000, besides="x")[0] == "checkpoint-3/tokenizer.json"  # the newest got new bytes
    lg.forget("checkpoint-3/tokenizer.json")
    lg.forget("checkpoint-4/tokenizer.json")
    lg.done("checkpoint-1/tokenizer.json", tok)
    lg.done("checkpoint-1/tokenizer.json", Entry(300_000, 2, "c" * 64, "1" * 32, "/w/1/tokenizer.json", 2.0))
    assert lg.twin("a" * 64, 300_000, besides="x") is None  # the only holder now has other bytes
    assert lg.twin("c" * 64, 300_000, besides="x")[0] == "checkpoint-1/tokenizer.json"
    lg.close()
    for step in ("reopened", "compacted"):
        lg = Ledger(tmp_path, "s3://b/p@aws")
        assert lg.twin("c" * 64, 300_000, besides="x")[0] == "checkpoint-1/tokenizer.json", step
        assert lg.twin("a" * 64, 300_000, besides="x") is None, step
        lg.compact()
        lg.close()


def test_a_content_check_is_recorded_for_the_version_checked_and_survives_compaction(tmp_path):
    lg = Ledger(tmp_path, "t")
    lg.done("a", e(1))
    lg.done("b", e(2))
    lg.checked({"a": e(1).sha256, "b": e(3).sha256, "gone": "0" * 64}, at=100.0)
    assert lg.get("a").checked == 100.0
    assert lg.get("b").checked == 0.0  # another version was checked: not this one
    lg.done("a", e(4))  # sent again: its new version was never checked
    assert lg.get("a").checked == 0.0
    lg.checked({"a": e(4).sha256}, at=200.0)
    lg.close()
    lg = Ledger(tmp_path, "t")  # replayed from the journal
    assert lg.get("a").checked == 200.0 and lg.get("b").checked == 0.0
    lg.compact()
    lg.close()
    lg = Ledger(tmp_path, "t")  # read from the snapshot
    assert lg.get("a").checked == 200.0 and lg.get("a").sha256 == e(4).sha256
    assert Entry.unpack(e(5).pack()) == e(5)  # an entry never checked packs as before (older readers)
    assert len(e(5).pack()) == 6
    lg.close()
