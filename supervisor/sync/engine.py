"""The sync engine: finds complete checkpoints and adapters under the watched folders and gets
them onto the target, verified, with a manifest written last.

Threads (managed here; the daemon needs no heartbeat from outside):
- `sync-worker`: the only thread that scans, decides and talks to the target. It wakes on
  inotify hints, on requests, at the periodic rescan, when a waiting unit may have gone quiet,
  and when a retry is due (at least every 0.5 s, so an injected FakeClock is noticed).
- the watchdog observer thread (hints only) and the target's own request pool.
Public methods only set flags, queue a request or copy a snapshot under a short lock: nothing a
control-socket handler calls ever waits on the network, except wait_idle/final_sync, which exist
to wait (the daemon calls them from a worker thread).

Decisions are pure (policy.py, complete.py); persisted truth is the ledger; this module is the
shell that moves data between them.
"""

from __future__ import annotations

import os
import random
import re
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import SyncConfig
from ..durations import format_bytes, format_duration
from ..interfaces import FinalSyncResult
from . import manifest as mf
from ._log import get_logger
from .complete import (
    MAX_JSON_CHECK,
    ZIP_LOCAL_MAGIC,
    ZIP_TAIL,
    FileObs,
    Verdict,
    checkable,
    json_whole,
    judge,
    safetensors_header_len,
    safetensors_whole,
    zip_whole,
)
from .ledger import Entry, Ledger, LedgerBusy
from .policy import ADAPTER_MARKER, MANIFEST_NAME, Policy, hf_cache_roots, is_cache_dir
from .targets import make_target, target_identity
from .targets.base import LocalFile, SourceProblem, Target, TargetError, Uploaded, join_key
from .url import parse_target

if TYPE_CHECKING:
    from ..context import Context

log = get_logger("sync")

ALERT_KEY = "sync:failing"
LOOP_MAX_WAIT = 0.5      # real seconds: the longest the worker sleeps without looking at the clock
DEBOUNCE_S = 1.0         # real seconds between an inotify hint and the rescan it causes
BACKOFF_BASE = 2.0
VERIFY_ROUNDS = 3        # final sync: re-upload what the target lost at most this often
CHECKPOINT_NUM = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class Root:
    path: str     # absolute, normalised
    prefix: str   # key prefix on the target ("" when there is one watched folder)


@dataclass
class _Seen:
    size: int
    mtime_ns: int
    stable_since: float | None
    whole: bool | None = None
    whole_for: tuple[int, int] | None = None


@dataclass
class _Sel:
    path: str
    key: str
    rel: str      # inside the unit
    size: int
    mtime_ns: int
    rrel: str     # relative to the root


@dataclass
class Unit:
    root: Root
    kind: str            # "dir" | "file"
    rel: str             # relative to the root ("" = the root itself, for an adapter saved there)
    key: str
    files: list[FileObs] = field(default_factory=list)
    selected: list[_Sel] = field(default_factory=list)
    verdict: Verdict = Verdict(False, "not judged")
    forced: bool = False
    retired: bool = False   # older than the keep_last newest checkpoints: not uploaded any more

    @property
    def abspath(self) -> str:
        return os.path.join(self.root.path, self.rel) if self.rel else self.root.path

    @property
    def label(self) -> str:
        return self.key or self.root.path


@dataclass
class _Final:
    paths: list[str]
    deadline: float                 # time.monotonic()
    started_ok: int                 # uploaded count when it began
    event: threading.Event = field(default_factory=threading.Event)
    result: FinalSyncResult | None = None
    verify_rounds: int = 0


@dataclass
class _IdleWaiter:
    after_pass: int
    started_ok: int
    event: threading.Event = field(default_factory=threading.Event)
    result: FinalSyncResult | None = None


class SyncEngine:
    """Implements interfaces.SyncView. Construct with the daemon's Context; `start()` once."""

    def __init__(self, ctx: Context, target: Target | None = None):
        self.ctx = ctx
        self.cfg: SyncConfig = ctx.config.sync
        self.clock = ctx.clock
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.enabled = bool(self.cfg.target.strip())
        self.url = parse_target(self.cfg.target) if self.enabled else None
        self.display = self.url.display() if self.url else ""
        self.roots = self._roots(self.cfg.watch)
        self._extra_roots: list[Root] = []
        env_sources = [dict(os.environ), dict(ctx.config.training.env or {})]
        self.policy = Policy(list(self.cfg.include), list(self.cfg.exclude),
                             hf_cache_roots(env_sources, [r.path for r in self.roots]))
        self.target: Target | None = target
        self.ledger: Ledger | None = None
        self.hostname = ctx.config.hostname or socket.gethostname()
        # observations and the last scan's units
        self._seen: dict[tuple[str, str], _Seen] = {}
        self._scanned_roots: set[str] = set()
        self._units: dict[tuple[str, str, str], Unit] = {}
        # scheduling (clock.monotonic unless noted)
        self._dirty = True
        self._dirty_at = 0.0          # time.monotonic()
        self._requested = True
        self._next_rescan = 0.0
        self._next_ready: float | None = None
        self._next_try = 0.0
        self._failures = 0
        self._failing_since: float | None = None
        self._alerted = False
        self._pass = 0
        self._finals: list[_Final] = []
        self._idle_waiters: list[_IdleWaiter] = []
        # status
        self._state = "idle" if self.enabled else "disabled"
        self._last_ok_at: float | None = None
        self._last_error = ""
        self._last_error_at: float | None = None
        self._current = ""
        self._pending_files = 0
        self._pending_bytes = 0
        self._waiting: list[tuple[str, str]] = []
        self._partial: list[str] = []
        self._uploaded_session = 0
        self._sent = 0
        self._rate_samples: deque[tuple[float, int]] = deque(maxlen=64)
        self._problems_logged: set[str] = set()
        self._watcher = None
        self.stats = {"scans": 0, "files_uploaded": 0, "bytes_uploaded": 0, "header_reads": 0}
        if self.enabled:
            assert self.url is not None
            if self.target is None:
                self.target = make_target(self.url, self.cfg, ctx.config.state_dir)
            self._open_ledger()

    # --- setup ------------------------------------------------------------------------------------
    def _open_ledger(self) -> bool:
        assert self.url is not None
        try:
            self.ledger = Ledger(self.ctx.config.state_dir, target_identity(self.url, self.cfg))
        except LedgerBusy as e:
            self._log_once("ledger-busy", "sync_ledger_busy", error=str(e))
            self._note_error(str(e))
            return False
        except OSError as e:
            self._log_once("ledger-error", "sync_ledger_unusable", error=str(e))
            self._note_error(f"cannot open the sync ledger in {self.ctx.config.state_dir}: {e}")
            return False
        return True

    @staticmethod
    def _roots(watch: list[str]) -> list[Root]:
        paths = [os.path.normpath(p) for p in watch if p]
        if len(paths) == 1:
            return [Root(paths[0], "")]
        out, used = [], set()
        for p in paths:
            name = os.path.basename(p) or "root"
            if name in used:
                import hashlib

                name = f"{name}-{hashlib.sha1(p.encode()).hexdigest()[:6]}"
            used.add(name)
            out.append(Root(p, name))
        return out

    def all_roots(self) -> list[Root]:
        with self._lock:
            return list(self.roots) + list(self._extra_roots)

    def start(self, watch: bool = True) -> None:
        """Start the worker; `watch=False` (a one-shot run) skips inotify and the start log."""
        if not self.enabled or self._thread is not None:
            return
        if watch:
            from .watch import FolderWatcher

            self._watcher = FolderWatcher(self._on_fs_event)
        self._thread = threading.Thread(target=self._run, name="sync-worker", daemon=True)
        self._thread.start()
        if watch:
            log.info("sync_started", target=self.display, watch=[r.path for r in self.roots])

    def close(self, timeout: float = 10.0) -> None:
        self._closing.set()
        self._wake.set()
        t = self._thread
        if t is not None:
            t.join(timeout)
        if self._watcher is not None:
            self._watcher.close()
        if self.target is not None:
            try:
                self.target.close()
            except Exception:  # noqa: BLE001 - closing must not raise
                pass
        if self.ledger is not None and (t is None or not t.is_alive()):
            self.ledger.close()
        with self._lock:
            for w in self._idle_waiters:
                w.result = w.result or self._result(False, 0, error="sync engine stopped")
                w.event.set()
            for j in self._finals:
                j.result = j.result or self._result(False, 0, error="sync engine stopped")
                j.event.set()

    # --- the SyncView API -------------------------------------------------------------------------
    def request_sync(self) -> None:
        with self._lock:
            self._requested = True
            self._next_try = 0.0  # the user asked: retry now, whatever the backoff said
        self._wake.set()

    def tick(self) -> None:
        """Not needed (the engine runs its own worker); kept so a scheduler may poke it."""
        self._wake.set()

    def wait_idle(self, timeout_s: float) -> FinalSyncResult:
        """Block until a full pass that started after this call has uploaded and verified every
        unit that was complete; ok=False with the error when that pass failed, or on timeout."""
        if not self.enabled:
            return FinalSyncResult(ok=True, target="")
        if self._thread is None:
            return self._result(False, 0, error="sync engine not started")
        with self._lock:
            w = _IdleWaiter(after_pass=self._pass + 1, started_ok=self._uploaded_session)
            self._idle_waiters.append(w)
        self.request_sync()
        if not self._wait(w.event, max(0.0, timeout_s)):
            with self._lock:
                if w in self._idle_waiters:
                    self._idle_waiters.remove(w)
                return w.result or self._result(False, w.started_ok,
                                                error=f"timed out after {format_duration(timeout_s)}"
                                                      f"{': ' + self._last_error if self._last_error else ''}",
                                                unsynced=self._unsynced_list(None))
        assert w.result is not None
        return w.result

    def final_sync(self, paths: list[str], timeout_s: float) -> FinalSyncResult:
        """Upload everything the policy selects under `paths`, regardless of the quiet period,
        then check on the target itself that it holds all of it. Retries with backoff until
        timeout_s. Never returns ok=True unless the target was seen to hold every file."""
        if not self.enabled:
            return FinalSyncResult(ok=True, target="")
        if self._thread is None:
            return self._result(False, 0, error="sync engine not started")
        norm = [os.path.normpath(p) for p in paths if p]
        with self._lock:
            for p in norm:
                if not any(_within(p, r.path) for r in self.roots + self._extra_roots):
                    name = os.path.basename(p) or "root"
                    self._extra_roots.append(Root(p, name if (self.roots or self._extra_roots) else ""))
            job = _Final(paths=norm, deadline=time.monotonic() + max(0.0, timeout_s),
                         started_ok=self._uploaded_session)
            self._finals.append(job)
        self.request_sync()
        if not self._wait(job.event, max(0.0, timeout_s) + 5.0):
            with self._lock:
                if job in self._finals:
                    self._finals.remove(job)
                return job.result or self._result(False, job.started_ok, error="final sync timed out",
                                                  unsynced=self._unsynced_list(norm))
        assert job.result is not None
        return job.result

    def _wait(self, event: threading.Event, timeout: float) -> bool:
        """event.wait(timeout), but give up at once if the worker thread is gone."""
        deadline = time.monotonic() + timeout
        while not event.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._thread is None or not self._thread.is_alive():
                with self._lock:
                    self._last_error = self._last_error or "sync worker stopped"
                return event.is_set()
            event.wait(min(left, 1.0))
        return True

    def status(self) -> dict:
        with self._lock:
            files, nbytes = self.ledger.totals() if self.ledger else (0, 0)
            now = self.clock.monotonic()
            return {
                "target": self.display,
                "state": self._state,
                "last_ok_at": self._last_ok_at,
                "last_error": self._last_error,
                "last_error_at": self._last_error_at,
                "pending_bytes": self._pending_bytes,
                "pending_files": self._pending_files,
                "uploaded_files": files,
                "uploaded_bytes": nbytes,
                "current_file": self._current,
                "rate_bps": self._rate(),
                "failing_for_s": (now - self._failing_since) if self._failing_since is not None else None,
                "next_retry_in_s": max(0.0, self._next_try - now) if self._failing_since is not None else None,
                "waiting": [{"unit": u, "reason": r} for u, r in self._waiting[:20]],
                "partial": list(self._partial[:20]),
                "sent_bytes": self._sent,
                "watch": [r.path for r in self.roots],
            }

    def render_lines(self) -> list[str]:
        st = self.status()
        if st["state"] == "disabled":
            return ["sync      disabled (no sync.target configured)"]
        head = f"sync      {st['target']}  {st['state']}"
        if st["current_file"] and st["state"] == "uploading":
            head += f"  {st['current_file']}"
            if st["rate_bps"]:
                head += f" at {format_bytes(st['rate_bps'])}/s"
        lines = [head]
        ok = "never" if not st["last_ok_at"] else f"{format_duration(self.clock.time() - st['last_ok_at'])} ago"
        lines.append(f"          pending {st['pending_files']} files ({format_bytes(st['pending_bytes'])})  "
                     f"uploaded {st['uploaded_files']} files ({format_bytes(st['uploaded_bytes'])})  last ok {ok}")
        for w in st["waiting"][:3]:
            lines.append(f"          waiting {w['unit']}: {w['reason']}")
        for p in st["partial"][:3]:
            lines.append(f"          partial {p}")
        if st["last_error"] and st["state"] == "failing":
            retry = f", retry in {format_duration(st['next_retry_in_s'])}" if st["next_retry_in_s"] is not None else ""
            lines.append(f"          FAILING for {format_duration(st['failing_for_s'])}{retry}: {st['last_error']}")
        elif st["last_error"]:
            lines.append(f"          last error: {st['last_error']}")
        return lines

    # --- worker loop ------------------------------------------------------------------------------
    def _on_fs_event(self, path: str) -> None:
        parts = path.split("/")
        if any(is_cache_dir(p) for p in parts[:-1]) or any(_within(path, r) for r in self.policy.excluded_roots):
            return  # a model download in the HF cache must not cause a rescan per write
        with self._lock:
            if not self._dirty:
                self._dirty_at = time.monotonic()
            self._dirty = True
        self._wake.set()

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                self._iteration()
            except Exception as e:  # noqa: BLE001 - the worker must outlive any bug or odd file
                self._note_error(f"internal error: {type(e).__name__}: {e}")
                try:
                    log.exception("sync_iteration_failed")
                except Exception:  # noqa: BLE001 - not even a broken logger may end the worker
                    pass
                self._closing.wait(1.0)
            self._wake.wait(LOOP_MAX_WAIT)
            self._wake.clear()
        if self.ledger is not None:
            self.ledger.close()

    def _iteration(self) -> None:
        if self.ledger is None:
            if not self._open_ledger():
                self._closing.wait(2.0)
                return
            self._note_error("")
        assert self.ledger is not None and self.target is not None
        now = self.clock.monotonic()
        with self._lock:
            finals = list(self._finals)
            due = (self._requested or bool(finals) or now >= self._next_rescan
                   or (self._dirty and time.monotonic() - self._dirty_at >= DEBOUNCE_S)
                   or (self._next_ready is not None and now >= self._next_ready)
                   or (self._failing_since is not None and now >= self._next_try))
            in_backoff = self._failing_since is not None and now < self._next_try
        self._expire_finals()
        self._evaluate_alert()
        if not due:
            self.ledger.sync()
            return
        if in_backoff:
            # a rescan during backoff still refreshes pending counts, but sends nothing
            self._do_scan()
            return
        pass_id = self._do_scan()
        error = self._process_work()
        self.ledger.sync()
        if error is None:
            self._verify_finals()
        self._complete_waiters(error=error, pass_id=pass_id)
        self._evaluate_alert()

    def _do_scan(self) -> int:
        with self._lock:
            self._requested = False
            self._dirty = False
            self._pass += 1
            pass_id = self._pass
            forced = [p for j in self._finals for p in j.paths]
            self._set_state("scanning")
        roots = self.all_roots()
        if self._watcher is not None:
            self._watcher.forget_missing()
            self._watcher.ensure([r.path for r in roots])
        units = self._scan(roots, forced)
        now = self.clock.monotonic()
        with self._lock:
            self._units = units
            self._next_rescan = now + self.cfg.rescan_interval
            ready = [u.verdict.ready_in for u in units.values() if not u.verdict.complete
                     and u.verdict.ready_in is not None]
            self._next_ready = now + min(ready) + 0.05 if ready else None
            self._refresh_pending()
            self._set_state("idle")
        self.stats["scans"] += 1
        return pass_id

    # --- scanning ---------------------------------------------------------------------------------
    def _scan(self, roots: list[Root], forced: list[str]) -> dict[tuple[str, str, str], Unit]:
        wall, mono = self.clock.time(), self.clock.monotonic()
        units: dict[tuple[str, str, str], Unit] = {}
        alive: set[tuple[str, str]] = set()
        for root in roots:
            first = root.path not in self._scanned_roots
            raw = self._walk(root)
            self._scanned_roots.add(root.path)
            adapter_dirs = {rel.rsplit("/", 1)[0] if "/" in rel else "" for rel in raw
                            if rel.rsplit("/", 1)[-1] == ADAPTER_MARKER and self.policy.selects(rel)}
            for rel, (size, mtime_ns) in raw.items():
                sk = (root.path, rel)
                alive.add(sk)
                seen = self._seen.get(sk)
                if seen is None:
                    settled = first and wall - mtime_ns / 1e9 >= self.cfg.quiet_period
                    seen = _Seen(size, mtime_ns, None if settled else mono)
                    self._seen[sk] = seen
                elif (seen.size, seen.mtime_ns) != (size, mtime_ns):
                    seen.size, seen.mtime_ns, seen.stable_since = size, mtime_ns, mono
                parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
                # an adapter folder goes up whole (README, tokenizer); the watched folder itself
                # only with what the globs select, or a growing train.log would hold it back
                in_adapter = bool(parent) and parent in adapter_dirs
                selected = self.policy.selects(rel) or (in_adapter and self.policy.allowed(rel))
                if selected:
                    kind, urel = self.policy.unit_of(rel, adapter_dirs)
                else:
                    kind, urel = "dir", self.policy.folder_unit(rel)
                    if urel is None:
                        if not in_adapter:
                            continue
                        urel = parent
                uk = (root.path, kind, urel)
                u = units.get(uk)
                if u is None:
                    u = Unit(root, kind, urel, join_key(root.prefix, urel))
                    units[uk] = u
                inner = rel if kind == "file" else (rel[len(urel) + 1:] if urel else rel)
                if kind == "file":
                    inner = rel.rsplit("/", 1)[-1]
                u.files.append(FileObs(inner, size, mtime_ns / 1e9, seen.stable_since, seen.whole
                                       if seen.whole_for == (size, mtime_ns) else None))
                if selected:
                    u.selected.append(_Sel(os.path.join(root.path, rel), join_key(root.prefix, rel), inner,
                                           size, mtime_ns, rel))
        for sk in [k for k in self._seen if k not in alive]:
            del self._seen[sk]
        for u in units.values():
            if not u.selected:
                u.verdict = Verdict(False, "nothing selected")
                continue
            u.forced = any(_within(u.abspath, p) or _within(p, u.abspath) for p in forced)
            name = u.rel or u.root.path
            marker = self.cfg.complete_marker
            u.verdict = judge(name, u.kind, u.files, wall, mono, self.cfg.quiet_period, u.forced, marker)
            if (u.verdict.complete or u.forced) and self._check_whole(u):
                u.verdict = judge(name, u.kind, u.files, wall, mono, self.cfg.quiet_period, u.forced, marker)
        if self.cfg.keep_last > 0:
            self._retire(roots, units)
        return units

    def _retire(self, roots: list[Root], units: dict[tuple[str, str, str], Unit]) -> None:
        """keep_last: checkpoints older than the newest N (here or on the target) are not sent,
        or keep_last would delete them again after every upload."""
        assert self.ledger is not None
        for root in roots:
            local: dict[int, Unit] = {}
            for u in units.values():
                m = CHECKPOINT_NUM.match(u.rel) if u.root == root and u.kind == "dir" else None
                if m:
                    local[int(m.group(1))] = u
            steps = set(local)
            for unit_key in self.ledger.manifests_under(root.prefix):
                m = CHECKPOINT_NUM.match(unit_key[len(root.prefix) + 1:] if root.prefix else unit_key)
                if m:
                    steps.add(int(m.group(1)))
            keep = set(sorted(steps)[-self.cfg.keep_last:])
            for n, u in local.items():
                if n not in keep:
                    u.retired = True
                    u.verdict = Verdict(False, f"older than the newest {self.cfg.keep_last} (keep_last)")

    def _walk(self, root: Root) -> dict[str, tuple[int, int]]:
        """rel -> (size, mtime_ns) for regular files; symlinks are never followed, caches and
        folders no glob can reach are never entered."""
        out: dict[str, tuple[int, int]] = {}
        if not os.path.isdir(root.path):
            if os.path.isfile(root.path) and not os.path.islink(root.path):
                st = os.stat(root.path)
                out[os.path.basename(root.path)] = (st.st_size, st.st_mtime_ns)
            return out
        if any(_within(root.path, r) for r in self.policy.excluded_roots):
            self._log_once(f"root-in-cache:{root.path}", "sync_watch_folder_is_a_cache", folder=root.path)
            return out
        stack = [""]
        while stack:
            reldir = stack.pop()
            absdir = os.path.join(root.path, reldir) if reldir else root.path
            try:
                with os.scandir(absdir) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue
            except OSError as e:
                self._log_once(f"scandir:{absdir}:{e.errno}", "sync_folder_unreadable", folder=absdir,
                               error=e.strerror or str(e))
                continue
            for e in entries:
                rel = f"{reldir}/{e.name}" if reldir else e.name
                try:
                    if e.is_symlink():
                        continue
                    if e.is_dir(follow_symlinks=False):
                        if self.policy.enter_dir(rel, e.path):
                            stack.append(rel)
                        continue
                    if not e.is_file(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as err:
                    self._log_once(f"stat:{e.path}", "sync_file_unreadable", path=e.path,
                                   error=err.strerror or str(err))
                    continue
                out[rel] = (st.st_size, st.st_mtime_ns)
        return out

    def _check_whole(self, u: Unit) -> bool:
        """Run format checks the unit's files still need; True when any result changed."""
        changed = False
        new_files = []
        for fo, sel in _pair(u):
            if sel is None or checkable(sel.rel) is None:
                new_files.append(fo)
                continue
            seen = self._seen.get((u.root.path, sel.rrel))
            if seen is None:
                new_files.append(fo)
                continue
            if seen.whole_for != (sel.size, sel.mtime_ns):
                seen.whole = _whole(sel.path, checkable(sel.rel), sel.size)
                seen.whole_for = (sel.size, sel.mtime_ns)
                self.stats["header_reads"] += 1
                changed = True
            new_files.append(FileObs(fo.rel, fo.size, fo.mtime, fo.stable_since, seen.whole))
        u.files = new_files
        return changed or any(f.whole is False for f in new_files)

    # --- uploading --------------------------------------------------------------------------------
    def _work(self) -> list[Unit]:
        with self._lock:
            units = list(self._units.values())
        out = []
        for u in units:
            if not u.selected:
                continue
            if u.verdict.complete or u.verdict.partial:
                if not self._unit_synced(u):
                    out.append(u)
        # oldest first: the checkpoint at risk longest goes first
        out.sort(key=lambda u: max((s.mtime_ns for s in u.selected), default=0))
        return out

    def _unit_synced(self, u: Unit) -> bool:
        assert self.ledger is not None
        skip = set(u.verdict.skip)
        for s in u.selected:
            if s.rel in skip:
                continue
            if self.ledger.current(s.key, s.size, s.mtime_ns) is None:
                return False
        if u.kind == "dir" and u.verdict.complete:
            m = self.ledger.manifest(u.key)
            return m is not None and m.get("digest") == self._digest(u)
        return True

    def _digest(self, u: Unit) -> str | None:
        assert self.ledger is not None
        files = []
        for s in u.selected:
            e = self.ledger.current(s.key, s.size, s.mtime_ns)
            if e is None:
                return None
            files.append(mf.ManifestFile(s.rel, s.size, e.sha256))
        return mf.digest(files)

    def _process_work(self) -> str | None:
        """Upload every unit that is ready. Returns the error that stopped the pass, or None."""
        work = self._work()
        if not work:
            with self._lock:
                if self._failing_since is not None:
                    self._recovered(contacted=False)  # nothing left that could fail
            return None
        for batch in _batches(work):
            if self._closing.is_set():
                return "closing"
            try:
                if len(batch) == 1:
                    self._upload_unit(batch[0])
                else:
                    self._upload_files(batch)
            except TargetError as e:
                self._failed(str(e))
                return str(e)
            with self._lock:
                self._recovered()
        with self._lock:
            self._current = ""
            self._set_state("idle")
            self._refresh_pending()
        return None

    def _upload_unit(self, u: Unit) -> None:
        assert self.ledger is not None and self.target is not None
        skip = set(u.verdict.skip)
        todo = [s for s in u.selected if s.rel not in skip and self.ledger.current(s.key, s.size, s.mtime_ns) is None]
        with self._lock:
            self._set_state("uploading")
        if u.kind == "dir" and self.ledger.manifest(u.key) is not None and todo:
            # the folder changed since its manifest: it is not complete on the target until the
            # new files and a new manifest are there
            self.target.delete_manifest(u.key)
            self.ledger.manifest_forget(u.key)
        sink = _Sink(self, u)
        if todo:
            log.info("sync_unit_upload", unit=u.label, files=len(todo), bytes=sum(s.size for s in todo),
                     forced=u.forced, partial=u.verdict.partial)
            self.target.put_files([LocalFile(s.path, s.key, s.size, s.mtime_ns) for s in todo], sink)
        if sink.problems:
            with self._lock:
                self._dirty = True
                self._dirty_at = time.monotonic()
            if not os.path.exists(u.abspath):
                log.info("sync_unit_vanished", unit=u.label, note="rotated away locally before it was whole "
                         "on the target; no manifest written")
            return
        if u.verdict.partial:
            with self._lock:
                if u.label not in self._partial:
                    self._partial.append(u.label)
            log.warning("sync_unit_partial", unit=u.label, reason=u.verdict.reason,
                        note="uploaded without a manifest")
            return
        if u.kind != "dir":
            return
        files = []
        for s in u.selected:
            e = self.ledger.current(s.key, s.size, s.mtime_ns)
            if e is None:
                return
            files.append(mf.ManifestFile(s.rel, s.size, e.sha256))
        d = mf.digest(files)
        m = self.ledger.manifest(u.key)
        if m is None or m.get("digest") != d:
            data = mf.build(u.rel or os.path.basename(u.root.path), files, self.clock.time(), self.hostname,
                            source=u.abspath)
            self.target.write_manifest(u.key, data)
            self.ledger.manifest_done(u.key, d, self.clock.time())
            self.ledger.sync()
            log.info("sync_unit_complete", unit=u.label, files=len(files), bytes=sum(f.size for f in files))
            self._enforce_keep_last(u)

    def _upload_files(self, units: list[Unit]) -> None:
        """Single-file units of one root in one batch (one rsync run, one pool of puts)."""
        assert self.ledger is not None and self.target is not None
        todo = [s for u in units for s in u.selected if self.ledger.current(s.key, s.size, s.mtime_ns) is None]
        if not todo:
            return
        with self._lock:
            self._set_state("uploading")
        log.info("sync_files_upload", files=len(todo), bytes=sum(s.size for s in todo), root=units[0].root.path)
        sink = _Sink(self, units[0])
        self.target.put_files([LocalFile(s.path, s.key, s.size, s.mtime_ns) for s in todo], sink)
        if sink.problems:
            with self._lock:
                self._dirty = True
                self._dirty_at = time.monotonic()

    def _enforce_keep_last(self, u: Unit) -> None:
        """keep_last = N: keep the N newest checkpoint-* folders on the target (only ones we
        uploaded), as save_total_limit does locally. Off (0) by default: nothing is deleted."""
        assert self.ledger is not None and self.target is not None
        n = self.cfg.keep_last
        if n <= 0 or u.kind != "dir" or not CHECKPOINT_NUM.match(u.rel):
            return
        prefix = u.root.prefix
        mine = []
        for unit_key in self.ledger.manifests_under(prefix):
            rel = unit_key[len(prefix) + 1:] if prefix else unit_key
            m = CHECKPOINT_NUM.match(rel)
            if m:
                mine.append((int(m.group(1)), unit_key))
        mine.sort()
        for _, unit_key in mine[:-n]:
            if unit_key == u.key:
                continue
            log.info("sync_keep_last_delete", unit=unit_key, keep_last=n)
            self.target.delete_prefix(unit_key)
            self.ledger.manifest_forget(unit_key)
            for k in self.ledger.keys_under(unit_key):
                self.ledger.forget(k)

    # --- failure and recovery ---------------------------------------------------------------------
    def _failed(self, error: str) -> None:
        now = self.clock.monotonic()
        with self._lock:
            self._failures += 1
            if self._failing_since is None:
                self._failing_since = now
            back = min(self.cfg.retry_max_backoff, BACKOFF_BASE * 2 ** min(self._failures - 1, 20))
            self._next_try = now + back * random.uniform(0.5, 1.0)
            self._current = ""
            self._set_state("failing")
            self._refresh_pending()
        self._note_error(error)
        log.warning("sync_failed", target=self.display, error=error, failures=self._failures,
                    retry_in_s=round(self._next_try - now, 1))

    def _recovered(self, contacted: bool = True) -> None:
        if self._failing_since is not None:
            log.info("sync_recovered", target=self.display,
                     after_s=round(self.clock.monotonic() - self._failing_since, 1))
        self._failures = 0
        self._failing_since = None
        if contacted:
            self._last_ok_at = self.clock.time()
        if self._state == "failing":
            self._set_state("idle")
        if self._alerted:
            self._alerted = False
            try:
                self.ctx.alerts.resolve(ALERT_KEY)
            except Exception:  # noqa: BLE001 - alerting must never stop the sync
                log.exception("sync_alert_resolve_failed")

    def _evaluate_alert(self) -> None:
        with self._lock:
            since = self._failing_since
            if since is None:
                return
            failing_for = self.clock.monotonic() - since
            if failing_for < self.cfg.fail_alert_after:
                return
            pending = f"{self._pending_files} files ({format_bytes(self._pending_bytes)})"
            err = self._last_error
            self._alerted = True
        subject = f"sync failing: {self.display} for {format_duration(failing_for)}"
        body = (f"Uploads to {self.display} have been failing for {format_duration(failing_for)}.\n"
                f"Last error: {err}\nNot yet on the target: {pending}.\n\n"
                "Retries continue with backoff; a final sync before any stop will wait for the target.\n"
                "Check with: supervisorctl status; retry now with: supervisorctl sync --wait")
        try:
            self.ctx.alerts.fire(ALERT_KEY, "sync_failing", "warning", subject, body)
        except Exception:  # noqa: BLE001
            log.exception("sync_alert_fire_failed")

    def _note_error(self, error: str) -> None:
        with self._lock:
            self._last_error = error[:500]
            self._last_error_at = self.clock.time()

    # --- waiters ----------------------------------------------------------------------------------
    def _complete_waiters(self, error: str | None, pass_id: int | None = None) -> None:
        with self._lock:
            for w in list(self._idle_waiters):
                if error is not None:
                    if pass_id is None or pass_id >= w.after_pass:
                        w.result = self._result(False, w.started_ok, error=error, unsynced=self._unsynced_list(None))
                elif pass_id is not None and pass_id >= w.after_pass and not self._settling():
                    w.result = self._result(True, w.started_ok, scope=None)
                if w.result is not None:
                    self._idle_waiters.remove(w)
                    w.event.set()

    def _settling(self) -> bool:
        """Is some unit about to become complete by itself (its writer just went quiet, or a
        folder just appeared)? `sync --wait` waits for those; not for ones that need their
        writer to come back (no trainer_state.json, a truncated file)."""
        assert self.ledger is not None
        for u in self._units.values():
            v = u.verdict
            if u.selected and not v.complete and not v.partial and v.ready_in is not None \
                    and not self._unit_synced(u):
                return True
        return False

    def _expire_finals(self) -> None:
        now = time.monotonic()
        with self._lock:
            for j in list(self._finals):
                if now >= j.deadline:
                    self._finals.remove(j)
                    j.result = self._result(False, j.started_ok,
                                            error=f"final sync timed out: {self._last_error or 'not all files on the target yet'}",
                                            unsynced=self._unsynced_list(j.paths))
                    j.event.set()

    def _verify_finals(self) -> None:
        """For each final sync whose folders are fully uploaded, ask the target itself."""
        assert self.ledger is not None and self.target is not None
        with self._lock:
            jobs = list(self._finals)
            units = list(self._units.values())
        for j in jobs:
            scope = [u for u in units if u.selected and not u.retired and any(_within(u.abspath, p) or _within(p, u.abspath)
                                                             for p in j.paths)]
            if any(not (u.verdict.complete or u.verdict.partial) or not self._unit_synced(u) for u in scope):
                continue  # still work to do (or failing); the next pass gets there
            expected: dict[str, tuple[int, str]] = {}
            for u in scope:
                skip = set(u.verdict.skip)
                for s in u.selected:
                    if s.rel in skip:
                        continue
                    e = self.ledger.current(s.key, s.size, s.mtime_ns)
                    if e is not None:
                        expected[s.key] = (s.size, e.etag)
            manifests = {u.key: u for u in scope if u.kind == "dir" and u.verdict.complete}
            try:
                lost = self.target.missing({**expected, **{join_key(k, MANIFEST_NAME): (-1, "") for k in manifests}})
            except TargetError as e:
                self._failed(f"verifying final sync: {e}")
                return
            if lost:
                j.verify_rounds += 1
                log.warning("sync_final_verify_lost", files=lost[:10], count=len(lost), round=j.verify_rounds)
                for k in lost:
                    if k.endswith("/" + MANIFEST_NAME) or k == MANIFEST_NAME:
                        self.ledger.manifest_forget(k[: -len(MANIFEST_NAME)].rstrip("/"))
                    else:
                        self.ledger.forget(k)
                        for uk in manifests:
                            if k.startswith(uk + "/") or not uk:
                                self.ledger.manifest_forget(uk)
                with self._lock:
                    self._requested = True
                    if j.verify_rounds >= VERIFY_ROUNDS:
                        self._finals.remove(j)
                        j.result = self._result(False, j.started_ok,
                                                error=f"target keeps losing files: {', '.join(lost[:5])}",
                                                unsynced=lost)
                        j.event.set()
                continue
            with self._lock:
                if j in self._finals:
                    self._finals.remove(j)
                partial = [f"{u.label} (partial: {u.verdict.reason}; uploaded without manifest)"
                           for u in scope if u.verdict.partial]
                j.result = FinalSyncResult(ok=True, target=self.display, files=len(expected),
                                           bytes=sum(v[0] for v in expected.values()),
                                           uploaded_files=self._uploaded_session - j.started_ok,
                                           unsynced=partial)
                j.event.set()
            log.info("sync_final_verified", paths=j.paths, files=len(expected))

    def _result(self, ok: bool, started_ok: int, error: str = "", unsynced: list[str] | None = None,
                scope: list[str] | None = None) -> FinalSyncResult:
        files, nbytes = self._held(scope)
        return FinalSyncResult(ok=ok, target=self.display, files=files, bytes=nbytes,
                               uploaded_files=self._uploaded_session - started_ok, error=error,
                               unsynced=list(unsynced or []))

    def _held(self, scope: list[str] | None) -> tuple[int, int]:
        if self.ledger is None:
            return 0, 0
        n = b = 0
        for u in self._units.values():
            for s in u.selected:
                if scope is not None and not any(_within(s.path, p) for p in scope):
                    continue
                if self.ledger.current(s.key, s.size, s.mtime_ns) is not None:
                    n += 1
                    b += s.size
        return n, b

    def _unsynced_list(self, scope: list[str] | None) -> list[str]:
        out = []
        if self.ledger is None:
            return out
        for u in self._units.values():
            if u.retired:
                continue
            for s in u.selected:
                if scope is not None and not any(_within(s.path, p) or _within(p, s.path) for p in scope):
                    continue
                if self.ledger.current(s.key, s.size, s.mtime_ns) is None:
                    out.append(s.path)
        return sorted(out)

    # --- status bookkeeping -----------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        if self._failing_since is not None and state in ("idle", "scanning"):
            state = "failing"
        self._state = state

    def _refresh_pending(self) -> None:
        assert self.ledger is not None
        n = b = 0
        waiting = []
        for u in self._units.values():
            if not u.selected or u.retired:
                continue
            missing = [s for s in u.selected if self.ledger.current(s.key, s.size, s.mtime_ns) is None]
            n += len(missing)
            b += sum(s.size for s in missing)
            if missing and not u.verdict.complete and not u.verdict.partial:
                reason = u.verdict.reason
                if reason.startswith("waiting for ") and u.files:
                    idle = self.clock.time() - max(f.mtime for f in u.files)
                    if idle >= max(600.0, 10 * self.cfg.quiet_period):
                        # a writer that never writes the marker would never be synced: say so
                        reason += (f" (quiet for {format_duration(idle)}; if its writer never writes it, "
                                   f"set sync.complete_marker)")
                        self._log_once(f"marker:{u.abspath}", "sync_checkpoint_without_marker", unit=u.label,
                                       marker=self.cfg.complete_marker, quiet_for_s=round(idle))
                waiting.append((u.label, reason))
        self._pending_files, self._pending_bytes = n, b
        self._waiting = sorted(waiting)

    def _rate(self) -> float | None:
        s = self._rate_samples
        if len(s) < 2:
            return None
        now = time.monotonic()
        if now - s[-1][0] > 5.0:
            return 0.0 if self._state == "uploading" else None
        t0, b0 = s[0]
        for t, b in s:
            if now - t <= 10.0:
                t0, b0 = t, b
                break
        dt = s[-1][0] - t0
        return (s[-1][1] - b0) / dt if dt > 0.2 else None

    def _log_once(self, key: str, event: str, **kw) -> None:
        if key in self._problems_logged:
            return
        if len(self._problems_logged) > 10000:
            self._problems_logged.clear()
        self._problems_logged.add(key)
        log.warning(event, **kw)


class _Sink:
    """Where a target reports each file; runs on the target's threads."""

    def __init__(self, engine: SyncEngine, unit: Unit):
        self.e = engine
        self.unit = unit
        self.problems: list[SourceProblem] = []

    def begin(self, f: LocalFile, info: dict) -> None:
        assert self.e.ledger is not None
        self.e.ledger.begin(f.key, f.size, f.mtime_ns, info)
        with self.e._lock:
            self.e._current = f.key

    def part(self, f: LocalFile, n: int, etag: str, checksum: str, size: int) -> None:
        assert self.e.ledger is not None
        self.e.ledger.part(f.key, n, etag, checksum, size)

    def done(self, f: LocalFile, result: Uploaded) -> None:
        assert self.e.ledger is not None
        self.e.ledger.done(f.key, Entry(f.size, f.mtime_ns, result.sha256, result.etag, f.path, self.e.clock.time()))
        with self.e._lock:
            self.e._uploaded_session += 1
            self.e.stats["files_uploaded"] += 1
            self.e.stats["bytes_uploaded"] += result.sent

    def problem(self, f: LocalFile, err: SourceProblem) -> None:
        self.problems.append(err)
        level = "info" if err.kind in ("vanished", "changed") else "warning"
        getattr(log, level)("sync_source_problem", path=f.path, kind=err.kind, detail=str(err))
        if err.kind == "unreadable":
            self.e._note_error(str(err))

    def progress(self, f: LocalFile, nbytes: int) -> None:
        with self.e._lock:
            self.e._sent += nbytes
            self.e._rate_samples.append((time.monotonic(), self.e._sent))

    def in_flight(self, key: str) -> dict | None:
        assert self.e.ledger is not None
        return self.e.ledger.in_flight(key)

    def cancelled(self) -> bool:
        return self.e._closing.is_set()


# --- helpers ---------------------------------------------------------------------------------------

def _within(path: str, folder: str) -> bool:
    p, f = os.path.normpath(path), os.path.normpath(folder)
    return p == f or p.startswith(f.rstrip("/") + "/")


def _batches(work: list[Unit]) -> list[list[Unit]]:
    """Folders one by one (each gets its manifest); the single files of a root together."""
    out: list[list[Unit]] = []
    files: dict[str, list[Unit]] = {}
    for u in work:
        if u.kind == "file":
            files.setdefault(u.root.path, []).append(u)
        else:
            out.append([u])
    for group in files.values():
        for i in range(0, len(group), 500):
            out.append(group[i:i + 500])
    return sorted(out, key=lambda b: min(max((s.mtime_ns for s in u.selected), default=0) for u in b))


def _pair(u: Unit) -> list[tuple[FileObs, _Sel | None]]:
    by_rel = {s.rel: s for s in u.selected}
    return [(fo, by_rel.get(fo.rel)) for fo in u.files]


def _whole(path: str, kind: str | None, size: int) -> bool | None:
    """Read just enough of the file to tell whether its format says it is whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if kind == "safetensors":
            first8 = os.pread(fd, 8, 0)
            n = safetensors_header_len(first8)
            if n is None or 8 + n > size:
                return False
            return safetensors_whole(first8, os.pread(fd, n, 8), size)
        if kind == "zip":
            if os.pread(fd, 4, 0) != ZIP_LOCAL_MAGIC:
                return None  # a legacy pickle: nothing to check
            n = min(size, ZIP_TAIL)
            return zip_whole(os.pread(fd, n, size - n))
        if kind == "json" and size <= MAX_JSON_CHECK:
            return json_whole(os.pread(fd, size, 0))
        return None
    except OSError:
        return None
    finally:
        os.close(fd)

