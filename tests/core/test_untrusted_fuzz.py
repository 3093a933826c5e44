"""Every reader of bytes the daemon does not own returns its declared result or Unreadable, on any
input (issue 49): random bytes, and real files (as the writers lay them out) mutated, cut short,
nested and stuffed with numbers out of range. Nothing else may escape: a RecursionError or an
OverflowError out of one of them stopped every sync pass and every stop."""

from __future__ import annotations

import json
import struct
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from supervisor.cluster.nodes import Beat, beat_doc, parse_beat
from supervisor.money.runmoney import parse_record
from supervisor.saves import formats
from supervisor.saves.complete import json_whole, safetensors_whole, zip_whole
from supervisor.saves.manifest_doc import ManifestFile, build, parse_doc, state_facts, trainer_facts
from supervisor.saves.parts import record_doc, record_names_all
from supervisor.untrusted import (
    Unreadable,
    finite_float,
    finite_int,
    json_doc,
    json_object,
    safetensors_end,
    safetensors_header_len,
    text,
    zip_ends_whole,
)
from tests.fixtures.hf_writer import HFWriter, safetensors_bytes, torch_zip_bytes

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- a seed corpus from the real writers' layouts --------------------------------------------------
_STATE = json.dumps({"global_step": 120, "max_steps": 500, "epoch": 0.24, "num_train_epochs": 1,
                     "log_history": [{"loss": float("nan"), "step": 10}, {"loss": 1.25, "learning_rate": 2e-5,
                                                                        "step": 20}],
                     "best_model_checkpoint": "out/checkpoint-100",
                     "stateful_callbacks": {"TrainerControl": {"args": {"should_save": True}, "attributes": {}}}}
                    ).encode()
_MANIFEST = build("checkpoint-120", [ManifestFile("model.safetensors", 1234, "a" * 64),
                                      ManifestFile("trainer_state.json", len(_STATE), "b" * 64)],
                  1796605103.0, host="box-a", trainer=(120, 500))
_BEAT = beat_doc(Beat(1, "node-1", 7, "boot-1", 1796605103.5, "RUNNING", 3, "run-a", ("checkpoint-120",)))
_RECORD = record_doc("checkpoint-120", "run-a", {0: "c" * 64, 1: "d" * 64}, "2026-12-07T00:00:00Z")
_RUN = json.dumps({"format": "train-supervisor-run-boot/1", "run_id": "run-a", "host": "h", "boot_id": "b",
                   "rank": 0, "since": 1.0, "seconds": 60.0, "price_per_hour": 2.5, "currency": "USD",
                   "updated": 61.0}).encode()
SAFETENSORS = safetensors_bytes({"a": 64, "b": 32})
ZIP = torch_zip_bytes(256)
CORPUS = [_STATE, _MANIFEST, _BEAT, _RECORD, _RUN, SAFETENSORS[:8 + struct.unpack("<Q", SAFETENSORS[:8])[0]]]
HOSTILE = [b"[" * 100_000, b'{"a":' * 50_000, b'{"global_step": 1e999}', b"1e999", b"-1e999", b"NaN",
           b'{"data_offsets": [0, 1e999]}', b'{"w": {"data_offsets": [0, 1e999]}}', b"9" * 5000,
           b'{"global_step": ' + b"9" * 5000 + b"}", b"\xff\xfe\x00", b"", b"{}", b"[]", b"null", b"\x00" * 64]


def mutated(base: bytes) -> st.SearchStrategy[bytes]:
    """`base` with bytes flipped, cut short, a hostile piece spliced in, or repeated."""
    n = len(base)
    flips = st.lists(st.tuples(st.integers(0, max(0, n - 1)), st.integers(0, 255)), max_size=8).map(
        lambda fs: bytes(_flip(base, fs)))
    cut = st.integers(0, n).map(lambda i: base[:i])
    splice = st.tuples(st.integers(0, n), st.sampled_from(HOSTILE)).map(lambda t: base[:t[0]] + t[1] + base[t[0]:])
    return st.one_of(flips, cut, splice, st.just(base))


def _flip(base: bytes, fs: list[tuple[int, int]]) -> bytearray:
    b = bytearray(base)
    for i, v in fs:
        if b:
            b[i % len(b)] = v
    return b


ANY_BYTES = st.one_of(st.binary(max_size=512), st.sampled_from(HOSTILE),
                      st.sampled_from(CORPUS).flatmap(mutated))
ANY_VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                         lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                         max_leaves=20)


def only(fn, *args, allowed: tuple[type, ...] = ()) -> object:
    """Call a reader: its result, or None where it said Unreadable; anything else fails the test."""
    try:
        return fn(*args)
    except Unreadable:
        return None
    except allowed:
        return None


# --- the readers themselves ----------------------------------------------------------------------
@FUZZ
@given(ANY_BYTES)
@example(b"[" * 100_000)
@example(b'{"global_step": 1e999}')
def test_json_readers_say_unreadable_or_give_a_shallow_document(data):
    doc = only(json_doc, data)
    if doc is not None:
        json.dumps(doc)  # shallow enough for any recursive walk: would raise RecursionError otherwise
    obj = only(json_object, data)
    assert obj is None or isinstance(obj, dict)
    t = only(text, data)
    assert t is None or (isinstance(t, str) and "\0" not in t)


@FUZZ
@given(ANY_VALUE)
def test_numbers_are_whole_finite_and_in_range_or_unreadable(v):
    i = only(finite_int, v)
    assert i is None or (type(i) is int and 0 <= i <= 10 ** 15)
    f = only(finite_float, v)
    assert f is None or (type(f) is float and f == f and abs(f) != float("inf"))


@FUZZ
@given(ANY_BYTES, st.integers(0, 1 << 40))
@example(b'{"w": {"data_offsets": [0, 1e999]}}', 100)
def test_weights_headers(header, size):
    end = only(safetensors_end, header)
    assert end is None or (type(end) is int and end >= 0)
    n = safetensors_header_len(header[:8])
    assert n is None or 0 < n <= 100_000_000
    first8 = struct.pack("<Q", len(header)) if header else b""
    assert safetensors_whole(first8, header, size) in (True, False, None)
    assert zip_ends_whole(header) in (True, False)
    assert zip_whole(header) in (True, False)
    assert json_whole(header) in (True, False)


@FUZZ
@given(st.sampled_from([SAFETENSORS, ZIP]).flatmap(mutated))
def test_real_weights_files_mutated(data):
    n = safetensors_header_len(data[:8])
    if n is not None:
        assert safetensors_whole(data[:8], data[8:8 + n], len(data)) in (True, False, None)
    assert zip_whole(data[-(22 + 65535):]) in (True, False)


# --- the places that read the training's and the target's bytes ---------------------------------
@FUZZ
@given(ANY_BYTES)
@example(b'{"format": "train-supervisor-manifest/1", "files": ' + b"[" * 100_000)
@example(b'{"format": "train-supervisor-manifest/1", "trainer_state": {"global_step": 1e999}, "files": []}')
def test_manifests_and_trainer_state(data):
    got = only(parse_doc, data)
    if got is not None:
        doc, files = got
        facts = trainer_facts(doc)
        assert facts is None or (type(facts[0]) is int and facts[0] >= 0)
    facts = state_facts(data)
    assert facts is None or (type(facts[0]) is int and (facts[1] is None or type(facts[1]) is int))


@FUZZ
@given(ANY_BYTES, st.integers(0, 3))
def test_heartbeats_and_run_records(data, rank):
    b = only(parse_beat, data, rank)
    assert b is None or isinstance(b, Beat)
    r = parse_record(data, "run-a")
    assert r is None or r.seconds >= 0
    assert record_names_all(data, "checkpoint-120", 2) in (True, False)


@FUZZ
@given(st.lists(st.from_regex(r"(bf16_)?zero_pp_rank_[0-9]{1,30}_mp_rank_[0-9]{1,30}_optim_states\.pt", fullmatch=True)
                | st.sampled_from(["mp_rank_00_model_states.pt", "latest", ".metadata", "__0_0.distcp"]),
                max_size=6),
       st.one_of(st.none(), st.integers(1, 1 << 20)), st.text(max_size=40))
def test_rank_rules_answer_at_once_whatever_the_names_claim(names, world, latest):
    t0 = time.monotonic()
    facts = formats.Facts(world, {"latest": latest, "../latest_checkpointed_iteration.txt": latest})
    for fmt in ("deepspeed", "dcp", "megatron"):
        assert isinstance(formats.waiting_for(fmt, "iter_0000100", names, facts), str)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("data", HOSTILE)
def test_every_hostile_seed_is_answered(data):
    for fn in (json_doc, json_object, text, safetensors_end):
        only(fn, data)
    state_facts(data)
    only(parse_doc, data)
    only(parse_beat, data, 0)
    parse_record(data, "run-a")
    record_names_all(data, "u", 1)
    assert json_whole(data) in (True, False)


def test_the_seed_corpus_reads_as_written():
    """The real layouts are not refused: the caps are above what writers write."""
    assert state_facts(_STATE) == (120, 500)
    assert json_whole(_STATE)  # a NaN loss, as the Trainer writes it, is whole JSON
    doc, files = parse_doc(_MANIFEST)
    assert trainer_facts(doc) == (120, 500) and len(files) == 2
    assert parse_beat(_BEAT, 1).holds == ("checkpoint-120",)
    assert record_names_all(_RECORD, "checkpoint-120", 2)
    n = safetensors_header_len(SAFETENSORS[:8])
    assert n is not None and safetensors_whole(SAFETENSORS[:8], SAFETENSORS[8:8 + n], len(SAFETENSORS))
    assert zip_whole(ZIP[-(22 + 65535):])
    assert HFWriter  # the fixtures write these same layouts into checkpoints
