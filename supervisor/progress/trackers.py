"""The experiment trackers' files under the run's folders, read incrementally (trackfiles.py parses).

Found by a bounded walk of the watched folders and the workdir (no link followed, at most
WALK_ENTRIES entries, DEPTH levels), again every REDISCOVER_S; each file read from the offset where
the last read stopped, never from the start again (a file that shrank or was replaced starts over),
at most READ_MAX bytes a look, opened as a regular file only (no FIFO, no link: the folders are the
training user's). A file whose bytes are not its format's is left alone from then on.

The bytes are the training user's and the daemon is root, so every read is bounded: nothing is held
between looks (a record not whole yet is read again from its start; one longer than its cap is passed
over), one bad record is skipped and counted (status: `skipped`) and the file goes on, and one look
stops when it has spent POLL_CPU_S of CPU (the rest is read at the next). A Trackio database is
SQLite: it is read only from a real `metrics` table, with SQLite's trusted_schema off, no string or
blob longer than TRACKIO_VALUE_MAX, and a query interrupted after TRACKIO_QUERY_S. Lightning's
metrics.csv is read line by line like an MLflow file, under the header it began with: each look
first reads the header again, and a file whose header changed (the logger wrote it all again with a
new metric's column) is read from its start; its rows carry no time, so they take the file's mtime.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import quote

import structlog

from supervisor.progress import trackfiles as tf
from supervisor.progress.parse import MAX_EPOCHS_SANE, MAX_STEPS_SANE, Observation
from supervisor.untrusted import Unreadable
from supervisor.untrusted import records as rec
from supervisor.untrusted.fileopen import open_regular

log = structlog.get_logger("progress")

TRACKIO_ROWS = 5000        # rows read a look at most (the next look goes on from there)
TRACKIO_BYTES = 16 << 20   # ... and row bytes
TRACKIO_WAIT_S = 5.0       # one look at a Trackio database takes at most this long
TRACKIO_QUERY_S = 1.0      # a query runs this long at most (SQLite's progress handler interrupts it)
TRACKIO_VALUE_MAX = 1 << 20  # no string or blob longer is read or made (SQLITE_LIMIT_LENGTH); its row is skipped
TRACKIO_SLOW_MAX = 3       # queries in a row interrupted: the database is left alone
REDISCOVER_S = 60.0        # a new file (a second run folder) is found this late at most ...
REDISCOVER_NONE_S = 30.0   # ... and while none was found yet, this late (a trainer makes its first at start)
WALK_ENTRIES = 20000
DEPTH = 6
READ_MAX = 4 << 20         # more than a W&B record's cap and its chunk headers: a record under it is always finished
POLL_CPU_S = 0.25          # one look's CPU (this thread's) at most, checked between records
FILES_MAX = 64
TF_PREFIX = "events.out.tfevents."
SKIP_DIRS = {".git", "__pycache__", ".cache", "node_modules", ".venv", "media", "artifacts"}
CSV_NAME = "metrics.csv"    # Lightning's CSVLogger: <save_dir>/<name>/version_<N>/metrics.csv
CSV_LINE_MAX = 64 << 10     # a header naming many metrics is longer than an MLflow line


@dataclass
class _File:
    path: str
    source: str           # tensorboard | mlflow | trackio | wandb | lightning
    key: str = ""         # mlflow: the metric's key
    head: bytes = b""     # lightning: the header line as read (with its line end), once read
    cols: tuple[str, ...] = ()  # lightning: the header's names
    shift: int = 0        # lightning: added to the rows' step (the Trainer's rows count from 0)
    ino: int = 0
    offset: int = 0       # trackio: the last row id read
    need: int = 0         # tensorboard: bytes the next read must hold to finish the record begun at offset
    skipping: bool = False  # mlflow, wandb: offset is inside a line or record being passed over
    skipped: int = 0      # records (lines, rows) passed over: broken, or longer than their cap
    why: str = ""         # why the last one was
    slow: int = 0         # trackio: queries interrupted in a row
    error: str = ""       # trackio: the last read's error (logged when it changes)
    dead: str = ""        # why it is no longer read


@dataclass
class Found:
    """What one look brought: observations (with the writer's time) and the trackers' end states."""

    obs: list[tuple[Observation, float]] = field(default_factory=list)
    ended: dict[str, str] = field(default_factory=dict)   # run folder -> "MLflow run ...: FINISHED", "W&B run ...: exit code 0"


class _Steps:
    """What a look's records say, one entry per step: the kinds followed, at the writer's newest time."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, float]] = {}
        self.at: dict[int, float] = {}

    def add(self, p: tf.Point, k: str = "") -> None:
        k = k or tf.kind(p.key)
        if not k or p.step > MAX_STEPS_SANE:
            return
        if (k == "epoch" and not 0 <= p.value <= MAX_EPOCHS_SANE) or (k == "learning_rate" and p.value < 0):
            return  # as the log parser takes them: an epoch or a rate no trainer gives
        self.by_step.setdefault(p.step, {})[k] = p.value
        self.at[p.step] = max(self.at.get(p.step, 0.0), p.t)


class TrackerFiles:
    def __init__(self, sources: list[str]):
        wanted = set(sources)
        self.tensorboard = "auto" in wanted or "tensorboard" in wanted
        self.mlflow = "auto" in wanted or "mlflow" in wanted
        self.trackio = "auto" in wanted or "trackio" in wanted
        self.wandb = "auto" in wanted or "wandb" in wanted
        self.lightning = "auto" in wanted or "lightning" in wanted
        self._files: dict[str, _File] = {}
        self._found_at = float("-inf")
        self._lock = threading.Lock()
        self._resume = ""      # the file a look that ran out of CPU did not reach: the next starts there
        self.newest: dict[str, tuple[int, float]] = {}   # source -> (step, its time)

    @property
    def wanted(self) -> bool:
        return self.tensorboard or self.mlflow or self.trackio or self.wandb or self.lightning

    def poll(self, dirs: list[str], since: float | None, rediscover: bool = False,
             trackio_dirs: list[str] | None = None) -> Found:
        """New observations from every tracker file, each written at or after `since` (the run's start).
        `trackio_dirs`: where Trackio keeps its databases (TRACKIO_DIR, HF_HOME/trackio of the job)."""
        if not self.wanted:
            return Found()
        with self._lock:
            now = time.monotonic()
            if rediscover or now - self._found_at >= (REDISCOVER_S if self._files else REDISCOVER_NONE_S):
                self._found_at = now
                self._discover(dirs, since)
                if self.trackio:
                    self._discover_trackio(trackio_dirs or [], since)
            out = Found()
            files = [f for f in self._files.values() if not f.dead]
            first = next((i for i, f in enumerate(files) if f.path == self._resume), 0)
            self._resume = ""
            until = time.thread_time() + POLL_CPU_S
            for f in files[first:] + files[:first]:
                if time.thread_time() > until:
                    self._resume = f.path
                    break
                try:
                    self._read(f, out, until)
                except Exception as e:  # noqa: BLE001 - a fault of ours, not the bytes: this file stops, the others go on
                    f.dead = f"could not be read ({type(e).__name__})"
                    log.exception("tracker_file_failed", path=f.path, source=f.source)
            return out

    # --- finding ---------------------------------------------------------------------------------
    def _discover(self, dirs: list[str], since: float | None) -> None:
        seen = 0
        stack = [(os.path.normpath(d), 0) for d in dict.fromkeys(dirs) if d]
        while stack and seen < WALK_ENTRIES and len(self._files) < FILES_MAX:
            path, depth = stack.pop()
            try:
                it = os.scandir(path)
            except OSError:
                continue
            with it:
                for e in it:
                    seen += 1
                    try:
                        if e.is_dir(follow_symlinks=False):
                            if depth < DEPTH and e.name not in SKIP_DIRS and not e.name.startswith("checkpoint-"):
                                stack.append((e.path, depth + 1))
                        elif e.is_file(follow_symlinks=False) and e.path not in self._files:
                            st = e.stat(follow_symlinks=False)
                            if since is not None and st.st_mtime < since - 60:
                                continue  # an earlier run's file
                            src, key = self._kind(e.path)
                            if src:
                                self._files[e.path] = _File(e.path, src, key)
                    except OSError:
                        continue

    def _discover_trackio(self, dirs: list[str], since: float | None) -> None:
        for d in dict.fromkeys(dirs):
            try:
                it = os.scandir(d)
            except OSError:
                continue
            with it:
                for e in it:
                    try:
                        if (e.name.endswith(".db") and e.is_file(follow_symlinks=False) and e.path not in self._files
                                and len(self._files) < FILES_MAX
                                and (since is None or e.stat(follow_symlinks=False).st_mtime >= since - 60)):
                            self._files[e.path] = _File(e.path, "trackio")
                    except OSError:
                        continue

    def _kind(self, path: str) -> tuple[str, str]:
        name = os.path.basename(path)
        if self.tensorboard and name.startswith(TF_PREFIX):
            return "tensorboard", ""
        if self.wandb and name.startswith("run-") and name.endswith(".wandb"):
            return "wandb", ""
        if self.lightning and name == CSV_NAME:
            return "lightning", ""
        if self.mlflow:
            parts = path.split(os.sep)
            # mlruns/<experiment>/<run>/metrics/<key, nested folders for a key with '/'>
            for i in range(len(parts) - 2, 2, -1):
                if parts[i] == "metrics" and parts[i - 3] == "mlruns":
                    return "mlflow", "/".join(parts[i + 1:])
        return "", ""

    # --- reading ---------------------------------------------------------------------------------
    def _read(self, f: _File, out: Found, until: float) -> None:
        if f.source == "trackio":
            self._trackio(f, out, until)
            return
        try:
            fd = open_regular(f.path)
        except OSError:
            return  # gone, or not a regular file now: looked for again at the next discovery
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return
            if st.st_ino != f.ino or st.st_size < f.offset or (f.head and os.pread(fd, len(f.head), 0) != f.head):
                # replaced or truncated (or, a metrics.csv, written again under a new header): from its start
                f.ino, f.offset, f.need, f.skipping, f.head = st.st_ino, 0, 0, False, b""
            want = min(max(READ_MAX, f.need), st.st_size - f.offset)
            data = os.pread(fd, want, f.offset) if want > 0 else b""
        except OSError:
            return
        finally:
            os.close(fd)
        try:
            if f.source == "tensorboard":
                self._tensorboard(f, data, out, until)
            elif f.source == "wandb":
                self._wandb(f, data, out, until)
            elif f.source == "lightning":
                self._lightning(f, data, st.st_mtime, out, until)
            else:
                self._mlflow(f, data, out, until)
        except Unreadable as e:  # the framing itself: not a file of its kind
            f.dead = f"not a {f.source} file: {e}"
            log.warning("tracker_file_unreadable", path=f.path, source=f.source, error=str(e))

    def _take(self, f: _File, fr: rec.Framed, until: float, passed: str = "") -> Iterator[bytes]:
        """The records of one read, while the look has CPU left; the offset moves past each one
        taken, and past everything the read passed over once all were (`passed`: what those are,
        for the count). Consume it whole."""
        self._skipped(f, passed, fr.skipped)
        done = 0
        for r, end in zip(fr.records, fr.ends, strict=True):
            if time.thread_time() > until:
                f.offset += done
                f.need, f.skipping = 0, False  # a record's end: nothing begun here
                return
            yield r
            done = end
        f.offset += fr.used
        f.need, f.skipping = fr.need, fr.skipping

    def _skipped(self, f: _File, why: str, n: int = 1) -> None:
        """One bad record (or n) passed over: counted; logged the first time and at each power of ten."""
        if n <= 0:
            return
        before, f.skipped, f.why = f.skipped, f.skipped + n, why
        if before == 0 or len(str(f.skipped)) > len(str(before)):
            log.warning("tracker_records_skipped", path=f.path, source=f.source, skipped=f.skipped, why=why)

    def _tensorboard(self, f: _File, data: bytes, out: Found, until: float) -> None:
        steps = _Steps()
        for r in self._take(f, rec.tf_records(data), until):
            try:
                points = tf.tf_scalars(r)
            except Unreadable as e:
                self._skipped(f, f"an event: {e}")
                continue
            for p in points:
                steps.add(p)
        self._emit("tensorboard", steps, out)

    def _wandb(self, f: _File, data: bytes, out: Found, until: float) -> None:
        """Whole records from the offset on; one not whole yet is read again next time (from its
        first chunk, never the file's start)."""
        steps = _Steps()
        run_dir = os.path.dirname(f.path)
        chunks = rec.wandb_chunks(data, f.offset, skipping=f.skipping)
        for r in self._take(f, chunks, until, f"a record over {rec.WANDB_RECORD_MAX} bytes, or broken chunks"):
            try:
                points, code = tf.wandb_record(r)
            except Unreadable as e:
                self._skipped(f, f"a record: {e}")
                continue
            if code is not None:
                out.ended[run_dir] = f"W&B run {run_dir}: exit code {code}"
            for p in points:
                steps.add(p)
        self._emit("wandb", steps, out)

    def _mlflow(self, f: _File, data: bytes, out: Found, until: float) -> None:
        k = tf.kind(f.key)
        run_dir = f.path[: -len(os.sep + "metrics" + os.sep + f.key)]  # mlruns/<experiment>/<run>
        self._mlflow_status(run_dir, out)
        steps = _Steps()
        for line in self._take(f, rec.lines(data, skipping=f.skipping), until, f"a line over {rec.LINE_MAX} bytes"):
            if not k:
                continue  # a key not followed: its lines are stepped over unread
            try:
                p = tf.mlflow_line(line, f.key)
            except Unreadable as e:
                self._skipped(f, f"a line: {e}")
                continue
            if p is not None:
                steps.add(p, k)
        self._emit("mlflow", steps, out)

    def _lightning(self, f: _File, data: bytes, mtime: float, out: Found, until: float) -> None:
        """Whole lines from the offset on: the header first (a file with no `step` column is no
        metrics.csv: Unreadable, and it is left alone), then rows under it, each at the file's mtime."""
        steps = _Steps()
        lines = rec.lines(data, skipping=f.skipping, limit=CSV_LINE_MAX)
        for line in self._take(f, lines, until, f"a line over {CSV_LINE_MAX} bytes"):
            if not f.head:
                f.cols = tf.csv_header(line)
                f.head = line + b"\n"
                # the Trainer adds the epoch to every row it logs, and its rows count steps from 0
                f.shift = tf.LIGHTNING_STEP_SHIFT if "epoch" in f.cols else 0
                continue
            try:
                points = tf.csv_row(line, f.cols, mtime, f.shift)
            except Unreadable as e:
                self._skipped(f, f"a row: {e}")
                continue
            for p in points:
                steps.add(p)
        self._emit("lightning", steps, out)

    def _trackio(self, f: _File, out: Found, until: float) -> None:
        """Rows past the last id read, from the database opened read-only: never a link (nofollow),
        never a write or a lock a writer waits on (Trackio keeps it in WAL mode: a reader takes none).
        Every query ends within TRACKIO_QUERY_S (SQLite's progress handler); only SQLite's own open
        can block, on a FIFO put there after the lstat: so the read runs aside and is given up after
        TRACKIO_WAIT_S (the file is then left alone)."""
        try:
            if not stat.S_ISREG(os.lstat(f.path).st_mode):
                return
        except OSError:
            return
        box: dict[str, object] = {}
        reader = threading.Thread(target=_trackio_rows, args=(f.path, f.offset, box), name="trackio-read", daemon=True)
        reader.start()
        reader.join(TRACKIO_WAIT_S)
        if reader.is_alive():
            f.dead = f"did not answer within {TRACKIO_WAIT_S:g} s (not a database file?)"
            log.warning("tracker_file_unreadable", path=f.path, source=f.source, error=f.dead)
            return
        if box.get("slow"):
            f.slow += 1
            if f.slow >= TRACKIO_SLOW_MAX:
                box["dead"] = f"{f.slow} queries in a row ran past {TRACKIO_QUERY_S:g} s"
        elif "rows" in box:
            f.slow = 0
        if box.get("dead"):
            f.dead = str(box["dead"])
            log.warning("tracker_file_unreadable", path=f.path, source=f.source, error=f.dead)
        error = str(box.get("error") or "")
        if error and error != f.error:  # once, not every look (a file being created says it for a while)
            log.warning("trackio_read_failed", path=f.path, error=error)
        f.error = error
        rows = box.get("rows")
        if not isinstance(rows, list):
            return
        self._skipped(f, f"a value longer than {TRACKIO_VALUE_MAX} bytes", int(box.get("skipped") or 0))
        steps = _Steps()
        done: int = f.offset
        for row in rows:
            if time.thread_time() > until:
                break  # the rest at the next look, from the last row taken
            done = row[0]  # an int: _trackio_fetch hands back no other
            try:
                points = tf.trackio_row(row, _iso_time)
            except Unreadable as e:
                self._skipped(f, f"a row: {e}")
                continue
            for p in points:
                steps.add(p)
        else:
            after = box.get("after")
            done = after if isinstance(after, int) else done  # also past the rows too long to read
        f.offset = max(f.offset, done)
        self._emit("trackio", steps, out)

    def _mlflow_status(self, run_dir: str, out: Found) -> None:
        try:
            fd = open_regular(os.path.join(run_dir, "meta.yaml"))
        except OSError:
            return
        try:
            text = os.read(fd, 65536).decode("utf-8", "replace")
        except OSError:
            return
        finally:
            os.close(fd)
        status = tf.mlflow_status(text)
        if status in ("FINISHED", "FAILED", "KILLED"):
            out.ended[run_dir] = f"MLflow run {run_dir}: {status}"

    def _emit(self, source: str, steps: _Steps, out: Found) -> None:
        for step in sorted(steps.by_step):
            v, t = steps.by_step[step], steps.at[step]
            out.obs.append((Observation(step=step, loss=v.get("loss"), epoch=v.get("epoch"),
                                        learning_rate=v.get("learning_rate"), source=source), t))
            if step >= self.newest.get(source, (-1, 0.0))[0]:
                self.newest[source] = (step, t)

    def status(self) -> dict:
        with self._lock:
            files = list(self._files.values())
        return {"files": [{"path": f.path, "source": f.source, "read_bytes": f.offset, "error": f.dead or None,
                           "skipped": f.skipped, "skipped_why": f.why or None} for f in files[:16]],
                "newest": {s: {"step": st, "at": t} for s, (st, t) in self.newest.items()}}


def _iso_time(ts: str) -> float:
    return dt.datetime.fromisoformat(ts).timestamp()


_CREATE_TABLE = re.compile(r"\s*CREATE\s+TABLE\b", re.I)
_WITHOUT_ROWID = re.compile(r"\bWITHOUT\s+ROWID\b", re.I)


def _trackio_rows(path: str, after: int, box: dict) -> None:
    """The rows of Trackio's metrics table past id `after` into box: "rows" (ids are ints), "after"
    (the last id read or passed over), "skipped" (rows with a value too long to read); "dead": why
    the file is not one to read again; "slow": the query was interrupted; "error": what else failed."""
    try:
        con = sqlite3.connect(f"file:{quote(path)}?mode=ro&nofollow=1", uri=True, timeout=0.5,
                              check_same_thread=False)
    except (OSError, sqlite3.Error):
        return
    try:
        harden(con, time.monotonic() + TRACKIO_QUERY_S)
        why = _trackio_table(con)
        if why:
            box["dead"] = why
            return
        box.update(_trackio_fetch(con, after))
    except sqlite3.OperationalError as e:
        if "interrupted" in str(e):
            box["slow"] = True
        else:
            box["error"] = str(e)[:200]
    except sqlite3.Error as e:  # not a database, malformed, locked: tried again at the next look
        box["error"] = str(e)[:200]
    except Exception as e:  # noqa: BLE001 - this thread's end must say what happened, never print a traceback
        box["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        con.close()


def harden(con: sqlite3.Connection, deadline: float) -> None:
    """What the database may make SQLite do, for a file someone else wrote: no function or virtual
    table its schema names runs unless SQLite calls it harmless (trusted_schema off), no string or
    blob longer than TRACKIO_VALUE_MAX is made or read (a view of huge strings, a stored one: the
    statement fails instead), no schema statement longer than that is parsed, a page that lies
    about its cells is an error, and every statement is interrupted at `deadline` (monotonic)."""
    con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, TRACKIO_VALUE_MAX)
    con.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, TRACKIO_VALUE_MAX)
    con.set_progress_handler(lambda: time.monotonic() > deadline, 1000)  # nonzero: interrupt
    con.execute("PRAGMA trusted_schema = OFF")
    con.execute("PRAGMA cell_size_check = ON")


def _trackio_table(con: sqlite3.Connection) -> str:
    """"" when `metrics` is a table as Trackio makes it: a plain table (a view runs its SQL as
    root on every read; a virtual table its module's code) whose `id` is its integer primary key
    (the range and the order are then an index walk) with the columns read, none computed."""
    rows = con.execute("SELECT type, sql FROM sqlite_master WHERE name = 'metrics' COLLATE NOCASE").fetchall()
    if not rows:
        return "not a Trackio database (no metrics table)"
    typ, sql = rows[0]
    if len(rows) != 1 or typ != "table" or not isinstance(sql, str) or not _CREATE_TABLE.match(sql) \
            or _WITHOUT_ROWID.search(sql):
        return f"not a Trackio database (its metrics is a {str(typ)[:20]}, not a plain table: never read)"
    cols = {str(r[1]).lower(): r for r in con.execute("PRAGMA table_xinfo(metrics)")}
    # table_xinfo: cid, name, type, notnull, default, pk, hidden (0: stored as written, else computed)
    if not {"id", "step", "timestamp", "metrics"} <= cols.keys() or any(r[6] for r in cols.values()):
        return "not a Trackio database (its metrics table lacks a column, or computes one)"
    pk = [r for r in cols.values() if r[5]]
    if len(pk) != 1 or str(pk[0][1]).lower() != "id" or str(pk[0][2]).upper() != "INTEGER":
        return "not a Trackio database (its metrics id is not the integer primary key)"
    return ""


def _trackio_fetch(con: sqlite3.Connection, after: int) -> dict:
    """Up to TRACKIO_ROWS rows (TRACKIO_BYTES) past `after`. A row with a value longer than
    TRACKIO_VALUE_MAX fails its statement (SQLITE_TOOBIG): it is passed over by its id (read
    alone: the id needs none of its values) and the read goes on after it."""
    rows: list[tuple] = []
    skipped = size = 0
    while len(rows) + skipped < TRACKIO_ROWS and size < TRACKIO_BYTES:
        try:  # the first row is read by execute() itself, the others by the loop: either may fail
            for row in con.execute(tf.TRACKIO_QUERY, (after, TRACKIO_ROWS - len(rows) - skipped)):
                if type(row[0]) is not int:  # text sorts after every number: nothing readable follows
                    return {"rows": rows, "after": after, "skipped": skipped}
                rows.append(row)
                after = row[0]
                size += sum(len(v) for v in row if isinstance(v, str | bytes))
                if size >= TRACKIO_BYTES:
                    break
            else:
                break  # every row there is
        except sqlite3.DataError:
            nxt = con.execute("SELECT id FROM metrics WHERE id > ? ORDER BY id LIMIT 1", (after,)).fetchone()
            if nxt is None or type(nxt[0]) is not int:
                break
            after, skipped = nxt[0], skipped + 1
    return {"rows": rows, "after": after, "skipped": skipped}
