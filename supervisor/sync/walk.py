"""The scan's I/O: walk the watched folders (never following a symlink, never entering a cache),
remember what was seen between scans, and read just enough of a file to run its format check.
Every decision is in scan.py, complete.py, policy.py and retention.py."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable

from supervisor.config import SyncConfig
from supervisor.durations import format_bytes
from supervisor.saves import formats
from supervisor.saves.complete import (
    MAX_JSON_CHECK,
    Verdict,
    adapted_quiet,
    checkable,
    json_whole,
    judge,
    safetensors_header_len,
    safetensors_whole,
    sparse,
    zip_whole,
)
from supervisor.store._log import Once
from supervisor.sync import retention
from supervisor.sync import scan as sc
from supervisor.sync.policy import Policy
from supervisor.sync.targethealth import AlertSink
from supervisor.training.checkpoints import checkpoint_step
from supervisor.training.ranks import Ranks, settle
from supervisor.untrusted import SAFETENSORS_PARSE_MAX, ZIP_LOCAL_MAGIC, ZIP_TAIL, Unreadable, text
from supervisor.untrusted.fileopen import open_regular

WORLD_EVERY_S = 30.0   # the training's world size is read from /proc at most this often ...
WORLD_RECHECK_S = 5.0  # ... and this often while it says one process or none: the workers of a
                       # launcher (accelerate launch, torchrun) appear a moment after it starts
SAVES_KEPT = 8         # save start times remembered per kind of save (for the cadence)


class Walker:
    def __init__(self, policy: Policy, cfg: SyncConfig, once: Once, alerts: AlertSink | None = None,
                 world_size: Callable[[], Ranks | int | None] | None = None):
        self.policy = policy
        # what the training's workers were told (WORLD_SIZE, RANK, LOCAL_WORLD_SIZE in their environment:
        # the daemon's reader settles them with sync.world_size and [cluster], training/ranks.py), else
        # sync.world_size alone; a callable that answers a plain number is one node's whole world
        self.configured = cfg.world_size
        self.world_size = world_size if world_size is not None else (lambda: cfg.world_size) if cfg.world_size else None
        self._world: tuple[float, Ranks] | None = None
        self._world_known: Ranks | None = None  # the last answer that was one: a run that ended keeps its ranks
        self.quiet = cfg.quiet_period
        self.marker = cfg.complete_marker
        self.keep_last = cfg.keep_last
        self.alerts = alerts
        self.upload_sparse = cfg.upload_sparse
        self.sparse: dict[str, tuple[int, int]] = {}  # path -> (apparent size, bytes on disk), this scan
        self.sparse_told: set[tuple[str, int]] = set()  # (path, size) already alerted
        self.once = once
        self.seen: dict[tuple[str, str], sc.Seen] = {}
        self._scanned: dict[str, float] = {}  # root path -> monotonic time of its last scan
        self.header_reads = 0
        self.unreached: list[tuple[str, str]] = []  # (root, rel): folders the last walk did not enter
        # large JSON files by content: the same tokenizer.json in every checkpoint is parsed once
        self._json_whole: dict[tuple[int, bytes], bool] = {}
        # (root, rel) -> (size, mtime_ns, inode, ctime_ns) and the monotonic time of the first look
        # that saw the file so: a rule's short settle needs two looks at the same version
        self._looked: dict[tuple[str, str], tuple[tuple[int, ...], float]] = {}
        # the save cadence: (root, parent folder, name with its numbers as #) -> unit rel -> wall time
        # its save began (its oldest file's mtime); the units found at a root's first look only
        # give the newest of each kind, as the anchor for the first gap
        self._saves: dict[tuple[str, str, str], dict[str, float]] = {}
        self._found: set[tuple[str, str]] = set()  # (root, unit rel) there at its root's first look

    def scan(self, roots: list[sc.Root], forced: list[str], wall: float, mono: float,
             remote_units: Callable[[str], list[str]],
             held: Callable[[sc.Unit], bool] | None = None) -> dict[sc.UnitKey, sc.Unit]:
        """The units under `roots` now, judged. `forced`: folders a final sync asks for (no quiet
        period); `remote_units(prefix)`: the unit keys the target holds complete (for keep_last);
        `held(unit)`: the ledger says the target holds the unit exactly as it is here (every
        file's size, mtime and inode, and its complete manifest): such a unit is complete without
        being judged again, and none of its files is opened."""
        units: dict[sc.UnitKey, sc.Unit] = {}
        alive: set[tuple[str, str]] = set()
        self.unreached = []
        self.sparse = {}
        for root in roots:
            raw = self.walk(root, sc.nested_roots(root, roots))
            since = self._scanned.get(root.path)
            sc.observe(self.seen, root, raw, since is None, wall, mono, self.quiet, since)
            self._look(root, raw, mono)
            self._scanned[root.path] = mono
            alive.update((root.path, rel) for rel in raw)
            found = sc.group(root, raw, self.seen, self.policy)
            self._note_saves(root, found, since is None)
            units.update(found)
        for k in [k for k in self.seen if k not in alive]:
            del self.seen[k]
        for k in [k for k in self._looked if k not in alive]:
            del self._looked[k]
        self._found &= {(u.root.path, u.rel) for u in units.values()}
        world = self._world_size(mono)
        siblings: dict[str, frozenset[str]] = {}
        for u in units.values():
            if u.selected and held is not None and held(u):
                u.forced = sc.overlaps(u.abspath, forced)
                u.verdict = Verdict(True, "complete", format=self._detect(u, siblings)[0])  # named, not re-judged
                continue
            fmt, rule = self._format(u, world, siblings)
            quiet = self.quiet_for(u)
            seen_before = self._seen_before(u, mono)
            u.verdict = self._judge(u, forced, wall, mono, quiet, fmt, rule, seen_before)
            # a unit that only waits out its quiet period has its files' formats read now, while
            # it waits: the scan at its ready time finds them read (by size and mtime) and sends
            if (u.verdict.complete or u.forced or sc.quieting(u, self._marker(rule))) and self._check_whole(u):
                u.verdict = self._judge(u, forced, wall, mono, quiet, fmt, rule, seen_before)
            if self.sparse:
                self._leave_out_sparse(u)
        if self.keep_last > 0:
            self._retire(roots, units, remote_units)
        tell_sparse(self.sparse, self.sparse_told, self.alerts)
        return units

    def _world_size(self, mono: float) -> Ranks:
        """The training's ranks, read every WORLD_EVERY_S once known, every WORLD_RECHECK_S while
        not (a launcher's workers appear a moment after it): never "unknown" kept as an answer."""
        if self.world_size is None:
            return Ranks(waiting="the training's WORLD_SIZE (no training runs under the daemon; set sync.world_size)")
        last = self._world
        known = last is not None and (last[1].world or 0) > 1 and last[1].mine is not None
        every = WORLD_EVERY_S if known else WORLD_RECHECK_S
        if last is None or mono - last[0] >= every:
            try:
                got = as_ranks(self.world_size(), self.configured)
            except Exception:  # noqa: BLE001 - not known: the rules that need it wait
                got = Ranks(waiting="the training's WORLD_SIZE (its processes could not be read)")
            if got.world is not None:
                self._world_known = got
            # no training running now: its saves keep the ranks it ran with
            self._world = (mono, got if got.world is not None or self._world_known is None else self._world_known)
        return self._world[1]

    @property
    def ranks(self) -> Ranks | None:
        """The ranks the last scan judged by (None before the first), for status and the heartbeat."""
        return self._world[1] if self._world is not None else None

    def _judge(self, u: sc.Unit, forced: list[str], wall: float, mono: float, quiet: float, fmt: str,
               rule: formats.Rule, seen_before: bool) -> Verdict:
        """The unit's verdict (scan.judge_unit's, with the rule's positive answer): a final sync
        takes a unit whose only want is the world size (its writers are gone)."""
        if not u.selected:
            return Verdict(False, "nothing selected")
        u.forced = sc.overlaps(u.abspath, forced)
        waiting = "" if u.forced and rule.soft else rule.waiting
        return judge(u.rel or u.root.path, u.kind, u.files, wall, mono, quiet, u.forced, self._marker(rule), fmt,
                     waiting, rule.positive, seen_before)

    def _marker(self, rule: formats.Rule) -> str:
        """The last file a checkpoint-N folder must hold: the Trainer's trainer_state.json is global
        rank 0's, so a node that does not run it (its own disk) never gets one and waits for none."""
        return "" if rule.elsewhere and self.marker == formats.HF_STATE else self.marker

    def _look(self, root: sc.Root, raw: dict[str, tuple[int, int, int, int]], mono: float) -> None:
        for rel, v in raw.items():
            k = (root.path, rel)
            had = self._looked.get(k)
            if had is None or had[0] != v:
                self._looked[k] = (v, mono)

    def _seen_before(self, u: sc.Unit, mono: float) -> bool:
        """Was every file of the unit there, as it is now, at a look before this one?"""
        for f in u.files:
            rel = u.rel if u.kind == "file" else (f"{u.rel}/{f.rel}" if u.rel else f.rel)
            got = self._looked.get((u.root.path, rel))
            if got is None or got[1] >= mono:
                return False
        return True

    def _note_saves(self, root: sc.Root, units: dict[sc.UnitKey, sc.Unit], first: bool) -> None:
        """Remember when each kind of save began (the cadence the quiet period follows)."""
        newest: dict[tuple[str, str, str], tuple[float, str]] = {}
        for u in units.values():
            if not u.files or not u.rel:
                continue
            start = min(f.mtime for f in u.files)
            kind = save_kind(root.path, u.rel)
            if first:
                self._found.add((root.path, u.rel))
                if kind not in newest or start > newest[kind][0]:
                    newest[kind] = (start, u.rel)
                continue
            saves = self._saves.setdefault(kind, {})
            if (root.path, u.rel) in self._found or u.rel in saves:
                continue
            saves[u.rel] = start
            if len(saves) > SAVES_KEPT:
                del saves[min(saves, key=saves.__getitem__)]
        for kind, (start, rel) in newest.items():
            self._saves.setdefault(kind, {})[rel] = start

    def quiet_for(self, u: sc.Unit) -> float:
        """The quiet period this unit waits out: sync.quiet_period, shortened to half the gap
        between its kind's saves (complete.adapted_quiet)."""
        if not u.rel:
            return self.quiet
        saves = self._saves.get(save_kind(u.root.path, u.rel))
        return adapted_quiet(self.quiet, saves.values()) if saves else self.quiet

    @staticmethod
    def _detect(u: sc.Unit, siblings: dict[str, frozenset[str]]) -> tuple[str, str, list[str], frozenset[str],
                                                                           frozenset[str]]:
        """(format, unit name, its files, the names beside it, the names beside its folder): the
        names only, nothing read."""
        name = u.rel or os.path.basename(u.root.path)
        rels = [f.rel for f in u.files]
        parent = os.path.dirname(u.abspath)
        beside, above = formats.lists_wanted(name, u.kind)
        near = _listing(parent, siblings) if beside else frozenset()
        far = _listing(os.path.dirname(parent), siblings) if above else frozenset()
        return formats.detect(name, rels, near, far), name, rels, near, far

    def _format(self, u: sc.Unit, world: Ranks,
                siblings: dict[str, frozenset[str]]) -> tuple[str, formats.Rule]:
        """The unit's format and its rule's answer (formats.py), reading only the names beside it,
        the small tracker files a rule names and the mtimes of files a rule compares: never a
        shard, never a pickle."""
        fmt, name, rels, near, far = self._detect(u, siblings)
        texts: dict[str, str] = {}
        mtimes: dict[str, float] = {}
        for rel in formats.texts_wanted(fmt, name, rels):
            got = read_text(os.path.normpath(os.path.join(u.abspath, rel)), formats.text_limit(rel))
            if got is not None:
                texts[rel], mtimes[rel] = got
        stats: dict[str, float] = {}
        for rel in formats.stats_wanted(fmt, name, rels):
            try:
                stats[rel] = os.lstat(os.path.normpath(os.path.join(u.abspath, rel))).st_mtime_ns / 1e9
            except OSError:
                continue
        newest = max((f.mtime for f in u.files), default=None)
        several = world.nodes > 1  # one node runs every rank: the rules count them from the world size
        facts = formats.Facts(world.world, texts, near, mtimes, newest, above=far, mtimes=stats,
                              ranks=world.mine if several else None,
                              ranks_waiting=world.waiting if several and world.mine is None else "")
        return fmt, formats.judge(fmt, name, rels, facts)

    def _leave_out_sparse(self, u: sc.Unit) -> None:
        """A sparse file is not uploaded (complete.sparse): the rest of its folder goes up with a
        manifest that names it and says not complete, so no stop waits on it and no restore takes
        the folder for whole."""
        holes = [s for s in u.selected if s.path in self.sparse]
        if not holes:
            return
        u.selected = [s for s in u.selected if s.path not in self.sparse]
        if not (u.verdict.complete or u.verdict.partial or u.forced):
            return  # still being written: judged again when it settles
        words = "; ".join(f"{s.rel}: {format_bytes(self.sparse[s.path][0])} long, "
                          f"{format_bytes(self.sparse[s.path][1])} on disk" for s in holes)
        u.verdict = Verdict(False, f"sparse file(s) not uploaded ({words}); sync.upload_sparse = true sends them",
                            partial=True, damaged=tuple(s.rel for s in holes))

    def _retire(self, roots: list[sc.Root], units: dict[sc.UnitKey, sc.Unit],
                remote_units: Callable[[str], list[str]]) -> None:
        for root in roots:
            local: dict[int, sc.Unit] = {}
            for u in units.values():
                step = checkpoint_step(u.rel) if u.root == root and u.kind == "dir" else None
                if step is not None:
                    local[step] = u
            for step in retention.retired(local, remote_units(root.prefix), root.prefix, self.keep_last):
                local[step].retired = True
                local[step].verdict = Verdict(False, f"older than the newest {self.keep_last} (keep_last)")

    def _check_whole(self, u: sc.Unit) -> bool:
        """Run the format checks the unit's files still need; True when an answer changed or a
        file is not whole (the verdict must be made again)."""
        changed = False
        whole: dict[str, bool | None] = {}
        for s in sc.to_check(u, checkable):
            seen = self.seen.get((u.root.path, s.rrel))
            if seen is None:
                continue
            if seen.whole_for != (s.size, s.mtime_ns):
                seen.whole = read_whole(s.path, checkable(s.rel), s.size, self._json_whole)
                seen.whole_for = (s.size, s.mtime_ns)
                self.header_reads += 1
                changed = True
            whole[s.rel] = seen.whole
        u.files = sc.with_whole(u, whole)
        return changed or any(f.whole is False for f in u.files)

    def walk(self, root: sc.Root, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, tuple[int, int, int, int]]:
        """rel -> (size, mtime_ns, inode, ctime_ns) for regular files; symlinks are never followed, caches,
        folders no glob can reach and the folders in `skip` (other roots) are never entered."""
        out: dict[str, tuple[int, int, int, int]] = {}
        if not os.path.isdir(root.path):
            if os.path.isfile(root.path) and not os.path.islink(root.path):
                st = os.stat(root.path)
                out[os.path.basename(root.path)] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
            return out
        if any(sc.within(root.path, r) for r in self.policy.excluded_roots):
            self.once.warning(f"root-in-cache:{root.path}", "sync_watch_folder_is_a_cache", folder=root.path)
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
                self.once.warning(f"scandir:{absdir}:{e.errno}", "sync_folder_unreadable", folder=absdir,
                                  error=e.strerror or str(e))
                continue
            for e in entries:
                rel = f"{reldir}/{e.name}" if reldir else e.name
                try:
                    if e.is_symlink():
                        continue
                    if e.is_dir(follow_symlinks=False):
                        if os.path.normpath(e.path) in skip:
                            pass  # another root's
                        elif self.policy.enter_dir(rel, e.path):
                            stack.append(rel)
                        else:  # what may lie there unselected is listed for the report (unreached.py)
                            self.unreached.append((root.path, rel))
                        continue
                    if not e.is_file(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as err:
                    self.once.warning(f"stat:{e.path}", "sync_file_unreadable", path=e.path,
                                      error=err.strerror or str(err))
                    continue
                out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
                if not self.upload_sparse and sparse(st.st_size, st.st_blocks * 512):
                    self.sparse[e.path] = (st.st_size, st.st_blocks * 512)
        return out


def as_ranks(got: Ranks | int | None, configured: int = 0) -> Ranks:
    """What a world-size source answered, as Ranks: a plain number is one node's whole world."""
    if isinstance(got, Ranks):
        return got
    return settle(Ranks(got, None, "the training's WORLD_SIZE" if got else "",
                        "" if got else "the training's WORLD_SIZE (set sync.world_size)"), configured)


def _listing(folder: str, cache: dict[str, frozenset[str]]) -> frozenset[str]:
    """The names in `folder` (once per scan: the units of one folder share it)."""
    if folder not in cache:
        try:
            cache[folder] = frozenset(os.listdir(folder))
        except OSError:
            cache[folder] = frozenset()
    return cache[folder]


_NUMBERS = re.compile(r"\d+")


def save_kind(root: str, rel: str) -> tuple[str, str, str]:
    """Which saves a unit is one of, for the cadence: its root, its folder, and its name with every
    number as # (checkpoint_#, epoch=#-step=#.ckpt): a final model's config.json is no kind of save."""
    parent, _, name = rel.rpartition("/")
    return root, parent, _NUMBERS.sub("#", name)


JSON_BY_CONTENT_MIN = 64 * 1024   # larger JSON files are remembered by content (sha256: 1 ms per MiB,
JSON_BY_CONTENT_MAX = 256         # parsing: 25 ms per MiB); at most this many contents


def read_whole(path: str, kind: str | None, size: int,
               json_cache: dict[tuple[int, bytes], bool] | None = None) -> bool | None:
    """Read just enough of the file to tell whether its format says it is whole. `json_cache`:
    answers for large JSON files by (size, sha256 of the bytes), filled as they are parsed."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        if kind == "safetensors":
            first8 = os.pread(fd, 8, 0)
            n = safetensors_header_len(first8)
            if n is None or 8 + n > size:
                return False
            if n > SAFETENSORS_PARSE_MAX:
                return None  # not worth a gigabyte to parse: the quiet period decides
            return safetensors_whole(first8, os.pread(fd, n, 8), size)
        if kind == "zip":
            if os.pread(fd, 4, 0) != ZIP_LOCAL_MAGIC:
                return None  # a legacy pickle: nothing to check
            n = min(size, ZIP_TAIL)
            return zip_whole(os.pread(fd, n, size - n))
        if kind == "json" and size <= MAX_JSON_CHECK:
            data = os.pread(fd, size, 0)
            if json_cache is None or size < JSON_BY_CONTENT_MIN:
                return json_whole(data)
            ck = (size, hashlib.sha256(data).digest())
            whole = json_cache.get(ck)
            if whole is None:
                whole = json_whole(data)
                if len(json_cache) >= JSON_BY_CONTENT_MAX:
                    json_cache.pop(next(iter(json_cache)))
                json_cache[ck] = whole
            return whole
        return None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_text(path: str, limit: int = formats.TEXT_MAX) -> tuple[str, float] | None:
    """A tracker file's text (`latest`, `latest_checkpointed_iteration.txt`, Orbax's JSON step
    metadata) and its mtime: a regular file, no link followed, at most `limit` bytes; None when it
    is not there or not such a file."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        mtime = os.fstat(fd).st_mtime_ns / 1e9
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return text(data, limit=limit, what=os.path.basename(path)), mtime
    except Unreadable:
        return None


def tell_sparse(found: dict[str, tuple[int, int]], told: set[tuple[str, int]], alerts: AlertSink | None) -> None:
    """One warning and one alert per sparse file left out (by path and size), naming both sizes."""
    from supervisor.notify.mails.sync import sparse_left_out
    from supervisor.store._log import get_logger

    for path, (size, on_disk) in found.items():
        if (path, size) in told:
            continue
        told.add((path, size))
        get_logger("sync").warning("sync_sparse_file_left_out", path=path, size=size, on_disk=on_disk)
        if alerts is not None:
            m = sparse_left_out(path, size, on_disk)
            alerts.event(f"sync_sparse:{path}", "sync_sparse_file", "warning", m.subject, m.body)
