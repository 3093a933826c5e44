"""Is a checkpoint folder (or a single file) complete? Pure functions of observations and `now`.

A unit is complete when all of these hold:
- it has at least one file, and no file in it has a temporary name;
- its writer has gone quiet: every file's mtime is at least `quiet` seconds old by the wall clock
  (an mtime far in the future, from a skewed clock, is ignored), and no file's size or mtime has
  been *seen* to change for `quiet` seconds (monotonic, so a clock step cannot fake it);
- every file whose format can tell says it is whole (a safetensors file has exactly the bytes its
  header promises; a torch zip archive ends with its central directory; a JSON file parses);
- a `checkpoint-N` folder has its `trainer_state.json`, which the HF Trainer writes last (model
  and tokenizer come first, so a pause after them must not look like the end). Other writers:
  set `sync.complete_marker` to their last file, or to "" for the quiet period alone.

A unit its format's own rule calls complete (formats.py: the Trainer's trainer_state.json, every
rank's shard, DCP's .metadata, Accelerate's random states of every process, Orbax's commit, a single
checkpoint file whole by its header) does not wait out the quiet period: a short settle (SETTLE_S)
does, with every file whole by its format check and seen unchanged at an earlier look. The quiet
period is the fallback for what no rule vouches for, and it adapts to the save cadence
(`adapted_quiet`): never longer than half the time between two saves of the same kind, so a trainer
that rotates its checkpoints every few seconds does not delete them before they are judged.

`forced` (final sync: the writer is gone) skips the waiting and ignores leftover temp files: every
selected file goes up, because the machine's disk may be the only copy. A checkpoint that never
got its `trainer_state.json`, or holds a file that fails its format check (truncated, damaged, or
a format this checker cannot read), is *partial*: its files go up all the same, it never gets a
"complete" manifest, and the files that failed their check are named (`damaged`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from supervisor.untrusted import (
    SAFETENSORS_PARSE_MAX,
    Unreadable,
    json_doc,
    safetensors_end,
    safetensors_header_len,
    zip_ends_whole,
)

# Names whose presence means "someone is still writing" and that are never uploaded as final.
_TEMP_RE = re.compile(
    r"""(?ix)
    ^tmp-checkpoint-.*$            # transformers' temporary checkpoint folder (some releases)
    | .*\.(tmp|temp|part|partial|incomplete|crdownload|lock|swp|swx)$
    | ^\.\#.*$ | .*~$ | ^\.~.*$     # editor backups and locks
    | ^\.nfs[0-9a-f]+.*$           # NFS silly-renamed files
    | ^\..+\.[A-Za-z0-9]{6}$       # rsync's in-progress name .NAME.XXXXXX
    | ^\..*\.tsync-[0-9a-f]+$      # our own in-progress name on a local target
    """
)


def is_temp_name(name: str) -> bool:
    return bool(_TEMP_RE.match(name))


FUTURE_SKEW_S = 5.0  # mtimes further ahead than this are a clock problem, not activity
# A unit complete by its format's own rule still waits this long after its last change: a file
# system with 1 s or 2 s mtime granularity (FAT, some network mounts) can leave a write in the
# same second looking older than it is, and the rule's files may land a moment apart (rank 0's
# custom_checkpoint_N.pkl after its random_states_0.pkl). Two seconds cover both, and still go
# up long before a rotation every few seconds deletes the save.
SETTLE_S = 2.0
LOOK_AGAIN_S = 0.5   # a unit complete by its rule but seen at one look only: looked at again this soon
CADENCE_GAPS = 4     # the quiet period follows the median of this many latest gaps between saves
CHECKPOINT_RE = re.compile(r"^checkpoint-\d+$")
HF_LAST_FILE = "trainer_state.json"  # what the Trainer writes last into checkpoint-N/


@dataclass(frozen=True)
class FileObs:
    rel: str                       # path inside the unit ("" prefix-free), POSIX
    size: int
    mtime: float                   # wall seconds
    stable_since: float | None     # monotonic time this (size, mtime) was first seen; None: already
                                   # settled when the engine first looked
    whole: bool | None = None      # format check: True whole, False truncated, None cannot tell


@dataclass(frozen=True)
class Verdict:
    complete: bool
    reason: str                    # why not (or "complete")
    ready_in: float | None = None  # seconds until it may become complete if nothing changes
    partial: bool = False          # forced, but can never be complete: upload without a manifest
    damaged: tuple[str, ...] = ()  # files that fail their format check (not whole, or unreadable as such)
    format: str = ""               # the trainer's format the unit is judged by (formats.py)
    waiting_for: str = ""          # what its format's rule still waits for ("rank 3 of 4: ... missing")
    quiet: float | None = None     # the quiet period it was judged by (after the settle or the cadence)


def needs_marker(unit_name: str, marker: str) -> bool:
    """A `checkpoint-N` folder is only complete once its writer's last file is there."""
    return bool(marker) and bool(CHECKPOINT_RE.match(unit_name.rsplit("/", 1)[-1]))


def temp_files(files: list[FileObs]) -> list[str]:
    """The files under a temporary name anywhere in their path (a save still being written)."""
    return [f.rel for f in files if any(is_temp_name(p) for p in f.rel.split("/"))]


def marker_missing(unit_name: str, kind: str, files: list[FileObs], marker: str) -> bool:
    """A `checkpoint-N` folder whose writer's last file (`marker`) is not among `files` yet."""
    return kind == "dir" and needs_marker(unit_name, marker) and not any(f.rel == marker for f in files)


def judge(unit_name: str, kind: str, files: list[FileObs], wall_now: float, mono_now: float,
          quiet: float, forced: bool = False, marker: str = HF_LAST_FILE, fmt: str = "",
          waiting: str = "", by_rule: bool = False, seen_before: bool = False) -> Verdict:
    """The verdict for one unit. `kind` is "dir" or "file"; `files` are all files observed in
    the unit (selected or not: any activity counts); `marker` is the file a `checkpoint-N`
    folder must hold (sync.complete_marker; "" = the quiet period alone decides); `fmt` and
    `waiting`: the unit's format and what its rule still waits for (formats.py; "" = holds);
    `by_rule`: the format's own rule says complete (formats.Rule.positive); `seen_before`: every
    file was already there, as it is now, at an earlier look."""
    v = _judge(unit_name, kind, files, wall_now, mono_now, quiet, forced, marker, waiting, by_rule, seen_before)
    if fmt or (waiting and not v.complete):
        v = replace(v, format=fmt, waiting_for=waiting if not v.complete else "")
    return v


def _judge(unit_name: str, kind: str, files: list[FileObs], wall_now: float, mono_now: float,
           quiet: float, forced: bool, marker: str, waiting: str, by_rule: bool = False,
           seen_before: bool = False) -> Verdict:
    if not files:
        return Verdict(False, "empty")
    temps = temp_files(files)
    real = [f for f in files if f.rel not in temps]
    if not real:
        return Verdict(False, f"only temporary files ({temps[0]})", None if forced else quiet)
    truncated = tuple(f.rel for f in real if f.whole is False)

    if forced:
        missing = marker_missing(unit_name, kind, real, marker)
        if missing or truncated or waiting:
            why = f"never finished: no {marker}" if missing else f"truncated or damaged: {truncated[0]}" \
                if truncated else f"never finished: waiting for {waiting}"
            return Verdict(False, why, None, partial=True, damaged=truncated)
        return Verdict(True, "complete")

    if temps:
        return Verdict(False, f"still writing ({temps[0]})", quiet, quiet=quiet)
    wait = quiet_left(real, wall_now, mono_now, quiet)
    used = quiet
    if wait > 0 and by_rule and not waiting and not marker_missing(unit_name, kind, real, marker) \
            and whole_by_format(real):
        used = min(quiet, SETTLE_S)
        settle = quiet_left(real, wall_now, mono_now, used)
        if settle <= 0 and not seen_before:
            # quiet by the settle, but looked at once only: one more look must find it unchanged
            return Verdict(False, "complete by its format's rule: looking once more", LOOK_AGAIN_S, quiet=used)
        wait = settle
    if wait > 0:
        return Verdict(False, f"writer active (quiet in {wait:.0f}s)", wait, quiet=used)
    if truncated:
        return Verdict(False, f"{truncated[0]} is truncated", None, damaged=truncated, quiet=used)
    if marker_missing(unit_name, kind, real, marker):
        return Verdict(False, f"waiting for {marker}", None, quiet=used)
    if waiting:
        return Verdict(False, f"waiting for {waiting}", None, quiet=used)
    return Verdict(True, "complete", quiet=used)


def quiet_left(files: list[FileObs], wall_now: float, mono_now: float, quiet: float) -> float:
    """Seconds until every file has been quiet for `quiet`: by its mtime (the wall clock) and by
    the time its size and mtime were first seen as they are (monotonic)."""
    wait = 0.0
    for f in files:
        age = wall_now - f.mtime
        if age < -FUTURE_SKEW_S:
            age = float("inf")  # skewed mtime: only our own observation can tell
        wait = max(wait, quiet - age)
        if f.stable_since is not None:
            wait = max(wait, quiet - (mono_now - f.stable_since))
    return wait


def whole_by_format(files: list[FileObs]) -> bool:
    """Every file whose format can tell says it is whole (a file not checked yet, or too large to
    check, is not known whole: the quiet period decides for its unit)."""
    return all(f.whole is True for f in files if checkable(f.rel.rsplit("/", 1)[-1]) is not None)


def adapted_quiet(configured: float, starts: Iterable[float], settle: float = SETTLE_S) -> float:
    """The quiet period for a unit whose kind of save (same folder, same name but for its numbers)
    started at the wall times `starts`: never longer than half the usual gap between two saves
    (the median of the latest CADENCE_GAPS), never shorter than `settle`, never longer than
    `configured`. Starts closer than `settle` are one save (ranks writing their files at once).
    A trainer saving every 7 s with a rotation of 2 deletes each save 14 s after it began: a 30 s
    quiet period would lose every one of them, 3.5 s loses none."""
    saves: list[float] = []
    for s in sorted(x for x in starts if math.isfinite(x)):
        if not saves or s - saves[-1] >= settle:
            saves.append(s)
    gaps = [b - a for a, b in zip(saves, saves[1:], strict=False)][-CADENCE_GAPS:]
    if not gaps or not math.isfinite(configured):
        return configured
    gaps.sort()
    mid = len(gaps) // 2
    gap = gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2
    return min(configured, max(settle, gap / 2))


# --- format checks (pure: given the bytes read from the file; supervisor.untrusted reads them) ---

def safetensors_whole(first8: bytes, header: bytes, size: int) -> bool | None:
    """True when the file holds exactly the bytes its header promises (8 + header + data); None
    when the header is too large to be worth parsing (the quiet period decides)."""
    n = safetensors_header_len(first8)
    if n is None or len(header) < n:
        return False
    if n > SAFETENSORS_PARSE_MAX:
        return None
    try:
        return size == 8 + n + safetensors_end(header[:n])
    except Unreadable:
        return False


def zip_whole(tail: bytes) -> bool:
    """True when `tail` (the last bytes of a zip file, up to ZIP_TAIL) ends with a consistent
    end-of-central-directory record: torch.save's archive format is only whole once it is."""
    return zip_ends_whole(tail)


MAX_JSON_CHECK = 16 * 1024 * 1024


def json_whole(data: bytes) -> bool:
    """A JSON file cut short does not parse (trainer_state.json, adapter_config.json); nor does one
    nested beyond reason or holding numbers out of range."""
    try:
        json_doc(data, limit=MAX_JSON_CHECK, depth=1000)  # whole is all it asks: any depth that parses
    except Unreadable:
        return False
    return True


# A file whose blocks on disk are far fewer than its length says (`truncate -s 1T`, a preallocated
# file never filled) would cost its whole apparent size in upload and storage. A real checkpoint
# file is written out; a compressing file system (ZFS, btrfs) shrinks weights by well under 8x.
SPARSE_MIN = 64 << 20


def sparse(size: int, allocated: int) -> bool:
    """Is a file of `size` bytes with `allocated` bytes on disk too hollow to upload by default?"""
    return size >= SPARSE_MIN and allocated * 8 < size


def damage_words(name: str) -> str:
    """What a failed format check means for this kind of file, for people."""
    kind = checkable(name)
    if kind == "json":
        return "is not valid JSON (cut short or damaged)"
    if kind == "safetensors":
        return "does not hold the bytes its safetensors header promises (cut short, damaged or an unknown format)"
    if kind == "zip":
        return "has no zip end record (cut short or damaged)"
    return "fails its format check"


def checkable(name: str) -> str | None:
    """Which format check applies to a file name: "safetensors", "zip" (torch archives),
    "json", or None."""
    low = name.lower()
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith((".pt", ".pth", ".bin", ".ckpt", ".pkl")):
        return "zip"  # torch.save's archive (Accelerate's random_states_N.pkl too); a bare pickle: no check
    if low.endswith(".json"):
        return "json"
    return None
