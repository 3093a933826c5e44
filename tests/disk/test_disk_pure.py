"""The disk wing's pure decisions: the forecast, and which local checkpoints may be deleted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.disk.forecast import (
    MIN_ALERT_BEFORE,
    Save,
    alert_window,
    forecast,
    keeps_up,
    need_for,
    rate,
    remember,
)
from supervisor.disk.prune import Local, Proof, plan, protected, to_check
from supervisor.notify.mails import disk as words

GIB = 1024**3
MIB = 1024**2


def saves(n: int, size: int, every: float, last: float) -> list[Save]:
    return [Save(f"checkpoint-{i}", size, last - (n - 1 - i) * every) for i in range(n)]


# --- forecast ---------------------------------------------------------------------------------------

def test_rate_is_newest_size_and_median_interval():
    s = [Save("a", 10, 0), Save("b", 12, 100), Save("c", 14, 130), Save("d", 16, 230)]
    assert rate(s) == (16, 100)
    assert rate([]) == (None, None)
    assert rate([Save("a", 5, 3)]) == (5, None)


def test_alert_window_default_is_two_intervals_at_least_15_min():
    assert alert_window(None, 60) == MIN_ALERT_BEFORE
    assert alert_window(None, 3600) == 7200
    assert alert_window(None, None) == MIN_ALERT_BEFORE
    assert alert_window(120.0, 3600) == 120.0


def test_full_in_counts_whole_saves_and_the_time_to_the_one_that_fails():
    # 100 GiB free, 38 GiB per checkpoint + 25% margin: 2 more saves fit, the third fails
    now = 10_000.0
    f = forecast(100 * GIB, 500 * GIB, saves(3, 38 * GIB, 1500, now - 300), now)
    assert f.per_checkpoint == 38 * GIB and f.interval == 1500 and f.need == need_for(38 * GIB)
    assert f.saves_left == 2
    assert f.full_in == 1200 + 2 * 1500     # next save in 20 min, then two more intervals
    assert f.alert_before == 3000 and not f.alert
    close = forecast(60 * GIB, 500 * GIB, saves(3, 38 * GIB, 1500, now - 300), now)
    assert close.saves_left == 1 and close.full_in == 1200 + 1500 and close.reasons == ("forecast",)  # < 2 intervals
    soon = forecast(50 * GIB, 500 * GIB, saves(3, 38 * GIB, 1500, now - 1400), now)
    assert soon.saves_left == 1 and soon.full_in == 100 + 1500 and soon.reasons == ("forecast",)


def test_short_when_the_next_save_does_not_fit_and_pruning_counts():
    now = 100.0
    f = forecast(9 * MIB, 64 * MIB, saves(2, 8 * MIB, 2, now - 1), now)
    assert f.short and f.reasons == ("short",) and f.full_in == 0
    g = forecast(9 * MIB, 64 * MIB, saves(2, 8 * MIB, 2, now - 1), now, reclaimable=16 * MIB)
    assert g.short  # free space alone is short: time to prune
    assert "short" not in g.reasons  # but with what pruning frees, the next save fits


def test_prune_that_keeps_up_means_no_full_in_but_a_save_that_does_not_fit_still_alerts():
    now = 100.0
    hist = saves(4, 8 * MIB, 2, now - 1)
    # 64 MiB: 2 kept + the best + one being written + one waiting for the sync fit
    assert keeps_up(20 * MIB, 40 * MIB, 8 * MIB, 3) and not keeps_up(5 * MIB, 40 * MIB, 8 * MIB, 5)
    f = forecast(20 * MIB, 64 * MIB, hist, now, steady=True)
    assert f.full_in is None and f.reasons == () and f.keeps_up
    g = forecast(20 * MIB, 64 * MIB, hist, now)
    assert g.reasons == ("forecast",) and not g.keeps_up
    h = forecast(5 * MIB, 64 * MIB, hist, now, steady=True)
    assert h.reasons == ("short",) and not h.keeps_up
    fs = {"mount": "/w", "free_bytes": 20 * MIB, "total_bytes": 64 * MIB, "full_in_s": None, "checkpoint_bytes": 8 * MIB,
          "interval_s": 120, "prune_keeps_up": True, "checkpoints": 5, "verified_off": 3}
    assert words.line(fs) == ("/w 20 MiB free of 64 MiB; prune keeps it free (8 MiB per checkpoint every 2 min); "
                              "5 checkpoints here, 3 verified off the machine")


def test_low_percent_is_folded_in_without_checkpoints():
    f = forecast(3 * GIB, 100 * GIB, [], 0.0, min_free_pct=5.0)
    assert f.reasons == ("low",) and f.full_in is None


def test_remember_keeps_pruned_saves_for_the_rhythm():
    h = remember([], saves(3, 5, 10, 100))
    h = remember(h, [Save("checkpoint-3", 5, 110)])
    assert [s.name for s in h] == ["checkpoint-0", "checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert rate(h)[1] == 10


@given(free=st.integers(0, 10**13), size=st.integers(1, 10**12), every=st.floats(1, 10**5),
       since=st.floats(0, 10**5), n=st.integers(2, 8))
def test_forecast_never_promises_a_save_that_does_not_fit(free, size, every, since, n):
    now = 10**7
    f = forecast(free, 10**14, saves(n, size, every, now - since), now)
    assert f.saves_left is not None and f.full_in is not None
    # the saves said to fit do fit, with the margin for the last one; one more would not
    assert f.saves_left * size + (need_for(size) - size) <= free or f.saves_left == 0
    assert (f.saves_left + 1) * size + (need_for(size) - size) > free
    assert f.full_in >= 0
    if f.full_in < f.alert_before:
        assert f.alert


def test_status_line_reads_like_the_issue():
    fs = {"mount": "/workspace", "free_bytes": 41 * GIB, "total_bytes": 500 * GIB, "full_in_s": 2 * 3600 + 600,
          "checkpoint_bytes": 38 * GIB, "interval_s": 25 * 60, "checkpoints": 6, "verified_off": 4}
    assert words.line(fs) == ("/workspace 41 GiB free of 500 GiB; full in ~2h10m (38 GiB per checkpoint every "
                              "25 min); 6 checkpoints here, 4 verified off the machine")


def test_a_tiny_run_far_from_full_reads_as_such():
    """The demo's 60 KiB checkpoints every 2 s once read "full in ~419d6h (0 MiB per checkpoint")."""
    fs = {"mount": "/", "free_bytes": 68 * GIB, "total_bytes": 252 * GIB, "full_in_s": 419 * 86400,
          "checkpoint_bytes": 60 * 1024, "interval_s": 2, "checkpoints": 2, "verified_off": 1}
    assert words.line(fs) == ("/ 68 GiB free of 252 GiB; not full within a month (60 KiB per checkpoint every "
                              "2s); 2 checkpoints here, 1 verified off the machine")


def test_alert_says_what_fills_and_what_frees():
    fs = {"mount": "/w", "free_bytes": 9 * MIB, "total_bytes": 64 * MIB, "full_in_s": 0, "need_bytes": 10 * MIB,
          "checkpoint_bytes": 8 * MIB, "interval_s": 2, "checkpoints": 6, "checkpoints_bytes": 48 * MIB,
          "verified_off": 4, "reasons": ["short"], "large_folders": [("/w/cache", 5 * MIB)]}
    m = words.disk_full_soon(fs, "off", 2)
    assert m.subject.startswith("disk full at the next save: /w")
    assert "6 checkpoints (48 MiB)" in m.body and "4 of them already off the machine" in m.body
    assert "/w/cache: 5 MiB" in m.body and 'prune = "synced"' in m.body and "2 checkpoint(s) are not off" in m.body
    m2 = words.disk_full_soon(fs, "synced", 2, "checkpoint-1: the target cannot be checked: connection refused")
    assert "Nothing was deleted: checkpoint-1: the target cannot be checked" in m2.body


# --- prune ------------------------------------------------------------------------------------------

def ck(step: int, nbytes: int = 10, writing: bool = False) -> Local:
    return Local(f"/o/checkpoint-{step}", step, nbytes, writing)


def test_protected_keeps_newest_best_and_being_written():
    local = [ck(1), ck(2), ck(3, writing=True), ck(4), ck(5), ck(6)]
    cands, kept = protected(local, {"/o/checkpoint-2"}, 2)
    assert [c.step for c in cands] == [1, 4]
    assert kept["/o/checkpoint-2"] == "the Trainer's best_model_checkpoint"
    assert kept["/o/checkpoint-3"] == "being written"
    assert kept["/o/checkpoint-6"].startswith("among the newest 2")


def test_plan_deletes_oldest_first_only_verified_and_only_what_is_needed():
    local = [ck(1), ck(2), ck(3), ck(4), ck(5)]
    proofs = {"/o/checkpoint-1": Proof(True), "/o/checkpoint-2": Proof(False, "the target cannot be checked: down"),
              "/o/checkpoint-3": Proof(True)}
    p = plan(local, set(), 2, proofs, free=5, need=25)
    assert p.delete == ["/o/checkpoint-1", "/o/checkpoint-3"] and p.freed == 20 and p.enough
    assert p.kept["/o/checkpoint-2"] == "the target cannot be checked: down"
    p2 = plan(local, set(), 2, proofs, free=5, need=12)
    assert p2.delete == ["/o/checkpoint-1"] and p2.kept["/o/checkpoint-3"] == "not needed: enough free space"
    p3 = plan(local, set(), 2, {}, free=0, need=10)
    assert p3.delete == [] and not p3.enough
    everything = plan(local, set(), 2, proofs, free=0, need=None)
    assert everything.delete == ["/o/checkpoint-1", "/o/checkpoint-3"]


def test_to_check_asks_only_for_what_the_ledger_believes_and_the_need_covers():
    local = [ck(1), ck(2), ck(3), ck(4), ck(5)]
    on = ["/o/checkpoint-1", "/o/checkpoint-3", "/o/checkpoint-4"]
    assert to_check(local, set(), 1, 0, 15, on) == ["/o/checkpoint-1", "/o/checkpoint-3"]
    assert to_check(local, set(), 1, 0, None, on) == on
    assert to_check(local, set(), 1, 20, 15, on) == []


# A model of a training: saves (a folder being written, then complete), syncs (the target gets a
# complete folder), losses (the target loses one), the best moving, and prunes. Whatever the order,
# a prune never deletes the best, one being written, one among the newest keep_local, or one the
# target does not hold at that moment.
OPS = st.lists(st.tuples(st.sampled_from(["save_start", "save_end", "sync", "lose", "best", "prune", "prune_all"]),
                         st.integers(0, 30)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, keep_local=st.integers(1, 3))
def test_prune_never_deletes_best_written_kept_or_unverified(ops, keep_local):
    step = 0
    local: dict[int, bool] = {}     # step -> being written
    on_target: set[int] = set()
    best: int | None = None
    free = 100
    for op, arg in ops:
        if op == "save_start":
            if not any(local.values()):
                step += 1
                local[step] = True
                free -= 10
        elif op == "save_end":
            for s in local:
                local[s] = False
        elif op == "sync":
            done = [s for s, w in local.items() if not w]
            if done:
                on_target.add(done[arg % len(done)])
        elif op == "lose":
            if on_target:
                on_target.discard(sorted(on_target)[arg % len(on_target)])
        elif op == "best":
            done = [s for s, w in local.items() if not w]
            best = done[arg % len(done)] if done else best
        else:
            items = [Local(f"/o/checkpoint-{s}", s, 10, w) for s, w in local.items()]
            bests = {f"/o/checkpoint-{best}"} if best is not None else set()
            proofs = {f"/o/checkpoint-{s}": Proof(s in on_target, "" if s in on_target else "lost")
                      for s in local}
            need = None if op == "prune_all" else 10 + arg
            p = plan(items, bests, keep_local, proofs, free, need)
            newest = sorted(local)[-keep_local:]
            for path in p.delete:
                s = int(path.rsplit("-", 1)[1])
                assert s in on_target, "deleted a checkpoint the target does not hold"
                assert s != best, "deleted the best checkpoint"
                assert not local[s], "deleted a checkpoint being written"
                assert s not in newest, "deleted one of the newest keep_local"
            assert p.delete == sorted(p.delete, key=lambda q: int(q.rsplit("-", 1)[1])), "not oldest first"
            for path in p.delete:
                del local[int(path.rsplit("-", 1)[1])]
                free += 10


def test_metrics_carry_the_disk_block():
    from supervisor.fleet.metrics import exposition

    text = exposition({"disk": {"deleted": 3, "freed_bytes": 24 * MIB, "filesystems": [
        {"mount": "/workspace", "free_bytes": 41 * GIB, "total_bytes": 500 * GIB, "full_in_s": 7800.0,
         "checkpoint_bytes": 38 * GIB, "checkpoints": 6, "verified_off": 4}]}})
    assert 'train_supervisor_disk_free_bytes{mount="/workspace"} 44023414784' in text
    assert 'train_supervisor_disk_full_in_seconds{mount="/workspace"} 7800' in text
    assert 'train_supervisor_disk_checkpoints_off_machine{mount="/workspace"} 4' in text
    assert "train_supervisor_disk_pruned_total 3" in text


def test_config_names_and_checks():
    import pytest

    from supervisor.config import ConfigError, from_dict

    c = from_dict({})
    assert (c.disk.alert_before, c.disk.prune, c.disk.keep_local) == (None, "off", 2)
    c = from_dict({"disk": {"alert_before": "45m", "prune": "synced", "keep_local": 3},
                   "sync": {"target": "/tmp/t", "watch": ["/tmp/w"]}})
    assert (c.disk.alert_before, c.disk.prune, c.disk.keep_local) == (2700.0, "synced", 3)
    with pytest.raises(ConfigError) as e:
        from_dict({"disk": {"prune": "synced", "keep_local": 0}})
    text = str(e.value)
    assert 'disk.prune: "synced" needs sync.target and sync.watch' in text and "disk.keep_local" in text
    with pytest.raises(ConfigError, match="disk.prune"):
        from_dict({"disk": {"prune": "all"}})
