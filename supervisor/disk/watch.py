"""The disk duty: watches the filesystems of `sync.watch` and `training.workdir`, forecasts when
each is full, alerts before the save that would fail, and (disk.prune = "synced") deletes old
local checkpoints the sync engine has just verified on the target, oldest first, only what
prune.plan allows and only as much as the next save needs. `prune_now` does the same by hand.

Decisions are forecast.py and prune.py; this module reads the disk (probe.py), asks the sync
engine for the content check (SyncEngine.prover), deletes, journals (journal.py) and alerts."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from supervisor.disk import probe
from supervisor.disk.forecast import Forecast, Save, died_of_full_disk, forecast, keeps_up, rate, remember
from supervisor.disk.journal import Journal
from supervisor.disk.prune import Local, Plan, Proof, plan, protected, to_check
from supervisor.interfaces import Duty, Holding, Verb
from supervisor.notify.mails import disk as words
from supervisor.requests import checked_bool
from supervisor.status import Block
from supervisor.status.disk import DiskBlock

if TYPE_CHECKING:
    from supervisor.config import DiskConfig
    from supervisor.context import Context
    from supervisor.sync.engine import SyncEngine

log = structlog.get_logger("disk")

LARGE_EVERY_S = 300.0        # "other large folders" are measured at most this often (only while alerting)
EVENT_GAP_S = 0.25           # polls a burst of file events asks for are this far apart at least


class DiskWatch:
    def __init__(self, ctx: Context, conf: DiskConfig, sync: SyncEngine | None, paths: list[str], *, quiet: float = 60.0,
                 before_delete: Callable[[dict], None] | None = None, proc: str = "/proc",
                 saves_in: list[str] | None = None, free_min_pct: float = 5.0):
        self.ctx = ctx
        self.cfg = conf
        self.free_min_pct = free_min_pct      # alerts.disk_free_min_pct: the floor a forecast warns before
        self.sync = sync if sync is not None and sync.enabled else None
        self.paths = [os.path.normpath(p) for p in dict.fromkeys(paths) if p]
        self.quiet = quiet                      # a checkpoint changed this recently is being written
        self.before_delete = before_delete      # called with the journal's intent line (tests check the target)
        self.proc = proc
        self.journal = Journal(str(ctx.state_dir))
        self._history: dict[int, list[Save]] = {}
        self._devs: set[int] = set()
        self._alerted: set[str] = set()
        self._large: dict[int, tuple[float, list]] = {}
        # folders a delete refused after their proof (files the target does not hold, changed): not
        # asked about again while they stay as they were, so the next older-but-fine one gets its turn
        self._blocked: dict[str, tuple[dict, str]] = {}
        self._lock = threading.Lock()           # one prune at a time (the duty and `supervisorctl prune`)
        self._poll_lock = threading.Lock()      # one poll at a time (the duty and a save's file events)
        # where saves land (sync.watch): a save that starts or ends is seen through inotify and
        # polled at once, not at the next 10 s duty, which a trainer saving every 6 s outruns
        self.saves_in = [os.path.normpath(p) for p in (saves_in or []) if p]
        self._events = None
        self._kick = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._snap: dict = {"prune": self.cfg.prune, "keep_local": self.cfg.keep_local, "filesystems": []}
        self.last_prune: dict | None = None

    # --- what the daemon asks -------------------------------------------------------------------
    def covers(self, dev: int) -> bool:
        """Is this filesystem watched here (HostCheck leaves its "almost full" alert to us)?"""
        if not self._devs:
            self._filesystems()  # asked before our first poll (the duties start together)
        return dev in self._devs

    def status(self) -> dict:
        s = dict(self._snap)
        s.update(deleted=self.journal.deleted, freed_bytes=self.journal.freed, recent=self.journal.recent(10),
                 last_prune=self.last_prune)
        return s

    def start(self) -> None:
        """Follow the saves as they happen (the daemon's duty still polls every 10 s)."""
        if not self.saves_in or self._thread is not None:
            return
        listen = getattr(self.sync, "fs_events", None)
        if not (callable(listen) and listen(self._on_event)):  # the sync engine's watcher, when it has one
            from supervisor.sync.watch import FolderWatcher

            self._events = FolderWatcher(self._on_event)
            self._events.ensure(self.saves_in)
        self._thread = threading.Thread(target=self._follow, name="disk-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._kick.set()
        if self._events is not None:
            self._events.close()
        if self._thread is not None:
            self._thread.join(5)

    def _on_event(self, path: str) -> None:
        name = os.path.basename(path)
        if name == probe.STATE_FILE or probe.checkpoint_step(name) is not None:
            self._kick.set()  # a checkpoint folder appeared (a save starts) or its last file came

    def _follow(self) -> None:
        while not self._closing.is_set():
            self._kick.wait()
            if self._closing.is_set():
                return
            self._kick.clear()
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the 10 s duty goes on regardless
                log.exception("disk_event_poll_failed")
            self._closing.wait(EVENT_GAP_S)

    def poll(self) -> dict:
        with self._poll_lock:
            if self._events is not None:
                self._events.ensure(self.saves_in)  # an output folder made since
            return self._poll()

    def _poll(self) -> dict:
        now = self.ctx.clock.time()
        holdings = self._holdings()
        out = []
        for dev, (mount, paths) in self._filesystems().items():
            try:
                out.append(self._poll_fs(dev, mount, paths, holdings, now))
            except OSError as e:
                log.warning("disk_poll_failed", mount=mount, error=str(e))
        self._snap = {"prune": self.cfg.prune, "keep_local": self.cfg.keep_local,
                      "alert_before_s": self.cfg.alert_before, "filesystems": out}
        return self.status()

    def prune_now(self, dry_run: bool = False) -> dict:
        """`supervisorctl prune [--dry-run]`: every checkpoint the decision allows, on every
        watched filesystem, whatever the free space (prune = "off" included: a person asked)."""
        if self.sync is None:
            return {"ok": False, "error": "no sync target: nothing is verified off the machine, nothing is deleted",
                    "deleted": [], "kept": {}}
        now = self.ctx.clock.time()
        holdings = self._holdings()
        deleted, kept, would = [], {}, []
        with self._lock:
            for mount, paths in self._filesystems().values():
                free, _ = probe.usage(mount)
                p, done = self._prune(self._folders(paths), holdings, free, None, now, dry_run=dry_run, by="hand")
                kept.update(p.kept)
                would += p.delete
                deleted += done
        self.poll()  # status shows what is left at once
        return {"ok": True, "dry_run": dry_run, "would_delete": would if dry_run else [], "deleted": deleted,
                "kept": kept}

    def full_at_end(self, tail: list[str]) -> str:
        """For a failed run's mail: the words when it died of a full disk (watched folder, its free
        bytes, the biggest things on it), else "". Asked once per failure."""
        for dev, (mount, paths) in self._filesystems().items():
            try:
                free, total = probe.usage(mount)
            except OSError:
                continue
            per, _ = rate(self._history.get(dev, []))
            if not died_of_full_disk(tail, free, total, per):
                continue
            folders = self._folders(paths)
            big = sorted([(f.path, f.bytes) for f in folders] + self._large_folders(dev, paths, folders),
                         key=lambda x: -x[1])
            log.warning("training_disk_full", mount=mount, free=free, folder=paths[0])
            return words.full_at_end(paths[0], mount, free, total, big)
        return ""

    # --- one filesystem -------------------------------------------------------------------------
    def _poll_fs(self, dev: int, mount: str, paths: list[str], holdings: dict[str, Holding], now: float) -> dict:
        folders = self._folders(paths)
        free, total = probe.usage(mount)
        done = [f for f in folders if f.has_state and now - f.newest >= self.quiet]
        hist = self._history[dev] = remember(self._history.get(dev, []), [Save(f.path, f.bytes, f.newest) for f in done])
        local = self._local(folders, now, writers=False)
        best = self._best(folders)
        on_target = {p for p, h in holdings.items() if h.on_target}
        pruning = self.cfg.prune == "synced" and self.sync is not None
        reclaim = sum(c.bytes for c in protected(local, best, self.cfg.keep_local)[0] if c.path in on_target) \
            if pruning else 0
        here = [f for f in folders if f.has_state]
        steady = pruning and not self._sync_failing() and keeps_up(
            free, sum(f.bytes for f in folders), rate(hist)[0], self.cfg.keep_local + len(best))
        fc = self._forecast(free, total, hist, now, reclaim, steady)
        why = ""
        if pruning and fc.short:
            with self._lock:
                p, gone = self._prune(folders, holdings, free, fc.need, now, dry_run=False, by="auto")
            if gone:
                folders = self._folders(paths)
                free, total = probe.usage(mount)
                holdings = self._holdings()
                on_target = {q for q, h in holdings.items() if h.on_target}
            if not p.enough:
                why = self._why_kept(p)
                reclaim = 0   # what the ledger believes could go did not pass the check: do not count on it
                steady = False
            else:
                reclaim = sum(c.bytes for c in protected(self._local(folders, now, writers=False), best,
                                                         self.cfg.keep_local)[0] if c.path in on_target)
            fc = self._forecast(free, total, hist, now, reclaim, steady)
            here = [f for f in folders if f.has_state]
        info = {"mount": mount, "paths": paths, "free_bytes": free, "total_bytes": total,
                "free_pct": 100.0 * free / total if total else 100.0,
                "full_in_s": fc.full_in, "alert_before_s": fc.alert_before, "checkpoint_bytes": fc.per_checkpoint,
                "interval_s": fc.interval, "need_bytes": fc.need, "saves_left": fc.saves_left,
                "reclaimable_bytes": fc.reclaimable, "prune_keeps_up": fc.keeps_up, "checkpoints": len(here),
                "checkpoints_bytes": sum(f.bytes for f in here),
                "verified_off": sum(1 for f in here if f.path in on_target), "reasons": list(fc.reasons),
                "alert": fc.alert}
        info["line"] = words.line(info)
        self._alert(dev, info, folders, why)
        return info

    def _forecast(self, free: int, total: int, hist: list[Save], now: float, reclaim: int,
                  steady: bool = False) -> Forecast:
        return forecast(free, total, hist, now, self.cfg.alert_before, reclaim,
                        self.free_min_pct, steady)

    def _sync_failing(self) -> bool:
        return self.sync is None or bool(getattr(self.sync.health, "failing", True))

    def _alert(self, dev: int, info: dict, folders: list[probe.Folder], why: str) -> None:
        key = f"disk:forecast:{info['mount']}"
        if not info["alert"]:
            # also one raised before a daemon restart (Alerts keeps it): resolving an inactive key is a no-op
            self.ctx.alerts.resolve(key)
            self._alerted.discard(key)
            return
        info["large_folders"] = self._large_folders(dev, info["paths"], folders)
        mail = words.disk_full_soon(info, self.cfg.prune, self.cfg.keep_local, why)
        if key not in self._alerted:
            log.warning("disk_full_soon", mount=info["mount"], reasons=info["reasons"], free=info["free_bytes"],
                        full_in_s=info["full_in_s"], why_kept=why or None)
        self.ctx.alerts.fire(key, "disk_forecast", "warning", mail.subject, mail.body)
        self._alerted.add(key)

    def _large_folders(self, dev: int, paths: list[str], folders: list[probe.Folder]) -> list:
        now = self.ctx.clock.monotonic()
        at, got = self._large.get(dev, (None, []))
        if at is None or now - at >= LARGE_EVERY_S:
            got = probe.large_folders(paths, {f.path for f in folders})
            self._large[dev] = (now, got)
        return got

    # --- pruning --------------------------------------------------------------------------------
    def _prune(self, folders: list[probe.Folder], holdings: dict[str, Holding], free: int, need: int | None, now: float,
               dry_run: bool, by: str) -> tuple[Plan, list[str]]:
        assert self.sync is not None
        local = self._local(folders, now, writers=True)
        best = self._best(folders)
        blocked = self._still_blocked()
        believed = [p for p, h in holdings.items() if h.on_target and p not in blocked]
        ask = to_check(local, best, self.cfg.keep_local, free, need, believed)
        answers = self.sync.prover.prove_held(ask) if ask else {}
        proofs = {p: Proof(bool(a.get("ok")), a.get("reason", "")) for p, a in answers.items()}
        proofs.update({p: Proof(False, why) for p, why in blocked.items()})
        for c in local:
            proofs.setdefault(c.path, Proof(False, "not on the target yet (the sync is behind)"))
        p = plan(local, best, self.cfg.keep_local, proofs, free, need)
        self.last_prune = {"at": now, "by": by, "dry_run": dry_run, "need_bytes": need, "free_bytes": free,
                           "delete": list(p.delete), "kept": dict(p.kept), "enough": p.enough}
        gone: list[str] = []
        if dry_run:
            return p, gone
        sizes = {c.path: c.bytes for c in local}
        for path in p.delete:
            why = self._delete(path, answers[path], sizes[path], by)
            if why is None:
                gone.append(path)
            else:
                self._blocked[path] = (probe.files(path), why)
                p.kept[path] = why
                p.freed -= sizes[path]
        p.enough = need is None or free + p.freed >= need
        self.last_prune["deleted"] = gone
        return p, gone

    def _delete(self, path: str, proof: dict, nbytes: int, by: str) -> str | None:
        """Delete one folder the plan allows, after checking it still holds exactly the files the
        target was just seen to hold and no process has one open. None when deleted, else why not.
        The check and the removal both go through one open handle on the parent folder: a parent
        swapped for a symlink meanwhile (the training user owns it) cannot send the delete elsewhere."""
        parent, name = os.path.split(path)
        try:
            pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            return f"cannot open {parent}: {e.strerror or e}"
        try:
            return self._delete_at(pfd, path, name, proof, nbytes, by)
        finally:
            os.close(pfd)

    def _delete_at(self, pfd: int, path: str, name: str, proof: dict, nbytes: int, by: str) -> str | None:
        verified = {rel: tuple(v) for rel, v in (proof.get("files") or {}).items()}
        now_files = probe.files(name, dir_fd=pfd)
        if now_files != verified:
            extra = sorted(set(now_files) - set(verified))
            changed = sorted(r for r in set(now_files) & set(verified) if now_files[r] != verified[r])
            why = ("holds files the target does not: " + ", ".join(extra[:3])) if extra else \
                  ("changed since the check: " + ", ".join((changed or sorted(set(verified) - set(now_files)))[:3]))
            log.warning("disk_prune_skipped", path=path, why=why)
            return why
        if probe.writers([path], self.proc):
            return "a process has a file open in it"
        entry = {"event": "delete", "path": path, "unit": proof.get("unit", ""),
                 "target": self.sync.display if self.sync else "", "files": len(verified), "bytes": nbytes,
                 "verified_at": proof.get("checked_at"), "at": self.ctx.clock.time(), "by": by}
        self.journal.append(entry)
        if self.before_delete is not None:
            self.before_delete(entry)
        errors: list[str] = []
        shutil.rmtree(name, dir_fd=pfd, onerror=lambda _f, p, e: errors.append(f"{p}: {e[1]}"))
        done = {**entry, "event": "deleted" if not errors else "delete_failed", "at": self.ctx.clock.time()}
        if errors:
            done["error"] = errors[0]
        self.journal.append(done)
        log.warning("disk_pruned" if not errors else "disk_prune_failed", path=path, unit=entry["unit"],
                    bytes=nbytes, by=by, error=errors[0] if errors else None)
        return errors[0] if errors else None

    def _still_blocked(self) -> dict[str, str]:
        for path, (snap, _) in list(self._blocked.items()):
            if not os.path.isdir(path) or probe.files(path) != snap:
                del self._blocked[path]   # gone, or changed: judge it afresh
        return {p: why for p, (_, why) in self._blocked.items()}

    @staticmethod
    def _why_kept(p: Plan) -> str:
        failed = {path: why for path, why in p.kept.items()
                  if not why.startswith(("among the newest", "the Trainer's best", "being written", "not needed"))}
        if failed:
            return "; ".join(f"{os.path.basename(k)}: {v}" for k, v in list(failed.items())[:5])
        if p.kept:
            kinds: dict[str, int] = {}
            for why in p.kept.values():
                kinds[why] = kinds.get(why, 0) + 1
            return "every checkpoint here must stay (" + "; ".join(f"{n}: {w}" for w, n in kinds.items()) + ")"
        return "no checkpoint here to delete"

    # --- reading the machine --------------------------------------------------------------------
    def _filesystems(self) -> dict[int, tuple[str, list[str]]]:
        out: dict[int, tuple[str, list[str]]] = {}
        for p in self.paths:
            fs = probe.filesystem(p)
            if fs is None:
                continue
            out.setdefault(fs[0], (fs[1], []))[1].append(p)
        self._devs = set(out)
        return out

    def _folders(self, paths: list[str]) -> list[probe.Folder]:
        seen: dict[str, probe.Folder] = {}
        for root in paths:
            for f in probe.checkpoints(root):
                seen.setdefault(f.path, f)
        return list(seen.values())

    def _local(self, folders: list[probe.Folder], now: float, writers: bool) -> list[Local]:
        open_in = probe.writers([f.path for f in folders], self.proc) if writers else set()
        return [Local(f.path, f.step, f.bytes,
                      writing=not f.has_state or now - f.newest < self.quiet or f.path in open_in) for f in folders]

    def _best(self, folders: list[probe.Folder]) -> set[str]:
        """The Trainer's best_model_checkpoint as the newest trainer_state.json of each output
        folder names it (a relative path is matched by its folder name in that output folder)."""
        newest: dict[str, probe.Folder] = {}
        for f in folders:
            parent = os.path.dirname(f.path)
            if f.has_state and (parent not in newest or f.step > newest[parent].step):
                newest[parent] = f
        out: set[str] = set()
        for parent, f in newest.items():
            for src in (f.path, parent):
                best = probe.best_checkpoint(src)
                if best:
                    out.add(os.path.normpath(best) if os.path.isabs(best) else
                            os.path.join(parent, os.path.basename(os.path.normpath(best))))
        return out

    def _holdings(self) -> dict[str, Holding]:
        if self.sync is None:
            return {}
        try:
            return {os.path.normpath(h.path): h for h in self.sync.holdings()}
        except Exception:  # noqa: BLE001 - the forecast goes on without knowing what is off the machine
            log.exception("disk_holdings_failed")
            return {}

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        return (Duty("disk", 10.0, self.poll),)  # before the floor: it learns what the forecast covers

    def status_blocks(self) -> tuple[Block, ...]:
        return (DiskBlock.of(self.status()),)

    def verbs(self) -> dict[str, Verb]:
        return {"prune": lambda a: self.prune_now(dry_run=checked_bool(a, "dry_run"))}  # root only
