"""Tracker records from files the training writes: bounded framing, nothing held between reads.

Each framing reader takes the bytes read from a file at some offset and returns the whole records
at their start, where each ends, and how many bytes the caller may step over. A record not whole
yet is not held: the next read starts again where it starts, so a record that never ends costs one
read's bytes each look, never a buffer that grows with it. A record longer than its cap is passed
over and counted (the caller remembers only that it is inside one: `skipping`). One call handles
at most ITEMS_MAX records (the next call goes on from there) and a protobuf walk at most
FIELDS_MAX fields, so the cost of one call is bounded whatever the bytes.

Unreadable from a framing reader means the file is not of its kind (TFRecord lengths no writer
makes, no W&B header): the caller leaves the file alone. A bad record is the caller's to skip.
Nothing but Unreadable escapes (tests/progress/test_trackers_hostile.py feeds random and mutated real files).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from supervisor.untrusted.readers import Unreadable

ITEMS_MAX = 50_000        # records (lines, chunks) one call handles: ~50 ms of Python at worst
LINE_MAX = 4096           # an MLflow line is "timestamp value step": ~40 bytes
TF_RECORD_MAX = 16 << 20  # a TFRecord longer than this is not a scalar event: the file is not one
WANDB_RECORD_MAX = 1 << 20  # a W&B history row this long would hold ~50,000 keys
WANDB_MAGIC = b":W&B"
WANDB_HEADER = 7
WANDB_BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
FIELDS_MAX = 1 << 17      # protobuf fields walked for one record (all its nested messages): ~0.1 s


@dataclass(frozen=True)
class Framed:
    """What one framing reader found in the bytes it was given."""

    records: list[bytes] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)   # where each record ends in the bytes (a caller may stop after any)
    used: int = 0            # bytes the caller steps over: whole records, and records passed over
    skipped: int = 0         # records passed over (longer than the cap, or broken framing)
    skipping: bool = False   # `used` is inside a record being passed over: hand it back in with the next read
    need: int = 0            # bytes the next read must hold to finish the record at `used` (0: any read)


def _guard(what: str, e: Exception) -> Unreadable:
    """Whatever went wrong, the caller sees Unreadable (the contract; a bug here shows in its message)."""
    return e if isinstance(e, Unreadable) else Unreadable(f"{what}: {type(e).__name__}")


# --- lines (MLflow) --------------------------------------------------------------------------------
def lines(buf: bytes, *, skipping: bool = False, limit: int = LINE_MAX, items: int = ITEMS_MAX) -> Framed:
    """The whole lines (without their newline) at the start of `buf`. A line longer than `limit`
    is passed over, also one not ended yet: `skipping` says the next read starts inside it."""
    try:
        b = bytes(buf)
        out: list[bytes] = []
        ends: list[int] = []
        i, n, skipped = 0, len(b), 0
        if skipping:
            j = b.find(b"\n")
            if j < 0:
                return Framed(used=n, skipping=True)
            i = j + 1
        while len(out) + skipped < items:
            j = b.find(b"\n", i)
            if j < 0:
                break
            if j - i > limit:
                skipped += 1
            else:
                out.append(b[i:j])
                ends.append(j + 1)
            i = j + 1
        else:
            return Framed(out, ends, i, skipped)
        if n - i > limit:  # a line longer than any we read, not ended yet: what follows is passed over
            return Framed(out, ends, n, skipped + 1, skipping=True)
        return Framed(out, ends, i, skipped)
    except Exception as e:  # noqa: BLE001 - nothing but Unreadable leaves a reader
        raise _guard("lines", e) from None


# --- TFRecord (TensorBoard) ------------------------------------------------------------------------
def tf_records(buf: bytes, *, limit: int = TF_RECORD_MAX, items: int = ITEMS_MAX) -> Framed:
    """TFRecords (u64 length, u32 CRC, data, u32 CRC) whole at the start of `buf`; `need`: the
    size of the one begun after them. Unreadable: a length over `limit` (not an event file)."""
    try:
        b = bytes(buf)
        out: list[bytes] = []
        ends: list[int] = []
        pos, n = 0, len(b)
        while n - pos >= 12 and len(out) < items:
            (length,) = struct.unpack_from("<Q", b, pos)
            if length > limit:
                raise Unreadable(f"a record of {length} bytes")
            end = pos + 12 + length + 4
            if end > n:
                return Framed(out, ends, pos, need=end - pos)
            out.append(b[pos + 12: pos + 12 + length])
            ends.append(end)
            pos = end
        return Framed(out, ends, pos)
    except Exception as e:  # noqa: BLE001
        raise _guard("TFRecord framing", e) from None


# --- W&B's LevelDB log -----------------------------------------------------------------------------
def wandb_chunks(buf: bytes, base: int, *, skipping: bool = False, limit: int = WANDB_RECORD_MAX,
                 items: int = ITEMS_MAX) -> Framed:
    """The whole records in `buf`, which starts at file offset `base` (the 7-byte header at 0, then
    chunks in 32 KiB blocks: u32 CRC, u16 length, u8 type full/first/middle/last). A record begun
    and not ended is left for the next read (`used` stops at its first chunk); one longer than
    `limit` is passed over. A chunk that breaks the framing drops the rest of its block (LevelDB's
    own reader does the same) and the record it was in. Unreadable: no W&B header."""
    try:
        return _wandb_chunks(bytes(buf), base, skipping, limit, items)
    except Exception as e:  # noqa: BLE001
        raise _guard("W&B framing", e) from None


def _wandb_chunks(b: bytes, base: int, skipping: bool, limit: int, items: int) -> Framed:
    out: list[bytes] = []
    ends: list[int] = []
    n, i, skipped = len(b), 0, 0
    if base == 0:
        if n < WANDB_HEADER:
            return Framed()
        if b[:4] != WANDB_MAGIC:
            raise Unreadable("no :W&B header")
        i = WANDB_HEADER
    parts: list[bytes] = []   # the record begun: joined once, at its last chunk (linear, never re-copied)
    start = -1                # where its first chunk starts in `b`; -1: none begun
    size = 0
    chunks = 0
    # a writer fills each block: a record of `limit` bytes has this many chunks at most (empty
    # middle chunks would otherwise keep one "under its cap" past every read)
    parts_max = limit // (WANDB_BLOCK - 7) + 2
    while chunks < items:
        left = WANDB_BLOCK - (base + i) % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header: padding
            if n - i < left:
                break
            i += left
            continue
        if n - i < 7:
            break
        _crc, length, typ = struct.unpack_from("<IHB", b, i)
        if typ == 0 and length == 0:  # zeroed space a writer reserved: the end for now
            break
        if length > left - 7 or typ not in (FULL, FIRST, MIDDLE, LAST):
            if n - i < left:
                break  # the rest of the block is not here yet: dropped when it is
            if start >= 0 or not skipping:
                skipped += 1
            parts, start, skipping = [], -1, True
            i += left
            continue
        if n - i < 7 + length:
            break
        data = b[i + 7: i + 7 + length]
        at = i
        i += 7 + length
        chunks += 1
        if typ in (FULL, FIRST):
            if start >= 0:
                skipped += 1  # a record its writer never ended (it restarted): dropped
            parts, start, size, skipping = [], -1, 0, False
            if typ == FULL and length > limit:
                skipped += 1  # one chunk holds up to a block: the record cap holds for it too
            elif typ == FULL:
                out.append(data)
                ends.append(i)
            else:
                parts, start, size = [data], at, length
        elif start < 0:  # the middle or the end of a record not begun here: passed over
            if not skipping:
                skipped += 1
            skipping = typ == MIDDLE
        else:
            parts.append(data)
            size += length
            if size > limit or len(parts) > parts_max:
                skipped += 1
                parts, start, skipping = [], -1, typ == MIDDLE
            elif typ == LAST:
                out.append(b"".join(parts))
                ends.append(i)
                parts, start = [], -1
    if start >= 0:
        return Framed(out, ends, start, skipped, False)
    return Framed(out, ends, i, skipped, skipping)


# --- protobuf wire format --------------------------------------------------------------------------
class Walk:
    """The fields one record may still cost: shared by every message walked in it."""

    def __init__(self, fields: int = FIELDS_MAX):
        self.left = fields


def varint(b: bytes, i: int) -> tuple[int, int]:
    """The varint at `i` and where the next thing starts; at most 64 bits."""
    shift = out = 0
    while True:
        if i >= len(b) or shift > 63:
            raise Unreadable("a varint runs off the end")
        c = b[i]
        i += 1
        out |= (c & 0x7F) << shift
        if c < 0x80:
            return out, i
        shift += 7


def fields(b: bytes, walk: Walk) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one protobuf message: an int (varint), or bytes (8- and
    4-byte fixed, length-delimited). Unreadable when it breaks or `walk` is spent."""
    try:
        i, n = 0, len(b)
        while i < n:
            walk.left -= 1
            if walk.left < 0:
                raise Unreadable(f"more than {FIELDS_MAX} fields")
            key, i = varint(b, i)
            num, wt = key >> 3, key & 7
            v: int | bytes
            if wt == 0:
                v, i = varint(b, i)
            elif wt in (1, 5):
                size = 8 if wt == 1 else 4
                if i + size > n:
                    raise Unreadable("a fixed field runs off the end")
                v, i = b[i:i + size], i + size
            elif wt == 2:
                size, i = varint(b, i)
                if i + size > n:
                    raise Unreadable("a field runs off the end")
                v, i = b[i:i + size], i + size
            else:
                raise Unreadable(f"wire type {wt}")
            yield num, wt, v
    except Exception as e:  # noqa: BLE001
        raise _guard("protobuf", e) from None
