"""What the target verifiably holds, persisted in state_dir so a restart never re-sends it.

An append-only journal (`journal.jsonl`) plus a compacted snapshot (`snapshot.json`), one pair per
target. A file enters the ledger (`done`) only after the target confirmed and we verified it;
`begin`/`part` records say what was in flight, so after a crash the engine can ask the target
whether an upload finished, or resume a multipart upload, instead of sending it again.

Survives kill -9 at any point: each record is one `write` of one line; a torn last line is
skipped on load (and a newline is added before appending again); compaction writes the new
snapshot atomically before emptying the journal, and a journal whose generation is older than
the snapshot's is ignored, so the crash between the two steps replays nothing twice. Losing
records (a power cut before fsync) can only cause a re-send, never a false "uploaded".
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from supervisor.statefile import FULL, atomic_write, release_reserve, set_aside, write_all
from supervisor.store._log import get_logger
from supervisor.store.base import TargetError

log = get_logger("sync.ledger")

COMPACT_MIN_LINES = 20000


@dataclass(frozen=True)
class Entry:
    size: int
    mtime_ns: int
    sha256: str
    etag: str = ""      # the target's own fingerprint (S3 ETag / checksum), for later checks
    src: str = ""
    at: float = 0.0
    ino: int = 0        # the source file's inode when it was sent (0: not recorded, older ledgers)
    # when the target's copy of this version was last checked by content in a final sync (0: not
    # since it was sent); a later final sync checks such a file by the target's cheap means only
    checked: float = 0.0
    ctime_ns: int = 0   # the source's ctime when it was sent (0: not recorded, older ledgers)

    def pack(self) -> list:
        v = [self.size, self.mtime_ns, self.sha256, self.etag, self.src, self.at]
        if self.ctime_ns:
            return [*v, self.ino, self.checked, self.ctime_ns]
        if self.checked:
            return [*v, self.ino, self.checked]
        return [*v, self.ino] if self.ino else v

    @staticmethod
    def unpack(v: list) -> Entry:
        return Entry(int(v[0]), int(v[1]), str(v[2]), str(v[3]), str(v[4]), float(v[5]),
                     int(v[6]) if len(v) > 6 else 0, float(v[7]) if len(v) > 7 else 0.0,
                     int(v[8]) if len(v) > 8 else 0)


class LedgerBusy(Exception):
    """Another process (the daemon, or a one-shot sync) holds this ledger."""


def open_ledger(state_dir: str, identity: str) -> tuple[Ledger | None, str, str]:
    """(ledger, "", "") or (None, the log event, the error for status): busy or unusable."""
    try:
        return Ledger(state_dir, identity), "", ""
    except LedgerBusy as e:
        return None, "sync_ledger_busy", str(e)
    except OSError as e:
        return None, "sync_ledger_unusable", f"cannot open the sync ledger in {state_dir}: {e}"


class LedgerWriteError(TargetError):
    """A record could not be written (full disk, I/O error). A TargetError so the batch stops and
    the engine retries with backoff and alerts, as for a network failure: the file is sent again
    later rather than counted as on the target without a record."""


def target_slug(target_id: str) -> str:
    readable = re.sub(r"[^A-Za-z0-9]+", "-", target_id).strip("-")[:40]
    return f"{readable}-{hashlib.sha1(target_id.encode()).hexdigest()[:10]}"


class Ledger:
    def __init__(self, state_dir: str | Path, target_id: str):
        self.target_id = target_id
        self.dir = Path(state_dir) / "sync" / target_slug(target_id)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # one writer per ledger: a one-shot sync beside the daemon would corrupt the journal
        self._lock_fd: int | None = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise LedgerBusy(f"{self.dir} is in use by another process (is train-supervisord running?)") from None
        self.journal_path = self.dir / "journal.jsonl"
        self.snapshot_path = self.dir / "snapshot.json"
        self._lock = threading.RLock()
        self.files: dict[str, Entry] = {}
        self.inflight: dict[str, dict] = {}
        self.manifests: dict[str, dict] = {}
        self._content: dict[tuple[str, int], str] | None = None  # (sha256, size) -> key; built on first twin()
        self.gen = 0
        self.skipped_lines = 0
        self._lines = 0
        self._fd: int | None = None
        self._unsynced = False
        self._bytes = 0
        self._torn = False  # a failed append may have left half a line: start the next on a new one
        self._compact_at = COMPACT_MIN_LINES
        self._load()
        self._open()

    # --- queries ------------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        with self._lock:
            return self.files.get(key)

    def current(self, key: str, size: int, mtime_ns: int, ino: int = 0, ctime_ns: int = 0) -> Entry | None:
        """The entry when the target holds exactly this version of the file (`ino`, when given
        and recorded, must match too: a file replaced by a copy with the same size and mtime;
        `ctime_ns` likewise: bytes rewritten in place with the mtime set back move the ctime)."""
        with self._lock:
            e = self.files.get(key)
            if e is None or e.size != size or e.mtime_ns != mtime_ns:
                return None
            if ctime_ns and e.ctime_ns and ctime_ns != e.ctime_ns:
                return None
            return e if not (ino and e.ino and ino != e.ino) else None

    def in_flight(self, key: str) -> dict | None:
        with self._lock:
            v = self.inflight.get(key)
            return json.loads(json.dumps(v)) if v is not None else None

    def twin(self, sha256: str, size: int, besides: str) -> tuple[str, Entry] | None:
        """A key other than `besides` whose verified content on the target has this sha256 and
        size (the same tokenizer.json in every checkpoint), with its entry; None if there is none."""
        with self._lock:
            if self._content is None:
                self._content = {(e.sha256, e.size): k for k, e in self.files.items() if e.sha256}
            k = self._content.get((sha256, size))
            if k is None or k == besides:
                return None
            e = self.files.get(k)
            return (k, e) if e is not None and e.sha256 == sha256 and e.size == size else None

    def manifest(self, unit_key: str) -> dict | None:
        with self._lock:
            return self.manifests.get(unit_key)

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return len(self.files), self._bytes

    def keys_under(self, prefix: str) -> list[str]:
        p = prefix.rstrip("/")
        with self._lock:
            if not p:
                return list(self.files)
            return [k for k in self.files if k == p or k.startswith(p + "/")]

    def manifests_under(self, prefix: str) -> list[str]:
        p = prefix.rstrip("/")
        with self._lock:
            return [u for u in self.manifests if not p or u == p or u.startswith(p + "/")]

    # --- records ------------------------------------------------------------------------------
    def begin(self, key: str, size: int, mtime_ns: int, info: dict | None = None) -> None:
        rec = {"op": "begin", "k": key, "size": size, "mtime_ns": mtime_ns, "i": info or {}}
        with self._lock:
            self._append(rec)
            self._apply(rec)

    def part(self, key: str, n: int, etag: str, checksum: str, size: int) -> None:
        rec = {"op": "part", "k": key, "n": n, "etag": etag, "cs": checksum, "size": size}
        with self._lock:
            self._append(rec)
            self._apply(rec)

    def done(self, key: str, entry: Entry) -> None:
        rec = {"op": "done", "k": key, "e": entry.pack()}
        with self._lock:
            self._append(rec)
            self._apply(rec)
            self._unsynced = True

    def forget(self, key: str) -> None:
        with self._lock:
            if key in self.files or key in self.inflight:
                rec = {"op": "forget", "k": key}
                self._append(rec)
                self._apply(rec)

    def checked(self, versions: dict[str, str], at: float) -> None:
        """The target's copies of these files (key -> the sha256 of the version checked) matched by
        content at `at`. A key sent again since (another sha256) is left as it is: its new version
        was not the one checked."""
        with self._lock:
            ks = {k: sha for k, sha in versions.items() if (e := self.files.get(k)) is not None and e.sha256 == sha}
            if ks:
                rec = {"op": "checked", "ks": ks, "t": at}
                self._append(rec)
                self._apply(rec)
                self._unsynced = True

    def manifest_done(self, unit_key: str, digest: str, at: float, commit: str = "") -> None:
        """The unit's manifest is on the target; `commit`: the commit that holds it (the Hub)."""
        rec = {"op": "man", "u": unit_key, "d": digest, "at": at}
        if commit:
            rec["c"] = commit
        with self._lock:
            self._append(rec)
            self._apply(rec)
            self._unsynced = True

    def manifest_forget(self, unit_key: str) -> None:
        with self._lock:
            if unit_key in self.manifests:
                rec = {"op": "unman", "u": unit_key}
                self._append(rec)
                self._apply(rec)

    def sync(self) -> None:
        """fsync what was appended (done records are coalesced; a crash before this only costs
        a re-check or re-send)."""
        with self._lock:
            if self._fd is not None and self._unsynced:
                try:
                    os.fsync(self._fd)
                except OSError as e:
                    log.warning("ledger_fsync_failed", error=str(e))
                self._unsynced = False
            if self._lines > max(self._compact_at, 4 * (len(self.files) + len(self.inflight))):
                try:
                    self.compact()
                    self._compact_at = COMPACT_MIN_LINES
                except OSError as e:  # the journal still holds everything; try again much later
                    self._compact_at = self._lines * 2
                    log.warning("ledger_compact_failed", error=str(e), path=str(self.dir))

    def close(self) -> None:
        with self._lock:
            self.sync()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    # --- persistence ---------------------------------------------------------------------------
    def _apply(self, rec: dict) -> None:
        op = rec.get("op")
        if op == "begin":
            self.inflight[rec["k"]] = {"size": int(rec["size"]), "mtime_ns": int(rec["mtime_ns"]),
                                       "info": dict(rec.get("i") or {}), "parts": {}}
        elif op == "part":
            f = self.inflight.get(rec["k"])
            if f is not None:
                f["parts"][str(int(rec["n"]))] = [rec["etag"], rec["cs"], int(rec["size"])]
        elif op == "done":
            e = Entry.unpack(rec["e"])
            old = self.files.get(rec["k"])
            self.files[rec["k"]] = e
            if old is not None:
                self._bytes -= old.size
                self._unindex(rec["k"], old)
            self._bytes += e.size
            self.inflight.pop(rec["k"], None)
            if self._content is not None and e.sha256:
                self._content[(e.sha256, e.size)] = rec["k"]
        elif op == "forget":
            old = self.files.pop(rec["k"], None)
            if old is not None:
                self._bytes -= old.size
                self._unindex(rec["k"], old)
            self.inflight.pop(rec["k"], None)
        elif op == "man":
            m = {"digest": rec["d"], "at": float(rec.get("at", 0))}
            if rec.get("c"):
                m["commit"] = str(rec["c"])
            self.manifests[rec["u"]] = m
        elif op == "unman":
            self.manifests.pop(rec["u"], None)
        elif op == "checked":
            t = float(rec["t"])
            for k, sha in dict(rec["ks"]).items():
                e = self.files.get(k)
                if e is not None and e.sha256 == sha:
                    self.files[k] = dataclasses.replace(e, checked=t)
        elif op == "gen":
            pass
        else:
            raise ValueError(f"unknown ledger op {op!r}")

    def _unindex(self, key: str, old: Entry) -> None:
        """`key` no longer holds old's content (forgotten, or replaced by another version): when it
        was that content's holder in the twin index, another holder takes its place, if any (rare:
        keep_last deletes the oldest, and the index names the newest)."""
        ck = (old.sha256, old.size)
        if self._content is None or self._content.get(ck) != key:
            return
        other = next((k for k, e in self.files.items() if k != key and (e.sha256, e.size) == ck), None)
        if other is None:
            del self._content[ck]
        else:
            self._content[ck] = other

    def _append(self, rec: dict) -> None:
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        try:
            try:
                self._write_line(line)
            except OSError as e:
                if e.errno not in FULL or not release_reserve(self.dir):
                    raise
                self._write_line(line)
        except OSError as e:
            raise LedgerWriteError(f"cannot record in the sync ledger {self.journal_path}: "
                                   f"{e.strerror or e}") from e
        self._lines += 1

    def _write_line(self, line: bytes) -> None:
        if self._fd is None:
            self._open()
        assert self._fd is not None
        try:
            write_all(self._fd, b"\n" + line if self._torn else line)
        except OSError:
            self._torn = True
            raise
        self._torn = False

    def _open(self) -> None:
        new = not self.journal_path.exists() or self.journal_path.stat().st_size == 0
        fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if new:
                write_all(fd, (json.dumps({"op": "gen", "gen": self.gen, "target": self.target_id}) + "\n").encode())
            else:
                with open(self.journal_path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        write_all(fd, b"\n")  # a torn last line must not swallow the next record
        except OSError:
            os.close(fd)  # opened again (and the header or newline written) on the next append
            raise
        self._fd = fd

    def _load(self) -> None:
        snap_gen = -1
        try:
            raw = self.snapshot_path.read_bytes()
        except FileNotFoundError:
            raw = None
        if raw is not None:
            try:
                data = json.loads(raw)
                snap_gen = int(data["gen"])
                files = {k: Entry.unpack(v) for k, v in data["files"].items()}
                self.files = files
                self.inflight = dict(data.get("inflight") or {})
                self.manifests = dict(data.get("manifests") or {})
                self.gen = snap_gen
            except (ValueError, KeyError, TypeError, IndexError) as e:
                aside = set_aside(self.snapshot_path)
                log.error("ledger_snapshot_corrupt", path=str(self.snapshot_path), error=str(e),
                          set_aside=aside.name)
                self.files, self.inflight, self.manifests = {}, {}, {}
                snap_gen = -1
        self._bytes = sum(e.size for e in self.files.values())
        try:
            fh = open(self.journal_path, "rb")
        except FileNotFoundError:
            return
        with fh:
            first = True
            replay = True
            for raw_line in fh:
                self._lines += 1
                try:
                    rec = json.loads(raw_line)
                    if not isinstance(rec, dict):
                        raise ValueError("not an object")
                except ValueError:
                    if raw_line.strip():
                        self.skipped_lines += 1
                    continue
                if first:
                    first = False
                    if rec.get("op") == "gen":
                        jgen = int(rec.get("gen", 0))
                        if jgen < snap_gen:
                            replay = False  # compaction crashed after writing the snapshot
                        self.gen = max(self.gen, jgen)
                        continue
                if not replay:
                    continue
                try:
                    self._apply(rec)
                except (KeyError, ValueError, TypeError, IndexError):
                    self.skipped_lines += 1
        if self.skipped_lines:
            log.warning("ledger_lines_skipped", count=self.skipped_lines, path=str(self.journal_path))

    def compact(self) -> None:
        with self._lock:
            self.gen += 1
            data = {"gen": self.gen, "target": self.target_id,
                    "files": {k: e.pack() for k, e in self.files.items()},
                    "inflight": self.inflight, "manifests": self.manifests}
            atomic_write(self.snapshot_path, json.dumps(data, separators=(",", ":")).encode())
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            header = (json.dumps({"op": "gen", "gen": self.gen, "target": self.target_id}) + "\n").encode()
            try:
                atomic_write(self.journal_path, header)
            except OSError:
                # no room for a second copy: the snapshot holds everything, so empty the journal in
                # place (that frees its space); appending to the old one would be ignored on load
                fd = os.open(self.journal_path, os.O_WRONLY | os.O_TRUNC | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    write_all(fd, header)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._lines = 1
            self._torn = False
            self._open()
