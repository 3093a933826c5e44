"""supervisor.resume.choose: which unit on the target a new machine resumes from (pure)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from supervisor.resume.choose import (
    COMPLETE,
    DAMAGED,
    NO_MANIFEST,
    PARTIAL,
    UnitInfo,
    choose,
    judge,
    local_rel,
    unit_keys,
    with_state,
)
from supervisor.sync import manifest as mf


def manifest(unit: str, files: dict[str, int], **kw) -> bytes:
    return mf.build(unit, [mf.ManifestFile(p, n, f"{n:064x}") for p, n in files.items()], 1_700_000_000.0,
                    host="box-a", **kw)


FILES = {"model.safetensors": 100, "trainer_state.json": 10}


def keys_of(unit: str, files: dict[str, int], with_manifest: bool = True) -> dict[str, int]:
    out = {f"{unit}/{p}": n for p, n in files.items()}
    if with_manifest:
        out[f"{unit}/_MANIFEST.json"] = 500
    return out


def test_units_are_manifest_folders_and_checkpoint_folders_at_any_depth():
    keys = {**keys_of("checkpoint-10", FILES), **keys_of("run/checkpoint-30", FILES, with_manifest=False),
            "adapter/_MANIFEST.json": 1, "final/model.safetensors": 5, "loose.txt": 3}
    assert unit_keys(keys) == ["adapter", "checkpoint-10", "run/checkpoint-30"]


def test_judge_names_every_way_a_unit_is_unusable():
    keys = keys_of("checkpoint-20", FILES)
    u = judge("checkpoint-20", manifest("checkpoint-20", FILES), keys)
    assert (u.state, u.step, u.total_bytes, u.host) == (COMPLETE, 20, 110, "box-a")
    assert judge("checkpoint-30", None, {}).state == NO_MANIFEST
    assert "no _MANIFEST.json" in judge("checkpoint-30", None, {}).why
    assert judge("checkpoint-20", b"{not json", keys).state == DAMAGED
    part = judge("checkpoint-20", manifest("checkpoint-20", FILES, damaged=("model.safetensors",)), keys)
    assert part.state == PARTIAL and "model.safetensors" in part.why
    gone = judge("checkpoint-20", manifest("checkpoint-20", FILES), {"checkpoint-20/trainer_state.json": 10})
    assert gone.state == PARTIAL and "missing on the target" in gone.why
    short = judge("checkpoint-20", manifest("checkpoint-20", FILES), {**keys, "checkpoint-20/model.safetensors": 99})
    assert short.state == DAMAGED and "size differs" in short.why
    doc = json.loads(manifest("checkpoint-20", FILES))
    doc["files"][0]["size"] = 5
    assert judge("checkpoint-20", json.dumps(doc).encode(), keys).state == DAMAGED  # digest no longer matches


def test_the_step_comes_from_trainer_state_else_the_folder_name():
    u = judge("checkpoint-20", manifest("checkpoint-20", FILES), keys_of("checkpoint-20", FILES))
    v = with_state(u, json.dumps({"global_step": 1200, "max_steps": 5000}).encode())
    assert (v.step, v.max_steps) == (1200, 5000)
    assert with_state(u, b"garbage").step == 20


def test_newest_complete_first_newer_unusable_ones_named():
    units = [UnitInfo("checkpoint-10", COMPLETE, step=10), UnitInfo("checkpoint-20", COMPLETE, step=20),
             UnitInfo("checkpoint-30", NO_MANIFEST, "no manifest", step=30),
             UnitInfo("checkpoint-5", PARTIAL, "partial", step=5)]
    ch = choose(units)
    assert [u.key for u in ch.order] == ["checkpoint-20", "checkpoint-10"]
    assert [u.key for u in ch.skipped] == ["checkpoint-30"]
    named = choose(units, "checkpoint-10")
    assert [u.key for u in named.order] == ["checkpoint-10"]
    assert choose(units, "checkpoint-30").order == [] and choose(units, "checkpoint-30").skipped
    assert choose([]).order == []


def test_a_unit_maps_back_to_its_watched_folder():
    assert local_rel("checkpoint-20", [("/out", "")]) == ("/out", "checkpoint-20")
    two = [("/a/out", "out"), ("/b/lora", "lora")]
    assert local_rel("lora/checkpoint-3", two) == ("/b/lora", "checkpoint-3")
    assert local_rel("other/checkpoint-3", two) is None


STATES = st.sampled_from([COMPLETE, PARTIAL, DAMAGED, NO_MANIFEST])


@given(st.lists(st.tuples(st.integers(0, 50), STATES), max_size=12, unique_by=lambda t: t[0]))
def test_choice_is_the_highest_complete_step_and_skips_exactly_the_newer_unusable(spec):
    units = [UnitInfo(f"checkpoint-{s}", state, step=s) for s, state in spec]
    ch = choose(units)
    complete = sorted((s for s, state in spec if state == COMPLETE), reverse=True)
    assert [u.step for u in ch.order] == complete
    top = complete[0] if complete else -1
    assert sorted(u.step for u in ch.skipped) == sorted(s for s, state in spec if state != COMPLETE and s > top)


def test_the_step_a_manifest_carries_ranks_its_unit_and_a_bad_one_is_ignored():
    keys = keys_of("checkpoint-20", FILES)
    u = judge("checkpoint-20", manifest("checkpoint-20", FILES, trainer=(1200, 5000)), keys)
    assert (u.state, u.step, u.max_steps) == (COMPLETE, 1200, 5000)
    for bad in ({"global_step": True}, {"global_step": -1}, {"global_step": "5"}, {"global_step": 1.5}, [], "x",
                {"max_steps": 10}):
        doc = json.loads(manifest("checkpoint-20", FILES))
        doc["trainer_state"] = bad
        v = judge("checkpoint-20", json.dumps(doc).encode(), keys)
        assert (v.state, v.step, v.max_steps) == (COMPLETE, 20, None), bad
    assert mf.trainer_facts({"trainer_state": {"global_step": 5, "max_steps": 0}}) == (5, None)
    assert mf.state_facts(b'{"global_step": 7, "max_steps": true}') == (7, None)
    assert mf.state_facts(b"[1, 2]") is None and mf.state_facts(b"\xff") is None and mf.state_facts(None) is None
