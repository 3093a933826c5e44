"""What a scan decides, as pure functions: which roots are watched and under which key prefix, how
the files seen under a root group into units, which units still need work, and what is pending.

No I/O and no clock reads: the walker (walk.py) reads the folders and passes what it saw and
`now`; the ledger is consulted only through `current(key, size, mtime_ns)` (what the target holds).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from supervisor.durations import format_bytes, format_duration
from supervisor.saves.complete import (
    FileObs,
    Verdict,
    checkable,
    damage_words,
    judge,
    marker_missing,
    needs_marker,
    temp_files,
)
from supervisor.saves.wholes import NEMO2_WEIGHTS, downloaded, inside, nemo2_dirs, saved_models
from supervisor.store.base import join_key
from supervisor.sync.policy import ADAPTER_MARKER, DCP_SHARD_SUFFIX, Policy

# current(key, size, mtime_ns, ctime_ns=...): truthy when the target holds exactly that version
# (Ledger.current)
Current = Callable[..., object]


def holds(current: Current, s: Selected) -> object:
    """current() for this version of the file; its ctime too where the scan saw one."""
    if s.ctime_ns:
        return current(s.key, s.size, s.mtime_ns, ctime_ns=s.ctime_ns)
    return current(s.key, s.size, s.mtime_ns)


UnitKey = tuple[str, str, str]   # (root path, kind, unit rel)
MARKER_HINT_AFTER = 600.0        # a checkpoint quiet this long without its marker: say how to fix it


@dataclass(frozen=True)
class Root:
    path: str     # absolute, normalised
    prefix: str   # key prefix on the target ("" when there is one watched folder)


@dataclass
class Seen:
    """What the walker remembers of one file between scans."""

    size: int
    mtime_ns: int
    stable_since: float | None     # monotonic time this (size, mtime) was first seen; None: settled
    whole: bool | None = None      # the format check's answer ...
    whole_for: tuple[int, int] | None = None  # ... for this (size, mtime_ns) (and `ino`)
    ino: int = 0                   # 0: unknown
    ctime_ns: int = 0              # a rewrite that sets the mtime back still moves the ctime


@dataclass
class Selected:
    """A file the policy selects for upload."""

    path: str     # absolute
    key: str      # on the target
    rel: str      # inside the unit
    size: int
    mtime_ns: int
    rrel: str     # relative to the root
    ino: int = 0  # 0: unknown
    ctime_ns: int = 0  # 0: unknown; part of the version (a rewrite with its mtime set back)


@dataclass
class Unit:
    root: Root
    kind: str            # "dir" | "file"
    rel: str             # relative to the root ("" = the root itself, for an adapter saved there)
    key: str
    files: list[FileObs] = field(default_factory=list)
    selected: list[Selected] = field(default_factory=list)
    verdict: Verdict = Verdict(False, "not judged")
    forced: bool = False
    retired: bool = False   # older than the keep_last newest checkpoints: not uploaded any more

    @property
    def abspath(self) -> str:
        return os.path.join(self.root.path, self.rel) if self.rel else self.root.path

    @property
    def label(self) -> str:
        return self.key or self.root.path


def within(path: str, folder: str) -> bool:
    p, f = os.path.normpath(path), os.path.normpath(folder)
    return p == f or p.startswith(f.rstrip("/") + "/")


def overlaps(path: str, paths: Iterable[str]) -> bool:
    """Is `path` inside one of `paths`, or one of them inside it?"""
    return any(within(path, p) or within(p, path) for p in paths)


# --- roots -----------------------------------------------------------------------------------------

def watch_roots(watch: list[str]) -> list[Root]:
    """One watched folder maps to the target's top; several each get their folder name (made
    unique with a hash of the path when two share a name)."""
    paths = [os.path.normpath(p) for p in watch if p]
    if len(paths) == 1:
        return [Root(paths[0], "")]
    out, used = [], set()
    for p in paths:
        name = os.path.basename(p) or "root"
        if name in used:
            name = f"{name}-{_path_tag(p)}"
        used.add(name)
        out.append(Root(p, name))
    return out


def extra_root(path: str, roots: list[Root], extras: list[Root]) -> Root | None:
    """The root a final-sync folder outside every watched folder is synced from; None when it is
    inside one already (its files are that root's). Alone (nothing watched, no other extra) it
    maps to the target's top; otherwise to its name plus a hash of its path, so it can never land
    on a watched folder's subfolder of the same name (`lora/`) and overwrite it there."""
    p = os.path.normpath(path)
    if any(within(p, r.path) for r in [*roots, *extras]):
        return None
    if not roots and not extras:
        return Root(p, "")
    return Root(p, f"{os.path.basename(p) or 'root'}-{_path_tag(p)}")


def nested_roots(root: Root, roots: list[Root]) -> set[str]:
    """The other roots inside `root` (a final-sync folder above a watched one): its walk leaves
    them to their own root, or their files would go up twice under two keys."""
    return {r.path for r in roots if r.path != root.path and within(r.path, root.path)}


def _path_tag(path: str) -> str:
    return hashlib.sha1(path.encode()).hexdigest()[:6]


# --- grouping --------------------------------------------------------------------------------------

def observe(seen: dict[tuple[str, str], Seen], root: Root, raw: dict[str, tuple[int, ...]], first: bool,
            wall: float, mono: float, quiet: float, since: float | None = None) -> None:
    """Update what is remembered of each file under `root` (`raw`: rel -> (size, mtime_ns[, inode])).
    A file already quiet when the root is first scanned (a daemon restart) counts as settled at once.

    The quiet clock of a new or changed version starts at its mtime, not when this scan happens
    to see it (a scan may come a while after the last write), but never before `since`, the
    monotonic time of the root's previous scan: the version was not there then, so however the
    wall clock was stepped, it cannot be quiet for longer than that."""
    for rel, v in raw.items():
        size, mtime_ns = v[0], v[1]
        ino = v[2] if len(v) > 2 else 0
        ctime_ns = v[3] if len(v) > 3 else 0
        sk = (root.path, rel)
        s = seen.get(sk)
        start = mono if since is None else min(mono, max(since, mono - max(0.0, wall - mtime_ns / 1e9)))
        if s is None:
            settled = first and wall - mtime_ns / 1e9 >= quiet
            seen[sk] = Seen(size, mtime_ns, None if settled else start, ino=ino, ctime_ns=ctime_ns)
        elif (s.size, s.mtime_ns, s.ino, s.ctime_ns) != (size, mtime_ns, ino, ctime_ns):
            if s.ino != ino or (s.size, s.mtime_ns) == (size, mtime_ns):
                s.whole_for = None  # another file at the path, or bytes rewritten under an old mtime
            if (s.size, s.mtime_ns) == (size, mtime_ns) and ctime_ns:
                # only the ctime moved (bytes rewritten, the mtime set back): quiet from that change
                start = mono if since is None else min(mono, max(since, mono - max(0.0, wall - ctime_ns / 1e9)))
            s.size, s.mtime_ns, s.ino, s.ctime_ns, s.stable_since = size, mtime_ns, ino, ctime_ns, start


def group(root: Root, raw: dict[str, tuple[int, ...]], seen: dict[tuple[str, str], Seen],
          policy: Policy) -> dict[UnitKey, Unit]:
    """The units under one root: every selected file in its unit, plus the unselected files that
    share a unit folder (any activity in a checkpoint folder counts)."""
    units: dict[UnitKey, Unit] = {}
    # folders that go up whole: an adapter (adapter_config.json), a torch.distributed.checkpoint
    # save (its .distcp shards; its .metadata, written last, with them)
    adapter_dirs = {rel.rsplit("/", 1)[0] if "/" in rel else "" for rel in raw
                    if (rel.rsplit("/", 1)[-1] == ADAPTER_MARKER or rel.endswith(DCP_SHARD_SUFFIX))
                    and policy.selects(rel)}
    nemo = nemo2_dirs(adapter_dirs, raw)
    adapter_dirs = (adapter_dirs - {f"{d}/{NEMO2_WEIGHTS}" for d in nemo}) | nemo
    # a model saved below the top (`trainer.save_model("out/final")`, save_pretrained): one unit, whole
    adapter_dirs |= {d for d in saved_models(raw, policy) if not downloaded(os.path.join(root.path, d))}
    for rel, v in raw.items():
        size, mtime_ns = v[0], v[1]
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        # an adapter folder goes up whole (README, tokenizer); the watched folder itself
        # only with what the globs select, or a growing train.log would hold it back
        in_adapter = bool(parent) and parent in adapter_dirs
        whole_of = inside(rel, nemo)  # a NeMo 2 checkpoint goes up whole, context/ and all
        selected = policy.selects(rel) or ((in_adapter or whole_of is not None) and policy.allowed(rel))
        if whole_of is not None:
            kind, urel = "dir", whole_of
            if not selected:
                in_adapter = True
        elif selected:
            kind, urel = policy.unit_of(rel, adapter_dirs)
        else:
            kind, urel = "dir", policy.folder_unit(rel)
            if urel is None:
                if not in_adapter:
                    continue
                urel = parent
        uk = (root.path, kind, urel)
        u = units.get(uk)
        if u is None:
            u = units[uk] = Unit(root, kind, urel, join_key(root.prefix, urel))
        if kind == "file":
            inner = rel.rsplit("/", 1)[-1]
        else:
            inner = rel[len(urel) + 1:] if urel else rel
        s = seen.get((root.path, rel))
        stable_since = s.stable_since if s is not None else None
        whole = s.whole if s is not None and s.whole_for == (size, mtime_ns) else None
        u.files.append(FileObs(inner, size, mtime_ns / 1e9, stable_since, whole))
        if selected:
            u.selected.append(Selected(os.path.join(root.path, rel), join_key(root.prefix, rel), inner,
                                       size, mtime_ns, rel, v[2] if len(v) > 2 else 0, v[3] if len(v) > 3 else 0))
    return units


def judge_unit(u: Unit, forced_paths: list[str], wall: float, mono: float, quiet: float, marker: str,
               fmt: str = "", waiting: str = "") -> Verdict:
    """The completeness verdict for a unit (forced when a final sync asks for its folder); `fmt`
    and `waiting`: its format and what the format's rule still waits for (formats.py)."""
    if not u.selected:
        return Verdict(False, "nothing selected")
    u.forced = overlaps(u.abspath, forced_paths)
    return judge(u.rel or u.root.path, u.kind, u.files, wall, mono, quiet, u.forced, marker, fmt, waiting)


def quieting(u: Unit, marker: str) -> bool:
    """Only the quiet period stands between the unit and complete: its writer's last file is
    there (when its name asks for one), nothing temporary, and a time is known when it may be."""
    v = u.verdict
    return (not v.complete and v.ready_in is not None and not temp_files(u.files)
            and not marker_missing(u.rel or u.root.path, u.kind, u.files, marker))


def to_check(u: Unit, checkable: Callable[[str], str | None]) -> list[Selected]:
    """The unit's selected files whose format can be checked."""
    return [s for s in u.selected if checkable(s.rel) is not None]


def with_whole(u: Unit, whole: dict[str, bool | None]) -> list[FileObs]:
    """The unit's observations with the format checks' answers (by rel inside the unit)."""
    return [FileObs(f.rel, f.size, f.mtime, f.stable_since, whole[f.rel]) if f.rel in whole else f
            for f in u.files]


def next_ready(units: Iterable[Unit]) -> float | None:
    """Seconds until the soonest unit may become complete by itself, if nothing changes."""
    ready = [u.verdict.ready_in for u in units if not u.verdict.complete and u.verdict.ready_in is not None]
    return min(ready) if ready else None


# --- what needs work -------------------------------------------------------------------------------

def files_synced(u: Unit, current: Current) -> bool:
    """Does the target hold every selected file of the unit?"""
    return all(holds(current, s) for s in u.selected)


def needs_manifest(u: Unit) -> bool:
    """A folder gets a manifest when complete, and (saying so) when a final sync sent it with
    files that fail their format check; one that never got its marker gets none. So does a
    single file that is a checkpoint by its format (a Lightning `.ckpt`, a `ckpt.pt`, a
    `.safetensors`): a restore takes only what a manifest vouches for. A log or a CSV does not."""
    return wants_manifest(u) and (u.verdict.complete or (u.verdict.partial and bool(u.verdict.damaged)))


def wants_manifest(u: Unit) -> bool:
    """A unit whose copy on the target is only whole with its manifest: every folder, and a single
    file in a checkpoint format (whole by its own header: torch zip, safetensors)."""
    return u.kind == "dir" or checkpoint_file(u.rel)


def checkpoint_file(rel: str) -> bool:
    """A single file that is a checkpoint by its format: a torch zip (`.pt`, `.pth`, `.bin`,
    `.ckpt`) or a `.safetensors` file."""
    return checkable(rel.rsplit("/", 1)[-1]) in ("zip", "safetensors")


def work(units: Iterable[Unit], synced: Callable[[Unit], bool]) -> list[Unit]:
    """Units ready to go up and not yet (wholly) on the target, the newest first: when the machine
    may be taken any minute (a spot notice), the checkpoint that holds the most training is the one
    that must be off it first; older ones follow."""
    out = [u for u in units if u.selected and (u.verdict.complete or u.verdict.partial) and not synced(u)]
    out.sort(key=_newest, reverse=True)
    return out


def hold_for_newer(units: Iterable[Unit], work: list[Unit], synced: Callable[[Unit], bool], marker: str,
                   within: float) -> list[Unit]:
    """Under a spot notice: the work without the units older than a checkpoint whose writer has
    finished (its marker, written last, is there) and that only waits out a quiet period ending
    within `within` seconds. Sending an older one first would hold the link for seconds while the
    one that matters most is moments from ready; anything still being written holds nothing."""
    cut = None
    for u in units:
        v = u.verdict
        if (u.kind == "dir" and u.selected and not v.complete and not v.partial and v.ready_in is not None
                and v.ready_in <= within and needs_marker(u.rel, marker)
                and any(f.rel == marker for f in u.files) and not synced(u)):
            cut = max(cut or 0, _newest(u))
    if cut is None:
        return work
    return [u for u in work if _newest(u) > cut]


def _newest(u: Unit) -> int:
    return max((s.mtime_ns for s in u.selected), default=0)


def batches(work: list[Unit]) -> list[list[Unit]]:
    """Folders one by one (each gets its manifest); the single files of a root together; newest first."""
    out: list[list[Unit]] = []
    files: dict[str, list[Unit]] = {}
    for u in work:
        if u.kind == "file":
            files.setdefault(u.root.path, []).append(u)
        else:
            out.append([u])
    for grp in files.values():
        for i in range(0, len(grp), 500):
            out.append(grp[i:i + 500])
    return sorted(out, key=lambda b: max(_newest(u) for u in b), reverse=True)


TOGETHER_MAX_UNITS = 64


def together(batches: list[list[Unit]], max_units: int = TOGETHER_MAX_UNITS) -> list[list[Unit]]:
    """Consecutive folder batches joined (in their order, up to max_units), so the target
    streams one folder's files right after the previous one's instead of pausing at each
    folder's end (each folder still gets its own manifest, after its own files)."""
    out: list[list[Unit]] = []
    for b in batches:
        prev = out[-1] if out else None
        if (prev is not None and len(b) == 1 and b[0].kind == "dir" and all(u.kind == "dir" for u in prev)
                and len(prev) < max_units):
            prev.append(b[0])
        else:
            out.append(list(b))
    return out


def settling(units: Iterable[Unit], synced: Callable[[Unit], bool]) -> bool:
    """Is some unit about to become complete by itself (its writer just went quiet, or a folder
    just appeared)? `sync --wait` waits for those; not for ones that need their writer to come
    back (no trainer_state.json, a truncated file)."""
    for u in units:
        v = u.verdict
        if u.selected and not v.complete and not v.partial and v.ready_in is not None and not synced(u):
            return True
    return False


def blocked(units: Iterable[Unit], synced: Callable[[Unit], bool]) -> list[str]:
    """Why a pass cannot say everything is on the target although nothing is settling: a unit
    whose writer went quiet with a file that fails its format check (a JSON file that does not
    parse, a safetensors file shorter than its header says) waits for that writer, so name it."""
    out = []
    for u in units:
        v = u.verdict
        if u.selected and not u.retired and v.damaged and not v.complete and not v.partial and not synced(u):
            out.append(f"{u.abspath}: {'; '.join(f'{n} {damage_words(n)}' for n in v.damaged)}; "
                       "not uploaded until its writer saves it whole")
    return sorted(out)


def in_scope(u: Unit, paths: list[str] | None) -> bool:
    return paths is None or overlaps(u.abspath, paths)


def final_scope(units: Iterable[Unit], paths: list[str]) -> list[Unit]:
    """The units a final sync of `paths` must leave on the target."""
    return [u for u in units if u.selected and not u.retired and overlaps(u.abspath, paths)]


def held(units: Iterable[Unit], current: Current, scope: list[str] | None) -> tuple[int, int]:
    """Files (and bytes) under `scope` (None: everywhere) that the target holds now."""
    n = b = 0
    for u in units:
        for s in u.selected:
            if scope is not None and not any(within(s.path, p) for p in scope):
                continue
            if holds(current, s):
                n += 1
                b += s.size
    return n, b


def unsynced(units: Iterable[Unit], current: Current, scope: list[str] | None) -> list[str]:
    """Selected files under `scope` (None: everywhere) that exist only on this machine."""
    out = []
    for u in units:
        if u.retired:
            continue
        for s in u.selected:
            if scope is not None and not overlaps(s.path, scope):
                continue
            if not holds(current, s):
                out.append(s.path)
    return sorted(out)


@dataclass(frozen=True)
class Pending:
    files: int
    bytes: int
    waiting: list[tuple[str, str, str, str]]  # (unit label, why it is not complete yet, format, what its rule waits for)
    without_marker: list[tuple[str, float]]  # (unit label, quiet for s): writers that may never write it
    stuck: list[tuple[str, str, float]] = field(default_factory=list)  # (label, what its rule waits for,
                                             # quiet for s): far longer than its siblings' saves took


STUCK_MIN_S = 300.0   # a unit waiting on its format's rule this long, and ...
STUCK_TIMES = 10.0    # ... this many times longer than its siblings' saves took, is stuck (a rank died mid-save)


def save_span(u: Unit) -> float:
    """How long the unit's save took: from its first file written to its last."""
    return max(f.mtime for f in u.files) - min(f.mtime for f in u.files) if u.files else 0.0


def stuck_after(spans: Iterable[float], quiet: float) -> float:
    """How long a unit may wait on its format's rule before it is called stuck."""
    return max(STUCK_MIN_S, 10 * quiet, STUCK_TIMES * max(spans, default=0.0))


def pending(units: Iterable[Unit], current: Current, wall_now: float, quiet: float, marker: str) -> Pending:
    units = list(units)
    limit = stuck_after([save_span(u) for u in units if u.kind == "dir" and u.verdict.complete], quiet)
    stuck: list[tuple[str, str, float]] = []
    n = b = 0
    waiting: list[tuple[str, str, str, str]] = []
    no_marker: list[tuple[str, float]] = []
    for u in units:
        if not u.selected or u.retired:
            continue
        missing = [s for s in u.selected if not holds(current, s)]
        n += len(missing)
        b += sum(s.size for s in missing)
        if missing and not u.verdict.complete and not u.verdict.partial:
            reason = u.verdict.reason
            if reason.startswith("waiting for ") and u.files and not u.verdict.waiting_for:
                idle = wall_now - max(f.mtime for f in u.files)
                if idle >= max(MARKER_HINT_AFTER, 10 * quiet):
                    # a writer that never writes the marker would never be synced: say so
                    reason += (f" (quiet for {format_duration(idle)}; if its writer never writes it, "
                               f"set sync.complete_marker)")
                    no_marker.append((u.label, idle))
            waiting.append((u.label, reason, u.verdict.format, u.verdict.waiting_for))
            if u.verdict.waiting_for and u.files and wall_now - max(f.mtime for f in u.files) >= limit:
                stuck.append((u.label, u.verdict.waiting_for, wall_now - max(f.mtime for f in u.files)))
    return Pending(n, b, sorted(waiting), no_marker, stuck)


# --- what people must be told about ----------------------------------------------------------------

def newest_checkpoints(scope: Iterable[Unit]) -> list[str]:
    """The newest `checkpoint-N` of each run folder in the scope (`tiny/checkpoint-40`), so a
    "verified" mail shows which training the target holds and a stale one stands out."""
    best: dict[tuple[str, str], tuple[int, str]] = {}
    for u in scope:
        if u.kind != "dir" or not u.selected:
            continue
        parent, _, name = u.rel.rpartition("/")
        step = _step(name)
        if step is None:
            continue
        k = (u.root.path, parent)
        if k not in best or step > best[k][0]:
            best[k] = (step, u.label)
    return sorted(v[1] for v in best.values())


FINAL_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth")   # what save_model leaves at the top
FINAL_NAMED = ("adapter_config.json", "config.json")                # named beside the weights
FINAL_MAX_NAMES = 6


def final_saves(scope: Iterable[Unit]) -> list[str]:
    """What each run folder holds at its top when the training ended (`trainer.save_model(output_dir)`:
    the adapter or the model, and *results.json), one line each: `run1: adapter_config.json,
    adapter_model.safetensors`, or `run2: no final save (newest complete checkpoint: run2/checkpoint-10)`.
    A run folder is a folder holding checkpoint-N folders, or weights at its top."""
    names: dict[tuple[str, str], set[str]] = {}
    newest: dict[tuple[str, str], tuple[int, str]] = {}
    labels: dict[tuple[str, str], str] = {}
    for u in scope:
        if not u.selected:
            continue
        if u.kind == "dir":
            parent, _, name = u.rel.rpartition("/")
            step = _step(name)
            if step is not None:
                k = (u.root.path, parent)
                names.setdefault(k, set())
                if u.verdict.complete and (k not in newest or step > newest[k][0]):
                    newest[k] = (step, u.label)
                labels[k] = join_key(u.root.prefix, parent) or os.path.basename(u.root.path)
                continue
            k, top = (u.root.path, u.rel), [s.rel for s in u.selected if "/" not in s.rel]  # an adapter folder
        else:
            parent, _, name = u.rel.rpartition("/")
            k, top = (u.root.path, parent), [name]
        names.setdefault(k, set()).update(top)
        labels[k] = join_key(u.root.prefix, k[1]) or os.path.basename(u.root.path)
    out = []
    for k in sorted(names):
        got = sorted(names[k])
        weights = [n for n in got if n.lower().endswith(FINAL_WEIGHTS) and n != "training_args.bin"]
        if weights:
            shown = sorted({*weights, *(n for n in got if n in FINAL_NAMED or n.endswith("results.json"))})
            more = len(shown) - FINAL_MAX_NAMES
            out.append(f"{labels[k]}: {', '.join(shown[:FINAL_MAX_NAMES])}" + (f" and {more} more" if more > 0 else ""))
        elif k in newest:
            out.append(f"{labels[k]}: no final save (newest complete checkpoint: {newest[k][1]})")
        else:
            out.append(f"{labels[k]}: no final save and no complete checkpoint")
    return out


def _step(name: str) -> int | None:
    if name.startswith("checkpoint-") and name[11:].isdigit():
        return int(name[11:])
    return None


def wanted(units: Iterable[Unit], synced: Callable[[Unit], bool]) -> frozenset[str]:
    """The units a `sync --wait` waits for: those complete now, or about to be (their writer just
    went quiet), or held back by a damaged file (it must hear why), and not on the target yet."""
    return frozenset(u.key for u in units if u.selected and not u.retired and not synced(u)
                     and (u.verdict.complete or u.verdict.partial or u.verdict.ready_in is not None
                          or bool(u.verdict.damaged)))


def unsynced_units(units: Iterable[Unit], current: Current) -> list[str]:
    """One line per folder (or single file) with files only on this machine: what a failed
    `sync --wait` names, instead of every file of every checkpoint."""
    out = []
    for u in units:
        if u.retired or not u.selected:
            continue
        missing = [s for s in u.selected if not holds(current, s)]
        if missing:
            out.append(f"{u.abspath}: {len(missing)} of {len(u.selected)} files not on the target "
                       f"({format_bytes(sum(s.size for s in missing))}; {u.verdict.reason})")
    return sorted(out)
