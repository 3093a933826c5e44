"""The scan's decisions (sync/scan.py), exhaustively, without a file system: roots and key
prefixes, what the scanner remembers, how files group into units, what needs work, and what is
pending or held."""

from __future__ import annotations

import pytest

from supervisor.saves.complete import FileObs, Verdict
from supervisor.sync import scan as sc
from supervisor.sync.policy import Policy

INCLUDE = ["checkpoint-*/**", "**/adapter_model.safetensors", "**/adapter_config.json", "model.safetensors"]
ROOT = sc.Root("/w/out", "")


def policy(**kw) -> Policy:
    return Policy(kw.get("include", INCLUDE), kw.get("exclude", []), kw.get("excluded_roots", []))


def units_of(raw: dict[str, tuple[int, int]], root: sc.Root = ROOT, seen=None, pol=None) -> dict:
    seen = {} if seen is None else seen
    return sc.group(root, raw, seen, pol or policy())


# --- within / overlaps ---------------------------------------------------------------------------

@pytest.mark.parametrize("path,folder,inside", [
    ("/w/out", "/w/out", True), ("/w/out/a", "/w/out", True), ("/w/out/", "/w/out", True),
    ("/w/outer", "/w/out", False), ("/w", "/w/out", False), ("/w/out/a/../b", "/w/out", True),
    ("/x", "/", True),
])
def test_within(path, folder, inside):
    assert sc.within(path, folder) is inside


def test_overlaps_both_ways():
    assert sc.overlaps("/w/out/checkpoint-1", ["/w/out"])
    assert sc.overlaps("/w", ["/w/out"])
    assert not sc.overlaps("/w/other", ["/w/out", "/v"])
    assert not sc.overlaps("/w/out", [])


# --- roots ---------------------------------------------------------------------------------------

def test_one_watched_folder_is_the_target_top():
    assert sc.watch_roots(["/w/out/"]) == [sc.Root("/w/out", "")]


def test_several_watched_folders_get_their_names_and_clashes_a_hash():
    roots = sc.watch_roots(["/a/out", "/b/out", "/c/lora", ""])
    assert [r.path for r in roots] == ["/a/out", "/b/out", "/c/lora"]
    assert roots[0].prefix == "out" and roots[2].prefix == "lora"
    assert roots[1].prefix.startswith("out-") and len(roots[1].prefix) == len("out-") + 6
    assert sc.watch_roots(["/a/out", "/b/out"])[1].prefix == roots[1].prefix  # stable across runs


def test_no_watched_folders():
    assert sc.watch_roots([]) == [] and sc.watch_roots([""]) == []


def test_extra_root_inside_a_watched_folder_is_none():
    assert sc.extra_root("/w/out/checkpoint-3", [ROOT], []) is None
    assert sc.extra_root("/w/out", [ROOT], []) is None


def test_extra_root_without_watched_folders_is_the_top():
    assert sc.extra_root("/elsewhere/final", [], []) == sc.Root("/elsewhere/final", "")


def test_extra_root_beside_watched_folders_never_takes_a_name_they_may_use():
    r = sc.extra_root("/elsewhere/lora", [ROOT], [])
    assert r is not None and r.prefix.startswith("lora-") and len(r.prefix) == len("lora-") + 6
    assert sc.extra_root("/elsewhere/lora", [ROOT], []) == r  # the same key after a restart
    other = sc.extra_root("/x/lora", [], [sc.Root("/elsewhere/final", "")])
    assert other is not None and other.prefix.startswith("lora-") and other.prefix != r.prefix
    a, b = sc.Root("/a/out", "out"), sc.Root("/b/out", "out-123456")
    assert sc.extra_root("/c/out", [a, b], []).prefix not in ("out", "out-123456")
    assert sc.extra_root("/", [ROOT], []).prefix.startswith("root-")


def test_nested_roots():
    top = sc.Root("/w", "w-abcdef")
    roots = [ROOT, top, sc.Root("/v", "v"), sc.Root("/w/out/deeper", "d")]
    assert sc.nested_roots(top, roots) == {"/w/out", "/w/out/deeper"}
    assert sc.nested_roots(ROOT, roots) == {"/w/out/deeper"}
    assert sc.nested_roots(sc.Root("/v", "v"), roots) == set()


# --- observe -------------------------------------------------------------------------------------

def test_observe_settles_old_files_on_the_first_scan_only():
    seen: dict = {}
    wall, mono = 10_000.0, 50.0
    raw = {"old": (1, int((wall - 100) * 1e9)), "new": (1, int((wall - 1) * 1e9))}
    sc.observe(seen, ROOT, raw, True, wall, mono, quiet=30)
    assert seen[(ROOT.path, "old")].stable_since is None
    assert seen[(ROOT.path, "new")].stable_since == mono
    sc.observe(seen, ROOT, {"later": (1, int((wall - 100) * 1e9))}, False, wall, mono + 1, quiet=30)
    assert seen[(ROOT.path, "later")].stable_since == mono + 1  # not the first scan: seen settle itself


def test_observe_restarts_the_quiet_clock_on_change_and_keeps_it_otherwise():
    seen: dict = {}
    sc.observe(seen, ROOT, {"f": (1, 5)}, False, 0, 10.0, 30)
    s = seen[(ROOT.path, "f")]
    s.whole, s.whole_for = True, (1, 5)
    sc.observe(seen, ROOT, {"f": (1, 5)}, False, 0, 20.0, 30)
    assert s.stable_since == 10.0 and s.whole is True
    sc.observe(seen, ROOT, {"f": (2, 6)}, False, 0, 30.0, 30)
    assert (s.size, s.mtime_ns, s.stable_since) == (2, 6, 30.0)


# --- group ---------------------------------------------------------------------------------------

def test_checkpoint_folder_is_one_unit_with_all_its_files():
    u = units_of({"checkpoint-5/model.safetensors": (10, 1), "checkpoint-5/trainer_state.json": (2, 2),
                  "checkpoint-5/sub/x.bin": (3, 3)})
    assert list(u) == [(ROOT.path, "dir", "checkpoint-5")]
    unit = u[(ROOT.path, "dir", "checkpoint-5")]
    assert unit.key == "checkpoint-5" and unit.label == "checkpoint-5" and unit.abspath == "/w/out/checkpoint-5"
    assert sorted(f.rel for f in unit.files) == ["model.safetensors", "sub/x.bin", "trainer_state.json"]
    assert sorted(s.key for s in unit.selected) == ["checkpoint-5/model.safetensors", "checkpoint-5/sub/x.bin",
                                                    "checkpoint-5/trainer_state.json"]
    s = next(s for s in unit.selected if s.rel == "sub/x.bin")
    assert (s.path, s.rrel, s.size, s.mtime_ns) == ("/w/out/checkpoint-5/sub/x.bin", "checkpoint-5/sub/x.bin", 3, 3)


def test_adapter_folder_goes_up_whole_but_only_allowed_files():
    u = units_of({"lora/adapter_config.json": (1, 1), "lora/adapter_model.safetensors": (2, 1),
                  "lora/README.md": (3, 1), "lora/tokenizer.json": (4, 1), "lora/notes.tmp": (5, 1)})
    unit = u[(ROOT.path, "dir", "lora")]
    assert sorted(s.rel for s in unit.selected) == ["README.md", "adapter_config.json",
                                                    "adapter_model.safetensors", "tokenizer.json"]
    assert "notes.tmp" in {f.rel for f in unit.files}  # a temp file still counts as activity


def test_adapter_saved_in_the_root_is_the_root_unit_without_its_other_files():
    u = units_of({"adapter_config.json": (1, 1), "adapter_model.safetensors": (2, 1), "train.log": (9, 1)})
    assert list(u) == [(ROOT.path, "dir", "")]
    unit = u[(ROOT.path, "dir", "")]
    assert unit.key == "" and unit.abspath == "/w/out" and unit.label == "/w/out"
    assert sorted(f.rel for f in unit.files) == ["adapter_config.json", "adapter_model.safetensors"]


def test_single_file_unit_and_unselected_files_outside_units_are_ignored():
    u = units_of({"model.safetensors": (5, 1), "logs/events.out": (1, 1), "runs/x/y": (1, 1)})
    assert list(u) == [(ROOT.path, "file", "model.safetensors")]
    assert u[(ROOT.path, "file", "model.safetensors")].files[0].rel == "model.safetensors"


def test_excluded_files_count_as_activity_in_their_checkpoint_but_are_not_sent():
    u = units_of({"checkpoint-1/a.bin": (1, 1), "checkpoint-1/optimizer.pt": (2, 1)},
                 pol=policy(exclude=["**/optimizer.pt"]))
    unit = u[(ROOT.path, "dir", "checkpoint-1")]
    assert {f.rel for f in unit.files} == {"a.bin", "optimizer.pt"}
    assert {s.rel for s in unit.selected} == {"a.bin"}


def test_prefix_goes_into_every_key():
    root = sc.Root("/a/out", "out")
    u = units_of({"checkpoint-2/x": (1, 1), "model.safetensors": (1, 1)}, root=root)
    assert u[(root.path, "dir", "checkpoint-2")].key == "out/checkpoint-2"
    assert u[(root.path, "dir", "checkpoint-2")].selected[0].key == "out/checkpoint-2/x"
    assert u[(root.path, "file", "model.safetensors")].key == "out/model.safetensors"


def test_group_carries_what_was_seen():
    seen = {(ROOT.path, "checkpoint-1/a.bin"): sc.Seen(1, 7, 42.0, False, (1, 7)),
            (ROOT.path, "checkpoint-1/b.bin"): sc.Seen(1, 7, None, True, (1, 6))}  # answer for an older version
    unit = units_of({"checkpoint-1/a.bin": (1, 7), "checkpoint-1/b.bin": (1, 7)}, seen=seen)[
        (ROOT.path, "dir", "checkpoint-1")]
    by = {f.rel: f for f in unit.files}
    assert by["a.bin"] == FileObs("a.bin", 1, 7e-9, 42.0, False)
    assert by["b.bin"].whole is None and by["b.bin"].stable_since is None


def test_unit_label_of_the_root_itself():
    u = sc.Unit(ROOT, "dir", "", "")
    assert u.abspath == "/w/out" and u.label == "/w/out"


# --- judging -------------------------------------------------------------------------------------

def _unit(rel="checkpoint-1", files=("trainer_state.json",), kind="dir", mtime=0.0, selected=True) -> sc.Unit:
    u = sc.Unit(ROOT, kind, rel, rel)
    for name in files:
        u.files.append(FileObs(name, 1, mtime, None))
        if selected:
            u.selected.append(sc.Selected(f"/w/out/{rel}/{name}", f"{rel}/{name}", name, 1, int(mtime * 1e9),
                                          f"{rel}/{name}"))
    return u


def test_judge_unit_nothing_selected():
    u = _unit(selected=False)
    assert sc.judge_unit(u, [], 100, 100, 1, "trainer_state.json") == Verdict(False, "nothing selected")
    assert u.forced is False


def test_judge_unit_forced_by_a_final_sync_folder_above_or_below():
    u = _unit(files=("model.safetensors",), mtime=99.5)
    assert not sc.judge_unit(u, [], 100, 100, 30, "trainer_state.json").complete
    v = sc.judge_unit(u, ["/w/out"], 100, 100, 30, "trainer_state.json")
    assert u.forced and v.partial and "trainer_state.json" in v.reason
    sc.judge_unit(u, ["/w/out/checkpoint-1/model.safetensors"], 100, 100, 30, "trainer_state.json")
    assert u.forced
    sc.judge_unit(u, ["/w/elsewhere"], 100, 100, 30, "trainer_state.json")
    assert not u.forced


def test_to_check_and_with_whole():
    u = _unit(files=("model.safetensors", "trainer_state.json", "README.md"))
    from supervisor.saves.complete import checkable

    assert [s.rel for s in sc.to_check(u, checkable)] == ["model.safetensors", "trainer_state.json"]
    files = sc.with_whole(u, {"model.safetensors": False})
    assert [f.whole for f in files] == [False, None, None]


def test_next_ready():
    a, b, c = _unit("checkpoint-1"), _unit("checkpoint-2"), _unit("checkpoint-3")
    a.verdict, b.verdict, c.verdict = Verdict(False, "x", 5.0), Verdict(False, "y", 2.0), Verdict(True, "complete")
    assert sc.next_ready([a, b, c]) == 2.0
    assert sc.next_ready([c]) is None


# --- what needs work -----------------------------------------------------------------------------

def holding(*keys: str):
    return lambda k, size, mtime: k in keys


def test_files_synced_counts_every_selected_file_even_a_damaged_one():
    u = _unit(files=("a", "b"))
    u.verdict = Verdict(False, "truncated or damaged: b", None, partial=True, damaged=("b",))
    assert not sc.files_synced(u, holding("checkpoint-1/a"))
    assert sc.files_synced(u, holding("checkpoint-1/a", "checkpoint-1/b"))


def test_needs_manifest():
    u = _unit()
    u.verdict = Verdict(True, "complete")
    assert sc.needs_manifest(u)
    u.verdict = Verdict(False, "never finished: no trainer_state.json", partial=True)
    assert not sc.needs_manifest(u)
    u.verdict = Verdict(False, "truncated or damaged: b", partial=True, damaged=("b",))
    assert sc.needs_manifest(u)
    u.verdict = Verdict(False, "b is truncated", damaged=("b",))
    assert not sc.needs_manifest(u)  # not forced: it waits for its writer
    f = _unit("model.safetensors", files=("model.safetensors",), kind="file")
    f.verdict = Verdict(True, "complete")
    assert sc.needs_manifest(f)  # issue 50: a single checkpoint file is resumable, its manifest beside it
    log = _unit("train.log", files=("train.log",), kind="file")
    log.verdict = Verdict(True, "complete")
    assert not sc.needs_manifest(log)  # a log is no checkpoint


def test_work_takes_complete_or_partial_unsynced_units_newest_first():
    old, new, waiting, done = _unit("checkpoint-1", mtime=1), _unit("checkpoint-2", mtime=2), \
        _unit("checkpoint-3", mtime=0), _unit("checkpoint-4", mtime=0)
    old.verdict = Verdict(True, "complete")
    new.verdict = Verdict(False, "p", partial=True)
    waiting.verdict = Verdict(False, "waiting for trainer_state.json")
    done.verdict = Verdict(True, "complete")
    assert sc.work([new, waiting, done, old], lambda u: u is done) == [new, old]


def test_batches_folders_alone_files_of_a_root_together_in_chunks():
    d1, d2 = _unit("checkpoint-1", mtime=3), _unit("checkpoint-2", mtime=1)
    files = [_unit(f"f{i}", files=("x",), kind="file", mtime=2) for i in range(501)]
    got = sc.batches([d1, d2, *files])
    assert [len(b) for b in got] == [1, 500, 1, 1]
    assert got[0] == [d1] and got[-1] == [d2]


def test_together_joins_consecutive_folders_in_order_and_keeps_file_batches_apart():
    d = [_unit(f"checkpoint-{i}") for i in range(5)]
    f = [_unit(f"f{i}", files=("x",), kind="file") for i in range(3)]
    got = sc.together([[d[0]], [d[1]], f[:2], [d[2]], [d[3]], [d[4]], [f[2]]], max_units=2)
    assert got == [[d[0], d[1]], f[:2], [d[2], d[3]], [d[4]], [f[2]]]


def test_settling_only_for_units_about_to_complete_by_themselves():
    soon, never, part = _unit("checkpoint-1"), _unit("checkpoint-2"), _unit("checkpoint-3")
    soon.verdict = Verdict(False, "writer active", 3.0)
    never.verdict = Verdict(False, "waiting for trainer_state.json", None)
    part.verdict = Verdict(False, "p", 1.0, partial=True)
    assert sc.settling([soon], lambda u: False)
    assert not sc.settling([soon], lambda u: True)
    assert not sc.settling([never, part], lambda u: False)


def test_final_scope():
    a, b, c = _unit("checkpoint-1"), _unit("checkpoint-2"), _unit("checkpoint-3", selected=False)
    b.retired = True
    assert sc.final_scope([a, b, c], ["/w/out"]) == [a]
    assert sc.final_scope([a], ["/w/other"]) == []
    assert sc.in_scope(a, None) and sc.in_scope(a, ["/w/out/checkpoint-1/x"]) and not sc.in_scope(a, ["/v"])


def test_held_and_unsynced():
    a = _unit("checkpoint-1", files=("x", "y"))
    b = _unit("checkpoint-2", files=("z",))
    r = _unit("checkpoint-0", files=("old",))
    r.retired = True
    cur = holding("checkpoint-1/x")
    assert sc.held([a, b], cur, None) == (1, 1)
    assert sc.held([a, b], cur, ["/w/out/checkpoint-2"]) == (0, 0)
    assert sc.unsynced([a, b, r], cur, None) == ["/w/out/checkpoint-1/y", "/w/out/checkpoint-2/z"]
    assert sc.unsynced([a, b], cur, ["/w/out/checkpoint-2"]) == ["/w/out/checkpoint-2/z"]


def test_pending_counts_and_says_why_units_wait():
    a = _unit("checkpoint-1", files=("x", "y"))
    a.verdict = Verdict(False, "waiting for trainer_state.json")
    b = _unit("checkpoint-2", files=("z",))
    b.verdict = Verdict(True, "complete")
    r = _unit("checkpoint-0", files=("old",))
    r.retired = True
    p = sc.pending([a, b, r], holding("checkpoint-1/x"), wall_now=100.0, quiet=30, marker="trainer_state.json")
    assert (p.files, p.bytes) == (2, 2)
    assert p.waiting == [("checkpoint-1", "waiting for trainer_state.json", "", "")] and p.without_marker == []


def test_pending_hints_at_complete_marker_after_a_long_quiet():
    a = _unit("checkpoint-1", files=("x",), mtime=0.0)
    a.verdict = Verdict(False, "waiting for trainer_state.json")
    p = sc.pending([a], holding(), wall_now=599.0, quiet=30, marker="trainer_state.json")
    assert p.waiting == [("checkpoint-1", "waiting for trainer_state.json", "", "")]
    p = sc.pending([a], holding(), wall_now=700.0, quiet=30, marker="trainer_state.json")
    assert p.waiting == [("checkpoint-1", "waiting for trainer_state.json (quiet for 11m40s; if its writer never "
                                          "writes it, set sync.complete_marker)", "", "")]
    assert p.without_marker == [("checkpoint-1", 700.0)]
    # a long quiet period moves the hint out: 10 x quiet
    assert sc.pending([a], holding(), wall_now=700.0, quiet=120, marker="x").without_marker == []


def test_blocked_names_quiet_units_with_a_file_failing_its_check():
    js = _unit("checkpoint-5", files=("trainer_state.json", "model.safetensors"))
    js.verdict = Verdict(False, "trainer_state.json is truncated", damaged=("trainer_state.json",))
    st = _unit("checkpoint-6", files=("model.safetensors",))
    st.verdict = Verdict(False, "model.safetensors is truncated", damaged=("model.safetensors",))
    forced = _unit("checkpoint-7", files=("x.json",))
    forced.verdict = Verdict(False, "truncated or damaged: x.json", partial=True, damaged=("x.json",))
    marker = _unit("checkpoint-8")
    marker.verdict = Verdict(False, "waiting for trainer_state.json")
    assert sc.blocked([st, js, forced, marker], lambda u: False) == [
        "/w/out/checkpoint-5: trainer_state.json is not valid JSON (cut short or damaged); not uploaded until its "
        "writer saves it whole",
        "/w/out/checkpoint-6: model.safetensors does not hold the bytes its safetensors header promises (cut short, "
        "damaged or an unknown format); not uploaded until its writer saves it whole"]
    assert sc.blocked([js], lambda u: True) == []


def test_under_a_notice_older_units_wait_for_a_newer_checkpoint_seconds_from_ready():
    """bench_spot found it: four checkpoints written back to back, the older ones past their quiet
    period first, went up before the newest (1 GiB) one that was two seconds from ready."""
    old1, old2 = _unit("checkpoint-100", mtime=1), _unit("checkpoint-200", mtime=2)
    for u in (old1, old2):
        u.verdict = Verdict(True, "complete")
    newest = _unit("checkpoint-300", files=("model.safetensors", "trainer_state.json"), mtime=3)
    newest.verdict = Verdict(False, "writer active (quiet in 1s)", 1.2)
    work = sc.work([old1, old2, newest], lambda u: False)
    assert work == [old2, old1]
    assert sc.hold_for_newer([old1, old2, newest], work, lambda u: False, "trainer_state.json", 2.0) == []
    # still being written (no marker yet), or further than `within` from ready: holds nothing
    writing = _unit("checkpoint-300", files=("model.safetensors",), mtime=3)
    writing.verdict = Verdict(False, "writer active (quiet in 1s)", 1.2)
    assert sc.hold_for_newer([old1, old2, writing], work, lambda u: False, "trainer_state.json", 2.0) == work
    newest.verdict = Verdict(False, "writer active (quiet in 9s)", 9.0)
    assert sc.hold_for_newer([old1, old2, newest], work, lambda u: False, "trainer_state.json", 2.0) == work
    # a newer one waiting only holds the older ones, not one newer still
    newest.verdict = Verdict(False, "writer active (quiet in 1s)", 1.2)
    newer = _unit("checkpoint-400", mtime=4)
    newer.verdict = Verdict(True, "complete")
    assert sc.hold_for_newer([old1, old2, newest, newer], [newer, old2, old1], lambda u: False,
                             "trainer_state.json", 2.0) == [newer]
