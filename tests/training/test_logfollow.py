"""LogFollower on real files: growth, tqdm carriage returns, partial lines, rotation, truncation,
garbage bytes, and a listener that raises."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.training.logfollow import LogFollower


class Rec:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.resets = 0

    def feed_line(self, line: str, now: float) -> None:
        self.lines.append(line)

    def reset(self, now: float) -> None:
        self.resets += 1


def append(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_follows_growth_and_waits_for_the_file(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r])
    assert f.poll(0) == 0  # not there yet
    append(p, b"one\ntwo\n")
    assert f.poll(1) == 2
    append(p, b"three\n")
    f.poll(2)
    assert r.lines == ["one", "two", "three"]
    assert f.poll(3) == 0


def test_start_at_end_skips_old_content_only(tmp_path):
    p = tmp_path / "train.log"
    p.write_bytes(b"CUDA out of memory (yesterday)\n")
    r = Rec()
    f = LogFollower(str(p), [r], start_at_end=True)
    f.poll(0)
    append(p, b"new line\n")
    f.poll(1)
    assert r.lines == ["new line"]


def test_start_at_end_for_a_file_created_later_reads_it_whole(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r], start_at_end=True)
    f.poll(0)
    p.write_bytes(b"first\n")
    f.poll(1)
    assert r.lines == ["first"]


def test_tqdm_carriage_returns_and_crlf(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r])
    append(p, b"\r  0%|          | 0/100\r 10%|#         | 10/100\r 20%|##        | 20/100")
    f.poll(0)
    assert r.lines == ["  0%|          | 0/100", " 10%|#         | 10/100"]  # the last one is still being drawn
    append(p, b"\r100%|##########| 100/100\r\n{'loss': 1.5}\r\n")
    f.poll(1)
    assert r.lines[2:] == [" 20%|##        | 20/100", "100%|##########| 100/100", "{'loss': 1.5}"]


def test_partial_line_completed_later(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r])
    append(p, b"torch.OutOfMemoryError: CUDA out of mem")
    f.poll(0)
    assert r.lines == []
    append(p, b"ory. Tried to allocate 2.00 GiB\n")
    f.poll(1)
    assert r.lines == ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]


def test_stale_partial_line_is_flushed(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r], partial_flush_s=5)
    append(p, b"Enter a value: ")
    f.poll(100)
    f.poll(104)
    assert r.lines == []
    f.poll(105)
    assert r.lines == ["Enter a value: "]


def test_overlong_line_is_cut(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r], max_line=1000)
    append(p, b"x" * 3500)
    f.poll(0)
    assert [len(x) for x in r.lines] == [1000, 1000, 1000]
    append(p, b"y" * 5000 + b"\n")
    f.poll(1)
    assert all(len(x) <= 1000 for x in r.lines)


def test_truncation_starts_over_and_resets_listeners(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r])
    append(p, b"a long first line of the old run\nsecond\n")
    f.poll(0)
    with open(p, "wb") as fh:  # copytruncate / `> train.log`
        fh.write(b"fresh\n")
    f.poll(1)
    assert r.lines[-1] == "fresh" and r.resets == 1


def test_rotation_reads_the_old_file_to_its_end_then_the_new_one(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r])
    append(p, b"before\n")
    f.poll(0)
    append(p, b"written just before rotation\npartial")
    os.rename(p, tmp_path / "train.log.1")
    append(p, b"new file\n")
    f.poll(1)
    assert r.lines == ["before", "written just before rotation", "partial", "new file"]
    assert r.resets == 0  # rotation is the same run
    append(p, b"more\n")
    f.poll(2)
    assert r.lines[-1] == "more"


def test_file_removed_and_recreated(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r])
    append(p, b"one\n")
    f.poll(0)
    p.unlink()
    assert f.poll(1) == 0
    append(p, b"two\n")
    f.poll(2)
    assert r.lines == ["one", "two"]


def test_switch_to_the_same_file_keeps_position(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r], start_at_end=True)
    append(p, b"run 1 line\n")
    f.poll(0)
    append(p, b"run 2 banner\n")
    f.switch(str(p), start_at_end=True)  # a new run logging to the same file
    f.poll(1)
    assert r.lines == ["run 1 line", "run 2 banner"]


def test_switch_to_another_file(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_bytes(b"a1\n")
    b.write_bytes(b"old b\n")
    r = Rec()
    f = LogFollower(str(a), [r])
    f.poll(0)
    f.switch(str(b), start_at_end=True)
    append(b, b"b1\n")
    append(a, b"a2\n")
    f.poll(1)
    assert r.lines == ["a1", "b1"]
    f.switch("", start_at_end=True)
    assert f.poll(2) == 0


def test_binary_garbage_does_not_crash(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r])
    append(p, b"\xff\xfe\x00\x01bad \xc3\x28 utf8\n\x00\x00\n" + bytes(range(256)) + b"\n")
    f.poll(0)
    assert r.lines[0] == "\ufffd\ufffd\x00\x01bad \ufffd( utf8"
    assert len(r.lines) >= 3


def test_multibyte_character_split_across_polls(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r])
    data = "loss 0.5 🦥 Unsloth\n".encode()
    cut = data.index("🦥".encode()) + 2
    append(p, data[:cut])
    f.poll(0)
    append(p, data[cut:])
    f.poll(1)
    assert r.lines == ["loss 0.5 🦥 Unsloth"]


def test_bounded_per_poll_and_catches_up(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r], max_bytes_per_poll=64 * 1024)
    append(p, b"".join(b"line %06d\n" % i for i in range(20000)))  # 220 KB
    f.poll(0)
    assert 0 < len(r.lines) < 20000
    for i in range(1, 10):
        f.poll(i)
    assert len(r.lines) == 20000 and r.lines[-1] == "line 019999"


def test_huge_backlog_keeps_the_tail(tmp_path):
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r], max_bytes_per_poll=64 * 1024, max_backlog=256 * 1024)
    append(p, b"".join(b"noise %07d\n" % i for i in range(100000)) + b"CUDA out of memory at the end\n")
    f.poll(0)
    assert r.lines[-1] == "CUDA out of memory at the end"
    assert f.bytes_skipped > 0


def test_failing_listener_does_not_stop_the_others(tmp_path):
    class Bad:
        def feed_line(self, line, now):
            raise ValueError("bug")

        def reset(self, now):
            raise ValueError("bug")

    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [Bad(), r])
    append(p, b"a\nb\n")
    f.poll(0)
    assert r.lines == ["a", "b"]
    assert sum(f.listener_errors.values()) == 2


def test_unreadable_path_is_harmless(tmp_path):
    r = Rec()
    f = LogFollower(str(tmp_path), [r])  # a directory
    assert f.poll(0) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=12))
def test_any_chunking_gives_the_same_lines(tmp_path_factory, chunks):
    """However the writer's output is split across polls, the lines fed are the same."""
    d = tmp_path_factory.mktemp("chunks")
    p = d / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r], partial_flush_s=1e9)
    p.write_bytes(b"")
    for i, c in enumerate(chunks):
        append(p, c)
        f.poll(i)
    append(p, b"\n")
    f.poll(len(chunks))
    data = b"".join(chunks) + b"\n"
    expected = [x.decode("utf-8", "replace") for x in data.replace(b"\r", b"\n").split(b"\n") if x]
    assert r.lines == expected


def test_switch_same_path_after_the_file_appeared_reads_it_from_the_start(tmp_path):
    """The daemon followed a log that did not exist yet; the new run created it before the
    on-start switch: its first lines (the banner) are new and must be read."""
    p = tmp_path / "train.log"
    r = Rec()
    f = LogFollower(str(p), [r], start_at_end=True)
    f.poll(0)
    p.write_bytes(b"===== run 1 started\n")
    f.switch(str(p), start_at_end=True)
    f.poll(1)
    assert r.lines == ["===== run 1 started"]


def test_switch_same_path_replaced_file_is_read_whole(tmp_path):
    p = tmp_path / "train.log"
    p.write_bytes(b"old run\n")
    r = Rec()
    f = LogFollower(str(p), [r], start_at_end=True)
    f.poll(0)
    p.unlink()
    p.write_bytes(b"new run line\n")
    f.switch(str(p), start_at_end=True)
    f.poll(1)
    assert r.lines == ["new run line"]


# --- resuming after a daemon restart ----------------------------------------------------------------

def follower(path, store, **kw) -> tuple[LogFollower, Rec]:
    """What a (re)started daemon builds: the position saved in state_dir, the file's end otherwise."""
    r = Rec()
    return LogFollower(str(path), [r], start_at_end=True, store=store, **kw), r


def test_restart_resumes_where_the_last_daemon_got_to(tmp_path):
    from supervisor.statefile import StateStore

    p = tmp_path / "train.log"
    p.write_bytes(b"before any daemon\n")
    store = StateStore(tmp_path / "state")
    f, r = follower(p, store)
    append(p, b"seen\n")
    f.poll(0)
    assert r.lines == ["seen"]
    f.close()   # kill -9: nothing more is saved
    append(p, b"CUDA out of memory while the daemon was down\nhalf a li")
    f2, r2 = follower(p, StateStore(tmp_path / "state"))
    f2.poll(1)
    assert r2.lines == ["CUDA out of memory while the daemon was down"]
    f2.close()
    append(p, b"ne\n")    # the partial line is read again, whole, by the next daemon
    f3, r3 = follower(p, StateStore(tmp_path / "state"))
    f3.poll(2)
    assert r3.lines == ["half a line"]


def test_restart_after_the_log_was_replaced_reads_the_new_one_from_its_start(tmp_path):
    from supervisor.statefile import StateStore

    p = tmp_path / "train.log"
    store = StateStore(tmp_path / "state")
    f, r = follower(p, store)
    append(p, b"old file\n")
    f.poll(0)
    f.close()
    p.unlink()
    p.write_bytes(b"new file 1\nnew file 2\n")
    f2, r2 = follower(p, StateStore(tmp_path / "state"))
    f2.poll(1)
    assert r2.lines == ["new file 1", "new file 2"]


def test_replay_is_capped_to_whole_lines_of_the_tail(tmp_path):
    from supervisor.statefile import StateStore

    p = tmp_path / "train.log"
    store = StateStore(tmp_path / "state")
    f, r = follower(p, store, max_replay=100)
    append(p, b"seen\n")
    f.poll(0)
    f.close()
    append(p, b"".join(b"line %03d of the flood\n" % i for i in range(200)))  # 22 bytes a line
    f2, r2 = follower(p, StateStore(tmp_path / "state"), max_replay=100)
    f2.poll(1)
    assert r2.lines == [f"line {i:03d} of the flood" for i in range(196, 200)]   # no cut-off piece
    assert f2.bytes_skipped > 0


def test_no_saved_position_or_another_path_starts_at_the_end(tmp_path):
    from supervisor.statefile import StateStore

    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_bytes(b"old a\n")
    b.write_bytes(b"old b\n")
    f, r = follower(a, StateStore(tmp_path / "state"))
    f.poll(0)
    assert r.lines == []      # first daemon ever: yesterday's lines are not news
    append(a, b"a1\n")
    f.poll(1)
    f.close()
    f2, r2 = follower(b, StateStore(tmp_path / "state"))
    f2.poll(2)
    assert r2.lines == []     # the saved position belongs to another file


def test_damaged_position_is_set_aside_and_reported(tmp_path):
    import json

    from supervisor.statefile import StateStore

    p = tmp_path / "train.log"
    p.write_bytes(b"old\n")
    (tmp_path / "state").mkdir()
    for bad in ({"path": str(p), "dev": "1", "ino": 2, "offset": 0}, {"path": str(p), "dev": 1, "ino": 2,
                "offset": -5}, {"path": 7, "dev": 1, "ino": 2, "offset": 0}, [1, 2]):
        (tmp_path / "state" / "logfollow.json").write_text(json.dumps(bad))
        store = StateStore(tmp_path / "state")
        f, r = follower(p, store)
        f.poll(0)
        assert r.lines == [] and any("logfollow.json" in x for x in store.problems)
        assert list((tmp_path / "state").glob("logfollow.json.corrupt-*"))
        f.close()
