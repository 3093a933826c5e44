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
  wandb's own descriptors give them (wandb_internal.proto). W&B's own step (`_step`) counts the
  `log()` calls: the training step is the record's `train/global_step` (the HF WandbCallback logs it
  beside every row, without `step=`), else `trainer/global_step` (Lightning's WandbLogger), else `_step`.
- Lightning's CSVLogger (`lightning_logs/version_N/metrics.csv`): a header naming the metrics, `step`
  among them, then one row per logged step (empty cells for metrics not logged then), lines ended by
  CRLF. The logger adds a new metric's column by writing the whole file again under a new header.

Records are read only when whole, and never held: a reader stops before a record the writer has not
finished and the next look reads it again from its start (supervisor.untrusted.records frames the
bytes, with caps). The bytes are the training user's: every reader here returns its points or raises
Unreadable (`Garbage`), whatever they hold; one bad record is the caller's to skip and count.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.untrusted import Unreadable, finite_int, int_or_none, json_doc, json_object
from supervisor.untrusted import records as rec_

RECORD_MAX = rec_.TF_RECORD_MAX
VALUE_MAX = 1 << 20      # a Trackio row's metrics, a W&B value_json: a few KiB from a real writer
STEP_KEYS = ("train/global_step", "global_step", "trainer/global_step")
# train_loss_step: Lightning's name for a loss logged with on_step=True and on_epoch=True
LOSS_KEYS = ("train/loss", "loss", "train_loss", "loss/train", "train/train_loss", "training_loss", "train_loss_step")
# The step Lightning's loggers write (its `trainer/global_step` in W&B, `step` in metrics.csv) is the
# index of the optimizer step just made, from 0: after 40 steps its last row says 39, while its
# checkpoint says step=40 and trainer.global_step is 40. The step here is steps done, as everywhere.
LIGHTNING_STEP_SHIFT = 1
EPOCH_KEYS = ("train/epoch", "epoch")
LR_KEYS = ("train/learning_rate", "learning_rate", "lr", "train/lr")
MLFLOW_STATUS = {"1": "RUNNING", "2": "SCHEDULED", "3": "FINISHED", "4": "FAILED", "5": "KILLED",
                 "RUNNING": "RUNNING", "FINISHED": "FINISHED", "FAILED": "FAILED", "KILLED": "KILLED"}
_DIGITS_MAX = 20         # an MLflow timestamp or step longer than this is no number we take


@dataclass(frozen=True)
class Point:
    step: int
    t: float          # wall time the writer gave it
    key: str
    value: float


# The bytes are not what the file's name says, or one record is broken: the old name of Unreadable,
# kept so that a caller catching either catches both.
Garbage = Unreadable


def _step(v: object) -> int:
    return finite_int(v, what="the step")


def _time(v: float) -> float:
    if not math.isfinite(v):
        raise Unreadable("the time is not finite")
    return v


# --- TFRecord and protobuf ---------------------------------------------------------------------------
def tf_records(buf: bytes | memoryview) -> tuple[list[bytes], int]:
    """The whole records at the start of `buf`, and how many bytes they took."""
    f = rec_.tf_records(bytes(buf))
    return f.records, f.used


def _tensor_value(b: bytes, walk: rec_.Walk) -> float | None:
    """A scalar TensorProto (dtype float or double): float_val, double_val, or tensor_content."""
    dtype = 0
    content = b""
    first: float | None = None
    for num, wt, v in rec_.fields(b, walk):
        if num == 1 and wt == 0:
            dtype = int(v)  # type: ignore[arg-type]
        elif num == 4 and wt == 2:
            content = v  # type: ignore[assignment]
        elif first is None and isinstance(v, bytes) and (num, wt) in ((5, 2), (5, 5), (6, 2), (6, 1)):
            # float_val / double_val, packed or not: only the first value is a scalar's
            size = 4 if num == 5 else 8
            if len(v) >= size:
                (first,) = struct.unpack_from("<f" if num == 5 else "<d", v)
    if first is not None:
        return first
    if content and dtype == 1 and len(content) >= 4:
        return struct.unpack_from("<f", content)[0]
    if content and dtype == 2 and len(content) >= 8:
        return struct.unpack_from("<d", content)[0]
    return None


def tf_scalars(event: bytes) -> list[Point]:
    """The scalars of one Event record (none for the file-version and graph records); Unreadable
    when it is no Event, or its step or time is none a writer gives."""
    try:
        return _tf_scalars(event)
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001 - nothing but Unreadable leaves a reader
        raise Unreadable(f"an event: {type(e).__name__}") from None


def _tf_scalars(event: bytes) -> list[Point]:
    walk = rec_.Walk()
    wall, step, summary = 0.0, 0, b""
    for num, wt, v in rec_.fields(event, walk):
        if num == 1 and wt == 1:
            (wall,) = struct.unpack("<d", v)  # type: ignore[arg-type]
        elif num == 2 and wt == 0:
            step = int(v)  # type: ignore[arg-type]
            step = step - (1 << 64) if step >= 1 << 63 else step
        elif num == 5 and wt == 2:
            summary = v  # type: ignore[assignment]
    out = []
    for num, wt, v in rec_.fields(summary, walk):
        if num != 1 or wt != 2:
            continue
        tag, value = "", None
        for n2, w2, v2 in rec_.fields(v, walk):  # type: ignore[arg-type]
            if n2 == 1 and w2 == 2:
                tag = bytes(v2).decode("utf-8", "replace")  # type: ignore[arg-type]
            elif n2 == 2 and w2 == 5:
                (value,) = struct.unpack("<f", v2)  # type: ignore[arg-type]
            elif n2 == 8 and w2 == 2 and value is None:
                value = _tensor_value(v2, walk)  # type: ignore[arg-type]
        if tag and value is not None and math.isfinite(value):
            out.append(Point(_step(step), _time(wall), tag, float(value)))
    return out


# --- MLflow file store ------------------------------------------------------------------------------
def mlflow_line(line: bytes | str, key: str) -> Point | None:
    """One "timestamp_ms value step" line: its point, None for a blank line or a value that is no
    finite number (MLflow writes NaN as it was logged), else Unreadable."""
    try:
        parts = (line.decode("utf-8", "replace") if isinstance(line, bytes | bytearray) else str(line)).split()
        if not parts:
            return None
        if len(parts) < 2 or len(parts[0]) > _DIGITS_MAX or (len(parts) > 2 and len(parts[2]) > _DIGITS_MAX):
            raise Unreadable("not a metric line")
        ts = finite_int(int(parts[0]), what="the timestamp")
        value = float(parts[1])
        step = _step(int(parts[2])) if len(parts) > 2 else 0
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001
        raise Unreadable(f"not a metric line ({type(e).__name__})") from None
    return Point(step, ts / 1000.0, key, value) if math.isfinite(value) else None


def mlflow_lines(text: str, key: str, skipped: Callable[[Unreadable], None] = lambda e: None) -> list[Point]:
    """The whole lines of one metrics/<key> file; a line that is none is passed to `skipped`."""
    out = []
    for line in text.splitlines():
        try:
            p = mlflow_line(line, key)
        except Unreadable as e:
            skipped(e)
            continue
        if p is not None:
            out.append(p)
    return out


_STATUS = re.compile(r"^status:\s*'?\"?(\w+)", re.M)


def mlflow_status(meta_yaml: str) -> str:
    """RUNNING, FINISHED, FAILED, KILLED (the run's own end state), or ""."""
    m = _STATUS.search(meta_yaml)
    return MLFLOW_STATUS.get(m.group(1), "") if m else ""


# --- Trackio ---------------------------------------------------------------------------------------
# `id` is checked to be the table's integer primary key (the rowid): the range and the order are an
# index walk, whatever the table holds
TRACKIO_QUERY = "SELECT id, step, timestamp, metrics FROM metrics WHERE id > ? ORDER BY id LIMIT ?"


def trackio_row(row: tuple, when: Callable[[str], float]) -> list[Point]:
    """The scalars of one row (id, step, ISO timestamp, metrics JSON); `when` reads a timestamp.
    Unreadable: not such a row (a step out of range, a time that is none, metrics nested too deep)."""
    try:
        _rid, step, ts, metrics = row
        if not isinstance(ts, str) or len(ts) > 64:
            raise Unreadable("the timestamp is not one")
        t = _time(float(when(ts)))
        if isinstance(step, bool) or not isinstance(step, int):
            raise Unreadable("the step is not an integer")
        s = _step(step)
        d = json_object(metrics, limit=VALUE_MAX, what="the metrics")
        return [Point(s, t, str(k), float(v)) for k, v in d.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001 - `when` may raise anything on a strange time
        raise Unreadable(f"a row: {type(e).__name__}") from None


def trackio_rows(rows: list[tuple], when: Callable[[str], float],
                 skipped: Callable[[Unreadable], None] = lambda e: None) -> tuple[list[Point], int]:
    """The scalars of rows, and the highest id seen; a row that is none is passed to `skipped`."""
    out, last = [], 0
    for row in rows:
        rid = int_or_none(row[0] if isinstance(row, tuple) and row else None)
        last = max(last, rid or 0)
        try:
            out += trackio_row(row, when)
        except Unreadable as e:
            skipped(e)
    return out, last


# --- W&B offline ------------------------------------------------------------------------------------
WANDB_HEADER = rec_.WANDB_HEADER
WANDB_MAGIC = rec_.WANDB_MAGIC
WANDB_BLOCK = rec_.WANDB_BLOCK


def wandb_chunks(buf: bytes, base: int, pending: bytes | None = b"") -> tuple[list[bytes], int, bytes | None]:
    """records.wandb_chunks in the shape of the first reader: nothing is held (a record not ended
    is read again from its first chunk), so `pending` is b"" between records, None inside one
    being passed over."""
    f = rec_.wandb_chunks(bytes(buf), base, skipping=pending is None)
    return f.records, f.used, None if f.skipping else b""


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def wandb_record(rec: bytes) -> tuple[list[Point], int | None]:
    """A history record's scalars (at its step, its `_timestamp` as time), or an exit record's
    code; Unreadable when it is no record (a step out of range, a value_json that is none)."""
    try:
        return _wandb_record(rec)
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001
        raise Unreadable(f"a record: {type(e).__name__}") from None


def _wandb_record(rec: bytes) -> tuple[list[Point], int | None]:
    walk = rec_.Walk()
    history = b""
    for num, wt, v in rec_.fields(rec, walk):
        if num == 2 and wt == 2:
            history = v  # type: ignore[assignment]
        elif num == 18 and wt == 2:
            code = 0
            for n2, w2, v2 in rec_.fields(v, walk):  # type: ignore[arg-type]
                if n2 == 1 and w2 == 0:
                    code = int(v2)  # type: ignore[arg-type]
                    code = code - (1 << 64) if code >= 1 << 63 else code
            return [], code
    if not history:
        return [], None
    step = 0
    values: dict[str, float] = {}
    for num, wt, v in rec_.fields(history, walk):
        if num == 2 and wt == 2:
            for n2, w2, v2 in rec_.fields(v, walk):  # type: ignore[arg-type]
                if n2 == 1 and w2 == 0:
                    step = int(v2)  # type: ignore[arg-type]
        elif num == 1 and wt == 2:
            key, nested, value = "", [], None
            for n2, w2, v2 in rec_.fields(v, walk):  # type: ignore[arg-type]
                if n2 == 1 and w2 == 2:
                    key = bytes(v2).decode("utf-8", "replace")  # type: ignore[arg-type]
                elif n2 == 2 and w2 == 2:
                    nested.append(bytes(v2).decode("utf-8", "replace"))  # type: ignore[arg-type]
                elif n2 == 6 and w2 == 1:
                    (value,) = struct.unpack("<d", v2)  # type: ignore[arg-type]
                elif n2 == 5 and w2 == 0:
                    value = float(_zigzag(int(v2)))  # type: ignore[arg-type]
                elif n2 == 16 and w2 == 2:
                    j = json_doc(v2, limit=VALUE_MAX, what="a value_json")  # type: ignore[arg-type]
                    if isinstance(j, int | float) and not isinstance(j, bool):
                        value = float(j)
            name = "/".join(nested) if nested else key
            if name and value is not None and math.isfinite(value):
                values[name] = value
    t = values.pop("_timestamp", 0.0)
    if "train/global_step" in values:
        step = _step(values["train/global_step"])
    elif "trainer/global_step" in values:
        step = _step(values["trainer/global_step"]) + LIGHTNING_STEP_SHIFT
    points = [Point(step, t, k, v) for k, v in values.items() if not k.startswith("_")]
    if points:
        _step(step)
    return points, None


# --- Lightning's CSVLogger ---------------------------------------------------------------------------
CSV_CELL_MAX = 64        # a number in a cell is never longer; a longer cell is no number
CSV_COLUMNS_MAX = 4096   # metrics one header may name


def _csv_cells(line: bytes | str) -> list[str]:
    """The cells of one CSV line as Python's csv module writes it (quotes around a cell that holds a
    comma or a quote, a quote doubled inside); CR and LF at its end dropped."""
    text = (line.decode("utf-8", "replace") if isinstance(line, bytes | bytearray) else str(line)).rstrip("\r\n")
    cells: list[str] = []
    cur: list[str] = []
    quoted = False
    i = 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == '"' and text[i + 1:i + 2] == '"':
                cur.append('"')
                i += 1
            elif c == '"':
                quoted = False
            else:
                cur.append(c)
        elif c == '"':
            quoted = True
        elif c == ",":
            cells.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    if quoted:
        raise Unreadable("a quote that never ends")
    cells.append("".join(cur))
    return cells


def csv_header(line: bytes | str) -> tuple[str, ...]:
    """The column names of a metrics.csv; Unreadable when it is no such header (no `step` column)."""
    try:
        cols = tuple(c.strip() for c in _csv_cells(line))
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001
        raise Unreadable(f"a header: {type(e).__name__}") from None
    if "step" not in cols or len(cols) > CSV_COLUMNS_MAX:
        raise Unreadable("not a metrics.csv (no step column)")
    return cols


def csv_row(line: bytes | str, cols: tuple[str, ...], t: float, shift: int = 0) -> list[Point]:
    """The numbers of one row under header `cols`, at `step` + shift, with time `t` (the file's: a
    row holds none); [] for a blank line. Unreadable: not such a row (another count of cells, a step
    that is none)."""
    try:
        cells = _csv_cells(line)
        if cells == [""]:
            return []
        if len(cells) != len(cols):
            raise Unreadable(f"a row of {len(cells)} cells under a header of {len(cols)}")
        by = dict(zip(cols, cells, strict=True))
        s = by["step"].strip()
        if not s.isdigit() or len(s) > _DIGITS_MAX:
            raise Unreadable("the step is not a whole number")
        step = _step(int(s) + shift)
        out = []
        for k, v in by.items():
            v = v.strip()
            if k == "step" or not v or len(v) > CSV_CELL_MAX:
                continue
            try:
                x = float(v)
            except ValueError:
                continue  # a text cell (a run name): not a metric
            if math.isfinite(x):
                out.append(Point(step, _time(t), k, x))
        return out
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001
        raise Unreadable(f"a row: {type(e).__name__}") from None


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
