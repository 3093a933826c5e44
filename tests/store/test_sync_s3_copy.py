"""Content the target already holds is copied there, not sent again (the same tokenizer.json in
every checkpoint of a run), against a real S3 server (SeaweedFS on loopback). A copy counts only
when the store's own fingerprint of it proves the content; a refused copy, a source deleted or
changed on the target: the bytes are sent, and what lands is always the local file."""

from __future__ import annotations

import json

import pytest

from tests.store.test_sync_s3 import assert_remote_matches

TOKENIZER = json.dumps({"version": "1.0", "model": {"type": "BPE",
                                                   "vocab": {f"tok{i}": i for i in range(30_000)}}}).encode()


def checkpoint(hf_writer, step: int, tokenizer: bytes = TOKENIZER) -> None:
    """checkpoint-N/ as the Trainer saves it, with the run's (large, unchanging) tokenizer.json."""
    d = hf_writer.checkpoint(step)
    hf_writer.write_file(d / "tokenizer.json", tokenizer)
    hf_writer.contents[d.name]["tokenizer.json"] = tokenizer
    hf_writer.age(60, d)


def journal(state_dir) -> list[dict]:
    return [json.loads(line) for p in state_dir.glob("sync/*/journal.jsonl")
            for line in p.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("mode", ["when_supported", "when_required"])
def test_a_file_the_target_holds_is_copied_there_not_sent(make_engine, hf_writer, s3_server, s3_prefix, tmp_path,
                                                         mode):
    assert len(TOKENIZER) > 256 * 1024
    checkpoint(hf_writer, 1)
    e = make_engine({**s3_server.sync_config(s3_prefix, request_checksum_calculation=mode),
                     "watch": [str(hf_writer.out)], "include": ["checkpoint-*/**"]})
    assert e.wait_idle(60).ok
    copies, received = s3_server.requests("COPY"), s3_server.received_bytes()
    checkpoint(hf_writer, 2)
    checkpoint(hf_writer, 3)
    assert e.wait_idle(60).ok
    assert s3_server.requests("COPY", "200") - copies == 2
    new = sum(len(d) for cp in ("checkpoint-2", "checkpoint-3") for d in hf_writer.contents[cp].values())
    sent = s3_server.received_bytes() - received
    assert sent < new - 2 * len(TOKENIZER) + 20_000, (sent, new)  # + the two manifests
    for cp in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        assert_remote_matches(s3_server, s3_prefix, cp, hf_writer.contents[cp])
    copied = [r for r in journal(tmp_path / "state") if r.get("op") == "begin" and r["i"].get("mode") == "copy"]
    assert sorted(r["k"] for r in copied) == ["checkpoint-2/tokenizer.json", "checkpoint-3/tokenizer.json"]
    # the final sync's check of the target accepts the copies (same size and ETag as recorded)
    assert e.final_sync([str(hf_writer.out)], 60).ok


def test_a_key_that_may_not_read_gets_the_bytes_sent_after_one_refusal(make_engine, hf_writer, s3_server,
                                                                       s3_prefix):
    """A backup-only key (PutObject, no GetObject) cannot copy: refused tries (those in flight
    together: here two at most), every file sent as usual, and no copy is tried after that."""
    checkpoint(hf_writer, 1)
    e = make_engine({**s3_server.sync_config(s3_prefix, write_only=True),
                     "watch": [str(hf_writer.out)], "include": ["checkpoint-*/**"]})
    assert e.wait_idle(60).ok
    refused, copied = s3_server.requests("COPY", "403"), s3_server.requests("COPY", "200")
    checkpoint(hf_writer, 2)
    checkpoint(hf_writer, 3)
    r = e.wait_idle(60)
    assert r.ok, r
    assert 1 <= s3_server.requests("COPY", "403") - refused <= 2  # 2 and 3 were in flight together
    refused = s3_server.requests("COPY", "403")
    checkpoint(hf_writer, 4)
    assert e.wait_idle(60).ok
    assert s3_server.requests("COPY", "403") == refused  # refused once: not tried again
    assert s3_server.requests("COPY", "200") == copied
    for cp in ("checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"):
        assert_remote_matches(s3_server, s3_prefix, cp, hf_writer.contents[cp])
    assert e.status()["last_error"] in ("", None)


@pytest.mark.parametrize("change", ["overwritten", "deleted"])
def test_a_source_changed_on_the_target_is_not_trusted(make_engine, hf_writer, s3_server, s3_prefix, change):
    """Someone replaced (same size, other bytes) or deleted checkpoint-1/tokenizer.json on the
    target after it was verified: the copy's ETag is not the recorded one, or there is nothing
    to copy, and the local bytes are sent instead."""
    checkpoint(hf_writer, 1)
    e = make_engine({**s3_server.sync_config(s3_prefix), "watch": [str(hf_writer.out)],
                     "include": ["checkpoint-*/**"]})
    assert e.wait_idle(60).ok
    src = f"{s3_prefix}/checkpoint-1/tokenizer.json"
    admin = s3_server.client()
    if change == "overwritten":
        admin.put_object(Bucket=s3_server.bucket, Key=src, Body=TOKENIZER.replace(b"tok1", b"TOK1"))
    else:
        admin.delete_object(Bucket=s3_server.bucket, Key=src)
    copies = s3_server.requests("COPY")
    checkpoint(hf_writer, 2)
    assert e.wait_idle(60).ok
    assert s3_server.requests("COPY") - copies == 1  # tried once, then the bytes went
    assert_remote_matches(s3_server, s3_prefix, "checkpoint-2", hf_writer.contents["checkpoint-2"])
