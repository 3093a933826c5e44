"""What the experiment trackers write to disk, read without their SDKs. Pure: bytes and text in,
(step, time, key, value) out; the shell (trackers.py) finds the files and remembers offsets.

- TensorBoard event files (`events.out.tfevents.*`, written by torch.utils.tensorboard, tensorboardX
  and the HF Trainer's TensorBoardCallback): TFRecords (u64 length, u32 CRC, data, u32 CRC), each an
  `Event` protobuf whose `summary.value` holds scalars (`simple_value`, or a one-element float
  tensor). The wire format is read by hand: two messages, a few fields, no protobuf dependency.
- The MLflow file store (`mlruns/<experiment>/<run>/metrics/<key>`): one "timestamp_ms value step"
  line per logged value; `meta.yaml` beside it holds the run's status.
- Trackio's SQLite database (`<TRACKIO_DIR or HF_HOME/trackio>/<project>.db`): its `metrics` table,
  one row per `trackio.log()` (an autoincrement id, an ISO timestamp, the step, the values as JSON).
- W&B offline runs (`wandb/offline-run-*/run-*.wandb`): a 7-byte header (":W&B", 0xBEE1, version)
  then LevelDB-log chunks in 32 KiB blocks (u32 CRC, u16 length, u8 type: full, first, middle, last),
  each record a `Record` protobuf: `history` (field 2: items of key, nested keys, and a number,
  an integer or value_json; and the step) and `exit` (field 18: the exit code). Field numbers as
  wandb's own descriptors give them (wandb_internal.proto).

Records are read only when whole: a reader stops before a record the writer has not finished and
reads it at the next look.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

RECORD_MAX = 16 << 20   # a TFRecord longer than this is not a scalar event: the file is not followed
STEP_KEYS = ("train/global_step", "global_step")
LOSS_KEYS = ("train/loss", "loss", "train_loss", "loss/train", "train/train_loss", "training_loss")
EPOCH_KEYS = ("train/epoch", "epoch")
LR_KEYS = ("train/learning_rate", "learning_rate", "lr", "train/lr")
MLFLOW_STATUS = {"1": "RUNNING", "2": "SCHEDULED", "3": "FINISHED", "4": "FAILED", "5": "KILLED",
                 "RUNNING": "RUNNING", "FINISHED": "FINISHED", "FAILED": "FAILED", "KILLED": "KILLED"}


@dataclass(frozen=True)
class Point:
    step: int
    t: float          # wall time the writer gave it
    key: str
    value: float


class Garbage(ValueError):
    """The bytes are not what the file's name says: the file is left alone from here on."""


# --- TFRecord and protobuf ---------------------------------------------------------------------------
def tf_records(buf: bytes | memoryview) -> tuple[list[bytes], int]:
    """The whole records at the start of `buf`, and how many bytes they took."""
    out, pos, n = [], 0, len(buf)
    while n - pos >= 12:
        (length,) = struct.unpack_from("<Q", buf, pos)
        if length > RECORD_MAX:
            raise Garbage(f"a record of {length} bytes")
        end = pos + 12 + length + 4
        if end > n:
            break
        out.append(bytes(buf[pos + 12: pos + 12 + length]))
        pos = end
    return out, pos


def _varint(b: bytes, i: int) -> tuple[int, int]:
    shift = out = 0
    while True:
        if i >= len(b) or shift > 63:
            raise Garbage("a varint runs off the end")
        c = b[i]
        i += 1
        out |= (c & 0x7F) << shift
        if c < 0x80:
            return out, i
        shift += 7


def _fields(b: bytes) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of one protobuf message: ints, 8/4-byte raw, or bytes."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(b, i)
        elif wt == 1:
            if i + 8 > len(b):
                raise Garbage("a 64-bit field runs off the end")
            v, i = b[i:i + 8], i + 8
        elif wt == 2:
            n, i = _varint(b, i)
            if i + n > len(b):
                raise Garbage("a field runs off the end")
            v, i = b[i:i + n], i + n
        elif wt == 5:
            if i + 4 > len(b):
                raise Garbage("a 32-bit field runs off the end")
            v, i = b[i:i + 4], i + 4
        else:
            raise Garbage(f"wire type {wt}")
        yield num, wt, v


def _tensor_value(b: bytes) -> float | None:
    """A scalar TensorProto (dtype float or double): float_val, double_val, or tensor_content."""
    dtype = 0
    content = b""
    floats: list[float] = []
    for num, wt, v in _fields(b):
        if num == 1 and wt == 0:
            dtype = int(v)  # type: ignore[arg-type]
        elif num == 4 and wt == 2:
            content = v  # type: ignore[assignment]
        elif num == 5:  # float_val, packed or not
            raw = v if isinstance(v, bytes) else b""
            floats += list(struct.unpack(f"<{len(raw) // 4}f", raw[: len(raw) // 4 * 4]))
        elif num == 6:  # double_val
            raw = v if isinstance(v, bytes) else b""
            floats += list(struct.unpack(f"<{len(raw) // 8}d", raw[: len(raw) // 8 * 8]))
    if floats:
        return floats[0]
    if content and dtype == 1 and len(content) >= 4:
        return struct.unpack_from("<f", content)[0]
    if content and dtype == 2 and len(content) >= 8:
        return struct.unpack_from("<d", content)[0]
    return None


def tf_scalars(event: bytes) -> list[Point]:
    """The scalars of one Event record (none for the file-version and graph records)."""
    wall, step, summary = 0.0, 0, b""
    for num, wt, v in _fields(event):
        if num == 1 and wt == 1:
            (wall,) = struct.unpack("<d", v)  # type: ignore[arg-type]
        elif num == 2 and wt == 0:
            step = int(v)  # type: ignore[arg-type]
            step = step - (1 << 64) if step >= 1 << 63 else step
        elif num == 5 and wt == 2:
            summary = v  # type: ignore[assignment]
    out = []
    for num, wt, v in _fields(summary):
        if num != 1 or wt != 2:
            continue
        tag, value = "", None
        for n2, w2, v2 in _fields(v):  # type: ignore[arg-type]
            if n2 == 1 and w2 == 2:
                tag = bytes(v2).decode("utf-8", "replace")  # type: ignore[arg-type]
            elif n2 == 2 and w2 == 5:
                (value,) = struct.unpack("<f", v2)  # type: ignore[arg-type]
            elif n2 == 8 and w2 == 2 and value is None:
                value = _tensor_value(v2)  # type: ignore[arg-type]
        if tag and value is not None and math.isfinite(value) and step >= 0:
            out.append(Point(step, wall, tag, float(value)))
    return out


# --- MLflow file store ------------------------------------------------------------------------------
def mlflow_lines(text: str, key: str) -> list[Point]:
    """The whole lines of one metrics/<key> file ("timestamp_ms value step"); others skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            ts, value = int(parts[0]), float(parts[1])
            step = int(parts[2]) if len(parts) > 2 else 0
        except ValueError:
            continue
        if math.isfinite(value) and step >= 0:
            out.append(Point(step, ts / 1000.0, key, value))
    return out


_STATUS = re.compile(r"^status:\s*'?\"?(\w+)", re.M)


def mlflow_status(meta_yaml: str) -> str:
    """RUNNING, FINISHED, FAILED, KILLED (the run's own end state), or ""."""
    m = _STATUS.search(meta_yaml)
    return MLFLOW_STATUS.get(m.group(1), "") if m else ""


# --- Trackio ---------------------------------------------------------------------------------------
TRACKIO_QUERY = "SELECT id, step, timestamp, metrics FROM metrics WHERE id > ? ORDER BY id LIMIT ?"


def trackio_rows(rows: list[tuple], when: Callable[[str], float]) -> tuple[list[Point], int]:
    """The scalars of rows (id, step, ISO timestamp, metrics JSON) and the highest id seen;
    `when` reads a timestamp (ValueError when it is none)."""
    out, last = [], 0
    for row in rows:
        try:
            rid, step, ts, metrics = row
            last = max(last, int(rid))
            t = when(str(ts))
            d = json.loads(metrics)
        except (ValueError, TypeError):
            continue
        if not isinstance(d, dict) or not isinstance(step, int) or step < 0:
            continue
        for k, v in d.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                out.append(Point(step, t, str(k), float(v)))
    return out, last


# --- W&B offline ------------------------------------------------------------------------------------
WANDB_HEADER = 7
WANDB_MAGIC = b":W&B"
WANDB_BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_chunks(buf: bytes, base: int, pending: bytes) -> tuple[list[bytes], int, bytes]:
    """The whole records in `buf` (which starts at file offset `base`), the bytes they took, and a
    record begun but not yet ended (handed back in with the next read)."""
    out: list[bytes] = []
    i = 0
    if base == 0:
        if len(buf) < WANDB_HEADER:
            return out, 0, pending
        if buf[:4] != WANDB_MAGIC:
            raise Garbage("no :W&B header")
        i = WANDB_HEADER
    while True:
        left = WANDB_BLOCK - (base + i) % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header: padding
            if len(buf) - i < left:
                break
            i += left
            continue
        if len(buf) - i < 7:
            break
        _crc, length, typ = struct.unpack_from("<IHB", buf, i)
        if typ == 0 and length == 0:  # zeroed space a writer reserved: the end for now
            break
        if length > left - 7 or typ not in (FULL, FIRST, MIDDLE, LAST):
            raise Garbage(f"a chunk of {length} bytes, type {typ}")
        if len(buf) - i < 7 + length:
            break
        data = bytes(buf[i + 7: i + 7 + length])
        i += 7 + length
        if typ == FULL:
            out.append(data)
            pending = b""
        elif typ == FIRST:
            pending = data
        elif typ == MIDDLE:
            pending += data
        else:
            out.append(pending + data)
            pending = b""
    return out, i, pending


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def wandb_record(rec: bytes) -> tuple[list[Point], int | None]:
    """A history record's scalars (at its step, its `_timestamp` as time), or an exit record's code."""
    history = b""
    for num, wt, v in _fields(rec):
        if num == 2 and wt == 2:
            history = v  # type: ignore[assignment]
        elif num == 18 and wt == 2:
            code = 0
            for n2, w2, v2 in _fields(v):  # type: ignore[arg-type]
                if n2 == 1 and w2 == 0:
                    code = int(v2)  # type: ignore[arg-type]
                    code = code - (1 << 64) if code >= 1 << 63 else code
            return [], code
    if not history:
        return [], None
    step, t = 0, 0.0
    values: dict[str, float] = {}
    for num, wt, v in _fields(history):
        if num == 2 and wt == 2:
            for n2, w2, v2 in _fields(v):  # type: ignore[arg-type]
                if n2 == 1 and w2 == 0:
                    step = int(v2)  # type: ignore[arg-type]
        elif num == 1 and wt == 2:
            key, nested, value = "", [], None
            for n2, w2, v2 in _fields(v):  # type: ignore[arg-type]
                if n2 == 1 and w2 == 2:
                    key = bytes(v2).decode("utf-8", "replace")  # type: ignore[arg-type]
                elif n2 == 2 and w2 == 2:
                    nested.append(bytes(v2).decode("utf-8", "replace"))  # type: ignore[arg-type]
                elif n2 == 6 and w2 == 1:
                    (value,) = struct.unpack("<d", v2)  # type: ignore[arg-type]
                elif n2 == 5 and w2 == 0:
                    value = float(_zigzag(int(v2)))  # type: ignore[arg-type]
                elif n2 == 16 and w2 == 2:
                    try:
                        j = json.loads(bytes(v2))  # type: ignore[arg-type]
                    except ValueError:
                        continue
                    if isinstance(j, int | float) and not isinstance(j, bool):
                        value = float(j)
            name = "/".join(nested) if nested else key
            if name and value is not None and math.isfinite(value):
                values[name] = value
    t = values.pop("_timestamp", 0.0)
    return [Point(step, t, k, v) for k, v in values.items() if not k.startswith("_")], None


# --- one observation per step -----------------------------------------------------------------------
def kind(key: str) -> str:
    """What a tracker's key means here: step, loss, epoch, learning_rate, or "" (not followed)."""
    k = key.strip().lower()
    if k in STEP_KEYS:
        return "step"
    if k in LOSS_KEYS:
        return "loss"
    if k in EPOCH_KEYS:
        return "epoch"
    if k in LR_KEYS:
        return "learning_rate"
    return ""
