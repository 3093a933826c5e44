"""A file complete by its own rule goes up at once; the quiet period is the fallback and follows the
save cadence (issue 50: Accelerate saving every ~7 s with total_limit=2 lost checkpoints 0 to 5 to a
30 s quiet period). The pure parts exhaustively (complete.adapted_quiet, complete.judge's settle),
then the real walker over real files with a fake clock (wall and monotonic passed in by hand)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from supervisor.config.schema import SyncConfig
from supervisor.saves.complete import LOOK_AGAIN_S, SETTLE_S, FileObs, adapted_quiet, judge, quiet_left
from supervisor.store._log import Once, get_logger
from supervisor.sync.policy import Policy
from supervisor.sync.scan import Root
from supervisor.sync.walk import Walker, save_kind
from tests.fixtures.hf_writer import safetensors_bytes, torch_zip_bytes

# --- adapted_quiet: pure ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("configured", "starts", "want"), [
    (30.0, [], 30.0),                              # nothing seen: the configured period
    (30.0, [100.0], 30.0),                         # one save: no gap yet
    (30.0, [100.0, 107.0], 3.5),                   # every 7 s: half of it
    (30.0, [107.0, 100.0], 3.5),                   # order of arrival does not matter
    (30.0, [0.0, 7.0, 14.0, 21.0, 28.0], 3.5),
    (30.0, [0.0, 600.0], 30.0),                    # saves far apart: never longer than configured
    (30.0, [0.0, 60.0], 30.0),                     # exactly twice the period: the period
    (30.0, [0.0, 3.0], SETTLE_S),                  # 1.5 s is below the settle: floored
    (30.0, [0.0, 1.0, 2.0, 3.0], SETTLE_S),        # a save within the settle of the one kept before is one
    (1.0, [0.0, 7.0], 1.0),                        # configured below the settle: never lengthened
    (0.2, [0.0, 7.0, 14.0], 0.2),
    (30.0, [0.0, 0.5, 7.0, 7.4, 14.0, 14.1], 3.5),  # ranks writing their files at once count as one save
    (30.0, [0.0, 10.0, 20.0, 30.0, 32.5], 5.0),    # median of the last four gaps (10, 10, 10, 2.5): 10
    (30.0, [0.0, 100.0, 107.0, 114.0, 121.0, 128.0], 3.5),  # only the latest four gaps count
    (30.0, [0.0, 7.0, 14.0, 200.0], 3.5),          # one long pause (eval) does not undo the cadence
    (30.0, [0.0, 8.0, 14.0, 24.0, 30.0], 3.5),     # an even count: the mean of the middle two (6, 8)
    (30.0, [math.nan, 0.0, math.inf, 7.0, -math.inf], 3.5),  # non-finite times are no saves
    (30.0, [5.0, 5.0, 5.0], 30.0),                 # the same start thrice: one save
    (math.inf, [0.0, 7.0], math.inf),
])
def test_the_quiet_period_follows_the_save_cadence(configured, starts, want):
    got = adapted_quiet(configured, starts)
    assert got == want or (math.isinf(want) and math.isinf(got))
    assert got <= configured


def test_the_adapted_period_is_never_above_configured_nor_below_the_settle():
    """Every gap from 0.1 s to 2 h, every configured period: the bounds always hold."""
    for configured in (0.0, 0.5, 2.0, 5.0, 30.0, 600.0):
        for gap in (0.1, 1.0, 1.99, 2.0, 3.9, 4.0, 7.0, 59.0, 61.0, 3600.0, 7200.0):
            q = adapted_quiet(configured, [0.0, gap, 2 * gap])
            assert q <= configured
            assert q >= min(configured, SETTLE_S)
            if gap >= SETTLE_S:
                assert q == min(configured, max(SETTLE_S, gap / 2))


# --- judge's settle: pure, with the clock passed in ---------------------------------------------------------

WALL, MONO = 1_800_000_000.0, 5_000.0


def obs(rel: str, age: float, seen_for: float | None, whole: bool | None = True) -> FileObs:
    """A file written `age` s ago by the wall clock, its version first seen `seen_for` s ago."""
    return FileObs(rel, 100, WALL - age, None if seen_for is None else MONO - seen_for, whole)


def verdict(files, quiet=30.0, by_rule=True, seen_before=True, kind="file", name="ckpt.pt", waiting=""):
    return judge(name, kind, files, WALL, MONO, quiet, False, "trainer_state.json", "files", waiting, by_rule,
                 seen_before)


def test_complete_by_its_rule_after_the_settle_not_the_quiet_period():
    v = verdict([obs("ckpt.pt", 3, 3)])
    assert v.complete and v.quiet == SETTLE_S
    v = verdict([obs("ckpt.pt", 3, 3)], by_rule=False)
    assert not v.complete and v.ready_in == pytest.approx(27) and v.quiet == 30.0


def test_the_settle_needs_two_looks_at_the_same_version():
    v = verdict([obs("ckpt.pt", 3, 3)], seen_before=False)
    assert not v.complete and v.ready_in == LOOK_AGAIN_S and "looking once more" in v.reason
    # quiet by the full period needs no second look: that rule did not change
    assert verdict([obs("ckpt.pt", 40, 40)], seen_before=False).complete


def test_the_settle_counts_from_the_last_change_by_either_clock():
    v = verdict([obs("ckpt.pt", 1.0, 10)])           # mtime 1 s ago
    assert not v.complete and v.ready_in == pytest.approx(SETTLE_S - 1.0)
    v = verdict([obs("ckpt.pt", 10, 0.5)])           # this version first seen 0.5 s ago
    assert not v.complete and v.ready_in == pytest.approx(SETTLE_S - 0.5)
    assert quiet_left([obs("a", 10, None)], WALL, MONO, SETTLE_S) <= 0  # settled at the first look


def test_only_files_whole_by_their_format_shorten_the_wait():
    for whole in (None, False):
        v = verdict([obs("ckpt.pt", 3, 3, whole=whole)])
        assert not v.complete and (v.ready_in == pytest.approx(27) or v.damaged)
    # a folder: every checkable file must be whole; files no check applies to are no obstacle
    files = [obs("model.safetensors", 3, 3), obs("trainer_state.json", 3, 3), obs("tokenizer.model", 3, 3, None)]
    assert verdict(files, kind="dir", name="checkpoint-5").complete
    files[1] = obs("trainer_state.json", 3, 3, None)  # not parsed yet
    assert not verdict(files, kind="dir", name="checkpoint-5").complete


def test_a_rule_that_still_waits_or_a_missing_marker_gets_no_settle():
    v = verdict([obs("model.safetensors", 3, 3)], kind="dir", name="checkpoint-5")  # no trainer_state.json
    assert not v.complete and v.ready_in == pytest.approx(27)
    v = verdict([obs("ckpt.pt", 3, 3)], waiting="rank 1 of 2")
    assert not v.complete and v.ready_in == pytest.approx(27)


def test_a_quiet_period_shorter_than_the_settle_is_kept():
    v = verdict([obs("ckpt.pt", 0.5, 0.5)], quiet=0.2, seen_before=False)
    assert v.complete and v.quiet == 0.2


# --- the walker, over real files, with a fake clock ----------------------------------------------------------

class FakeScan:
    """A Walker over `out` whose clock the test moves: wall and monotonic advance together."""

    def __init__(self, out: Path, include: list[str], quiet: float = 60.0, world: int | None = None):
        cfg = SyncConfig()
        cfg.quiet_period = quiet
        self.w = Walker(Policy(include), cfg, Once(get_logger("test")), world_size=(lambda: world) if world else None)
        self.root = Root(str(out), "")
        self.wall, self.mono = WALL, MONO

    def advance(self, s: float) -> None:
        self.wall += s
        self.mono += s

    def scan(self) -> dict:
        units = self.w.scan([self.root], [], self.wall, self.mono, lambda prefix: [])
        return {u.rel: u for u in units.values()}

    def write(self, path: Path, data: bytes, ago: float = 0.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (self.wall - ago, self.wall - ago))


def test_saves_every_ten_seconds_halve_the_quiet_period(tmp_path):
    """Folders no rule vouches for (`save_N/` of .npy files), saved every 10 s of the fake clock,
    60 s quiet period: the first save found is the anchor, the next one gives the gap, and from
    then on a save is complete 5 s after its last write."""
    out = tmp_path / "out"
    s = FakeScan(out, ["save_*/**"], quiet=60.0)
    s.write(out / "save_1" / "weights.npy", b"1" * 100)
    assert not s.scan()["save_1"].verdict.complete
    assert s.w.quiet_for(s.scan()["save_1"]) == 60.0  # one save: nothing to go by
    s.advance(10)
    s.write(out / "save_2" / "weights.npy", b"2" * 100)
    units = s.scan()
    assert s.w.quiet_for(units["save_2"]) == 5.0 and units["save_2"].verdict.quiet == 5.0
    assert units["save_2"].verdict.ready_in == pytest.approx(5.0)
    s.advance(5.1)
    assert s.scan()["save_2"].verdict.complete
    # another kind of save beside them keeps its own period
    s.write(out / "save_2" / "config.json", b"{}")
    assert save_kind(str(out), "save_2") == (str(out), "", "save_#")


def test_a_rotation_faster_than_the_quiet_period_keeps_the_cadence_of_the_deleted_saves(tmp_path):
    """total_limit=2: each new save deletes the one before last; the gaps of the saves already gone
    still count, so the period stays short."""
    out = tmp_path / "out"
    s = FakeScan(out, ["save_*/**"], quiet=30.0)
    s.write(out / "save_0" / "w.npy", b"0")
    s.scan()
    for n in range(1, 6):
        s.advance(7)
        if n >= 2:
            for f in (out / f"save_{n - 2}").iterdir():
                f.unlink()
            (out / f"save_{n - 2}").rmdir()
        s.write(out / f"save_{n}" / "w.npy", bytes([n]))
        units = s.scan()
        assert set(units) == {f"save_{n - 1}", f"save_{n}"}
        assert units[f"save_{n}"].verdict.quiet == 3.5, n
        assert units[f"save_{n - 1}"].verdict.complete, f"save_{n - 1} was complete 7 s after it was written"


def test_a_checkpoint_file_goes_up_after_two_looks_and_the_settle(tmp_path):
    """A torch zip written 10 s before the daemon's first look, quiet period 60 s: the first look
    sees it once (its own observation starts then), the look 2 s later finds it unchanged and
    whole: complete. Rewritten before that look, it starts again."""
    out = tmp_path / "out"
    s = FakeScan(out, ["*.pt", "*.safetensors"], quiet=60.0)
    s.write(out / "ckpt.pt", torch_zip_bytes(2048, 1), ago=10)
    s.write(out / "model.safetensors", safetensors_bytes({"w": 256}), ago=10)
    units = s.scan()
    for name in ("ckpt.pt", "model.safetensors"):
        v = units[name].verdict
        assert not v.complete and v.ready_in == pytest.approx(SETTLE_S) and v.format == "files", (name, v)
    s.advance(SETTLE_S)
    units = s.scan()
    assert units["ckpt.pt"].verdict.complete and units["model.safetensors"].verdict.complete
    # a new version: seen once, 0.5 s later again (it was written 3 s before the look)
    s.write(out / "ckpt.pt", torch_zip_bytes(4096, 2), ago=3)
    v = s.scan()["ckpt.pt"].verdict
    assert not v.complete and v.ready_in == pytest.approx(SETTLE_S)  # not quiet before the look that first saw it
    s.advance(SETTLE_S)
    assert s.scan()["ckpt.pt"].verdict.complete
    # cut short (no zip end record): no settle; the quiet period, and then it is named damaged
    s.write(out / "ckpt.pt", torch_zip_bytes(4096, 3)[:-30], ago=5)
    s.scan()
    s.advance(SETTLE_S)
    v = s.scan()["ckpt.pt"].verdict
    assert not v.complete and v.ready_in == pytest.approx(60 - SETTLE_S)
    s.advance(60)
    v = s.scan()["ckpt.pt"].verdict
    assert not v.complete and v.damaged == ("ckpt.pt",)


def test_an_accelerate_save_of_two_processes_is_complete_two_seconds_after_its_last_random_states(tmp_path):
    out = tmp_path / "out"
    s = FakeScan(out, ["**/checkpoint_[0-9]*/**"], quiet=30.0, world=2)
    ck = out / "checkpoints" / "checkpoint_0"
    s.write(ck / "model.safetensors", safetensors_bytes({"w": 512}))
    s.write(ck / "optimizer.bin", torch_zip_bytes(256))
    s.write(ck / "random_states_1.pkl", torch_zip_bytes(64, 1))  # rank 1 has nothing else to write
    v = s.scan()["checkpoints/checkpoint_0"].verdict
    assert not v.complete and v.waiting_for == \
        "random_states_0.pkl (process 0 writes it last; random_states_1.pkl is there)"
    s.advance(1)
    s.write(ck / "random_states_0.pkl", torch_zip_bytes(64, 0))
    s.write(ck / "custom_checkpoint_0.pkl", torch_zip_bytes(32, 5))
    v = s.scan()["checkpoints/checkpoint_0"].verdict
    assert not v.complete and v.format == "accelerate" and v.ready_in == pytest.approx(SETTLE_S)
    s.advance(SETTLE_S)
    assert s.scan()["checkpoints/checkpoint_0"].verdict.complete
