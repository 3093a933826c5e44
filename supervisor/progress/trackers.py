"""The experiment trackers' files under the run's folders, read incrementally (trackfiles.py parses).

Found by a bounded walk of the watched folders and the workdir (no link followed, at most
WALK_ENTRIES entries, DEPTH levels), again every REDISCOVER_S; each file read from the offset where
the last read stopped, never from the start again (a file that shrank or was replaced starts over),
at most READ_MAX bytes a look, opened as a regular file only (no FIFO, no link: the folders are the
training user's). A file whose bytes are not its format's is left alone from then on.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
import threading
import time
from dataclasses import dataclass, field

import structlog

from supervisor.fileopen import open_regular
from supervisor.progress import trackfiles as tf
from supervisor.progress.parse import Observation

log = structlog.get_logger("progress")

TRACKIO_ROWS = 5000        # rows read a look at most (the next look goes on from there)
TRACKIO_WAIT_S = 5.0       # one look at a Trackio database takes at most this long
REDISCOVER_S = 60.0        # a new file (a second run folder) is found this late at most ...
REDISCOVER_NONE_S = 30.0   # ... and while none was found yet, this late (a trainer makes its first at start)
WALK_ENTRIES = 20000
DEPTH = 6
READ_MAX = 4 << 20
FILES_MAX = 64
TF_PREFIX = "events.out.tfevents."
SKIP_DIRS = {".git", "__pycache__", ".cache", "node_modules", ".venv", "media", "artifacts"}


@dataclass
class _File:
    path: str
    source: str           # tensorboard | mlflow
    key: str = ""         # mlflow: the metric's key
    ino: int = 0
    offset: int = 0
    tail: bytes = b""     # tensorboard, mlflow: bytes after the last whole record; wandb: a record begun
    dead: str = ""        # why it is no longer read


@dataclass
class Found:
    """What one look brought: observations (with the writer's time) and the trackers' end states."""

    obs: list[tuple[Observation, float]] = field(default_factory=list)
    ended: dict[str, str] = field(default_factory=dict)   # run folder -> "MLflow run ...: FINISHED", "W&B run ...: exit code 0"


class TrackerFiles:
    def __init__(self, sources: list[str]):
        wanted = set(sources)
        self.tensorboard = "auto" in wanted or "tensorboard" in wanted
        self.mlflow = "auto" in wanted or "mlflow" in wanted
        self.trackio = "auto" in wanted or "trackio" in wanted
        self.wandb = "auto" in wanted or "wandb" in wanted
        self._files: dict[str, _File] = {}
        self._found_at = float("-inf")
        self._lock = threading.Lock()
        self.newest: dict[str, tuple[int, float]] = {}   # source -> (step, its time)

    @property
    def wanted(self) -> bool:
        return self.tensorboard or self.mlflow or self.trackio or self.wandb

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
            for f in list(self._files.values()):
                if not f.dead:
                    self._read(f, out)
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
        if self.mlflow:
            parts = path.split(os.sep)
            # mlruns/<experiment>/<run>/metrics/<key, nested folders for a key with '/'>
            for i in range(len(parts) - 2, 2, -1):
                if parts[i] == "metrics" and parts[i - 3] == "mlruns":
                    return "mlflow", "/".join(parts[i + 1:])
        return "", ""

    # --- reading ---------------------------------------------------------------------------------
    def _read(self, f: _File, out: Found) -> None:
        if f.source == "trackio":
            self._trackio(f, out)
            return
        try:
            fd = open_regular(f.path)
        except OSError:
            return  # gone, or not a regular file now: looked for again at the next discovery
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return
            if st.st_ino != f.ino or st.st_size < f.offset:
                f.ino, f.offset, f.tail = st.st_ino, 0, b""  # replaced or truncated: from its start
            data = os.pread(fd, READ_MAX, f.offset) if st.st_size > f.offset else b""
        except OSError:
            return
        finally:
            os.close(fd)
        try:
            if f.source == "tensorboard":
                self._tensorboard(f, data, out)
            elif f.source == "wandb":
                self._wandb(f, data, out)
            else:
                self._mlflow(f, data, out)
        except tf.Garbage as e:
            f.dead = f"not a {f.source} file: {e}"
            log.warning("tracker_file_unreadable", path=f.path, source=f.source, error=str(e))

    def _tensorboard(self, f: _File, data: bytes, out: Found) -> None:
        buf = f.tail + data
        records, used = tf.tf_records(buf)
        f.offset += len(data)
        f.tail = buf[used:]
        by_step: dict[int, dict[str, float]] = {}
        at: dict[int, float] = {}
        for rec in records:
            for p in tf.tf_scalars(rec):
                k = tf.kind(p.key)
                if k:
                    by_step.setdefault(p.step, {})[k] = p.value
                    at[p.step] = max(at.get(p.step, 0.0), p.t)
        self._emit("tensorboard", by_step, at, out)

    def _wandb(self, f: _File, data: bytes, out: Found) -> None:
        """Whole chunks from the offset on; a chunk not whole yet is read again next time (from
        where it starts, never the file's start)."""
        records, used, f.tail = tf.wandb_chunks(data, f.offset, f.tail)
        f.offset += used
        by_step: dict[int, dict[str, float]] = {}
        at: dict[int, float] = {}
        for rec in records:
            points, code = tf.wandb_record(rec)
            if code is not None:
                out.ended[os.path.dirname(f.path)] = f"W&B run {os.path.dirname(f.path)}: exit code {code}"
            for p in points:
                k = tf.kind(p.key)
                if k:
                    by_step.setdefault(p.step, {})[k] = p.value
                    at[p.step] = max(at.get(p.step, 0.0), p.t)
        self._emit("wandb", by_step, at, out)

    def _mlflow(self, f: _File, data: bytes, out: Found) -> None:
        buf = f.tail + data
        cut = buf.rfind(b"\n") + 1
        f.offset += len(data)
        f.tail = buf[cut:]
        k = tf.kind(f.key)
        run_dir = f.path[: -len(os.sep + "metrics" + os.sep + f.key)]  # mlruns/<experiment>/<run>
        self._mlflow_status(run_dir, out)
        if not k or not cut:
            return
        by_step: dict[int, dict[str, float]] = {}
        at: dict[int, float] = {}
        for p in tf.mlflow_lines(buf[:cut].decode("utf-8", "replace"), f.key):
            by_step.setdefault(p.step, {})[k] = p.value
            at[p.step] = max(at.get(p.step, 0.0), p.t)
        self._emit("mlflow", by_step, at, out)

    def _trackio(self, f: _File, out: Found) -> None:
        """Rows past the last id read, from the database opened read-only: never a link (nofollow),
        never a write or a lock a writer waits on (Trackio keeps it in WAL mode: a reader takes none).
        SQLite opens the path itself, so a FIFO put there after the lstat would block its open: the
        read runs aside and is given up after TRACKIO_WAIT_S (the file is then left alone)."""
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
        if box.get("dead"):
            f.dead = str(box["dead"])
        rows = box.get("rows")
        if not isinstance(rows, list):
            return
        points, last = tf.trackio_rows(rows, lambda ts: dt.datetime.fromisoformat(ts).timestamp())
        f.offset = max(f.offset, last)
        by_step: dict[int, dict[str, float]] = {}
        at: dict[int, float] = {}
        for p in points:
            k = tf.kind(p.key)
            if k:
                by_step.setdefault(p.step, {})[k] = p.value
                at[p.step] = max(at.get(p.step, 0.0), p.t)
        self._emit("trackio", by_step, at, out)

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

    def _emit(self, source: str, by_step: dict[int, dict[str, float]], at: dict[int, float], out: Found) -> None:
        for step in sorted(by_step):
            v = by_step[step]
            out.obs.append((Observation(step=step, loss=v.get("loss"), epoch=v.get("epoch"),
                                        learning_rate=v.get("learning_rate"), source=source), at[step]))
            if step >= self.newest.get(source, (-1, 0.0))[0]:
                self.newest[source] = (step, at[step])

    def status(self) -> dict:
        with self._lock:
            files = list(self._files.values())
        return {"files": [{"path": f.path, "source": f.source, "read_bytes": f.offset, "error": f.dead or None}
                          for f in files[:16]],
                "newest": {s: {"step": st, "at": t} for s, (st, t) in self.newest.items()}}


def _trackio_rows(path: str, after: int, box: dict) -> None:
    """The rows of Trackio's metrics table past id `after` into box["rows"] (box["dead"]: why the
    file is not one to read again)."""
    import sqlite3
    from urllib.parse import quote

    try:
        con = sqlite3.connect(f"file:{quote(path)}?mode=ro&nofollow=1", uri=True, timeout=0.5,
                              check_same_thread=False)
    except (OSError, sqlite3.Error):
        return
    try:
        box["rows"] = con.execute(tf.TRACKIO_QUERY, (after, TRACKIO_ROWS)).fetchall()
    except sqlite3.DatabaseError as e:
        if "no such table" in str(e):
            box["dead"] = "not a Trackio database (no metrics table)"
    finally:
        con.close()
