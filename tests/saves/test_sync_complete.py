"""When is a checkpoint folder complete? The pure verdict, exhaustively, and the format checks
on real bytes (every truncation point of a safetensors file and a torch zip archive)."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.saves.complete import (
    FileObs,
    checkable,
    json_whole,
    judge,
    needs_marker,
    safetensors_header_len,
    safetensors_whole,
    zip_whole,
)
from supervisor.untrusted import ZIP_TAIL
from tests.fixtures.hf_writer import HFWriter, safetensors_bytes, torch_zip_bytes

WALL = 1_800_000_000.0
MONO = 5000.0
Q = 30.0


def obs(rel, age=100.0, stable_for=None, size=10, whole=None):
    return FileObs(rel, size, WALL - age, None if stable_for is None else MONO - stable_for, whole)


def hf_files(age=100.0, last=True):
    names = ["model.safetensors", "config.json", "training_args.bin", "optimizer.pt", "scheduler.pt",
             "rng_state.pth"] + (["trainer_state.json"] if last else [])
    return [obs(n, age) for n in names]


def test_complete_when_quiet_and_trainer_state_present():
    v = judge("checkpoint-5", "dir", hf_files(), WALL, MONO, Q)
    assert v.complete and v.reason == "complete"


def test_not_complete_without_trainer_state_json():
    v = judge("checkpoint-5", "dir", hf_files(last=False), WALL, MONO, Q)
    assert not v.complete and "trainer_state.json" in v.reason and v.ready_in is None


def test_model_and_tokenizer_alone_are_not_a_checkpoint():
    # the Trainer writes these first; a pause after them is not the end of the checkpoint
    files = [obs("model.safetensors"), obs("config.json"), obs("tokenizer.json")]
    v = judge("checkpoint-5", "dir", files, WALL, MONO, Q)
    assert not v.complete and v.reason == "waiting for trainer_state.json"


def test_complete_marker_is_configurable():
    files = [obs("weights.pt"), obs("meta.json")]
    assert judge("checkpoint-5", "dir", files, WALL, MONO, Q, marker="").complete
    assert not judge("checkpoint-5", "dir", files, WALL, MONO, Q, marker="meta.done").complete
    assert judge("checkpoint-5", "dir", files + [obs("meta.done")], WALL, MONO, Q, marker="meta.done").complete
    assert judge("final", "dir", files, WALL, MONO, Q).complete  # only checkpoint-N folders need it
    assert not needs_marker("checkpoint-5", "") and needs_marker("out/checkpoint-5", "x")


@pytest.mark.parametrize("age", [0.0, 1.0, 29.9])
def test_fresh_mtime_is_activity(age):
    files = hf_files()
    files[3] = obs("optimizer.pt", age)
    v = judge("checkpoint-5", "dir", files, WALL, MONO, Q)
    assert not v.complete and v.ready_in == pytest.approx(Q - age)


def test_observed_change_is_activity_even_with_old_mtime():
    # a copy that preserves mtimes: the file changed under our eyes 5 s ago
    files = hf_files()
    files[0] = obs("model.safetensors", age=3600, stable_for=5)
    v = judge("checkpoint-5", "dir", files, WALL, MONO, Q)
    assert not v.complete and v.ready_in == pytest.approx(25)
    files[0] = obs("model.safetensors", age=3600, stable_for=31)
    assert judge("checkpoint-5", "dir", files, WALL, MONO, Q).complete


def test_far_future_mtime_is_ignored_but_observation_still_counts():
    files = hf_files()
    files[0] = obs("model.safetensors", age=-3600, stable_for=40)  # clock skew: mtime an hour ahead
    assert judge("checkpoint-5", "dir", files, WALL, MONO, Q).complete
    files[0] = obs("model.safetensors", age=-3600, stable_for=10)
    assert not judge("checkpoint-5", "dir", files, WALL, MONO, Q).complete
    files[0] = obs("model.safetensors", age=-2)  # slightly ahead: counts as just written
    assert not judge("checkpoint-5", "dir", files, WALL, MONO, Q).complete


def test_temp_file_in_folder_means_still_writing():
    files = hf_files() + [obs("optimizer.pt.tmp")]
    v = judge("checkpoint-5", "dir", files, WALL, MONO, Q)
    assert not v.complete and "still writing" in v.reason


def test_truncated_file_is_never_complete():
    files = hf_files()
    files[0] = obs("model.safetensors", whole=False)
    v = judge("checkpoint-5", "dir", files, WALL, MONO, Q)
    assert not v.complete and "truncated" in v.reason and v.damaged == ("model.safetensors",)


def test_empty_and_temp_only():
    assert not judge("x", "dir", [], WALL, MONO, Q).complete
    assert not judge("x", "dir", [obs("a.tmp")], WALL, MONO, Q).complete


def test_forced_ignores_quiet_and_leftover_temp_files():
    files = [obs(f.rel, age=0.0) for f in hf_files()] + [obs("x.tmp", age=0)]
    v = judge("checkpoint-5", "dir", files, WALL, MONO, Q, forced=True)
    assert v.complete and not v.partial


def test_forced_unfinished_checkpoint_is_partial():
    v = judge("checkpoint-5", "dir", hf_files(last=False), WALL, MONO, Q, forced=True)
    assert not v.complete and v.partial and "never finished" in v.reason
    files = hf_files()
    files[0] = obs("model.safetensors", whole=False)
    v = judge("checkpoint-5", "dir", files, WALL, MONO, Q, forced=True)
    assert v.partial and v.damaged == ("model.safetensors",) and "model.safetensors" in v.reason


@settings(max_examples=300, deadline=None)
@given(ages=st.lists(st.floats(-5, 1000), min_size=1, max_size=6),
       stable=st.lists(st.one_of(st.none(), st.floats(0, 1000)), min_size=6, max_size=6),
       quiet=st.floats(0, 120))
def test_verdict_properties(ages, stable, quiet):
    """Complete exactly when every mtime and every observed change is `quiet` old; otherwise
    waiting ready_in makes it complete. (Mtimes more than 5 s ahead are tested above.)"""
    files = [FileObs(f"f{i}.bin", 1, WALL - a, None if s is None else MONO - s) for i, (a, s) in
             enumerate(zip(ages, stable, strict=False))]
    v = judge("out", "dir", files, WALL, MONO, quiet)
    newest_age = min(ages)
    youngest_obs = min((MONO - f.stable_since for f in files if f.stable_since is not None), default=None)
    real_ages = [WALL - f.mtime for f in files]  # as the float arithmetic sees them
    quiet_ok = all(a < -5 or a >= quiet for a in real_ages) and (youngest_obs is None or youngest_obs >= quiet)
    assert v.complete == quiet_ok
    if not v.complete:
        assert v.ready_in is not None and v.ready_in > 0
        # waiting ready_in (and not a moment less) is what it takes
        later = judge("out", "dir", files, WALL + v.ready_in + 1e-6, MONO + v.ready_in + 1e-6, quiet)
        assert later.complete, (newest_age, v)


# --- format checks on real bytes --------------------------------------------------------------

def _safetensors_verdict(data: bytes) -> bool:
    first8 = data[:8]
    n = safetensors_header_len(first8)
    if n is None:
        return False
    return safetensors_whole(first8, data[8:8 + n], len(data))


def test_safetensors_every_truncation_point():
    data = safetensors_bytes({"a": 300, "b": 77}, seed=3)
    assert _safetensors_verdict(data)
    for cut in range(len(data)):
        assert not _safetensors_verdict(data[:cut]), cut
    assert not _safetensors_verdict(data + b"\0")  # trailing garbage: not what the header promises


def test_safetensors_garbage_headers():
    assert safetensors_header_len(b"\0" * 8) is None
    assert safetensors_header_len(struct.pack("<Q", 2**40)) is None
    hdr = b'{"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, "x"]}}'
    assert not safetensors_whole(struct.pack("<Q", len(hdr)), hdr, 8 + len(hdr) + 4)
    hdr = json.dumps([1, 2]).encode()
    assert not safetensors_whole(struct.pack("<Q", len(hdr)), hdr, 8 + len(hdr))


def test_torch_zip_every_truncation_point():
    data = torch_zip_bytes(2000, seed=5)
    assert zip_whole(data[-ZIP_TAIL:])
    for cut in range(len(data)):
        assert not zip_whole(data[:cut][-ZIP_TAIL:]), cut


def test_writer_produces_whole_files(tmp_path):
    w = HFWriter(tmp_path)
    for name, data in w.checkpoint_files(3):
        kind = checkable(name)
        if kind == "safetensors":
            assert _safetensors_verdict(data), name
        elif kind == "zip":
            assert zip_whole(data[-ZIP_TAIL:]), name


def test_checkable():
    assert checkable("model-00001-of-00002.safetensors") == "safetensors"
    assert checkable("optimizer.pt") == "zip" and checkable("rng_state_1.pth") == "zip"
    assert checkable("trainer_state.json") == "json" and checkable("README.md") is None


def test_json_every_truncation_point():
    data = json.dumps({"global_step": 5, "log_history": [{"loss": 0.5}] * 20}).encode()
    assert json_whole(data)
    for cut in range(len(data)):
        assert not json_whole(data[:cut]), cut
