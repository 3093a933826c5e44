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

`forced` (final sync: the writer is gone) skips the waiting and ignores leftover temp files: every
selected file goes up, because the machine's disk may be the only copy. A checkpoint that never
got its `trainer_state.json`, or holds a file that fails its format check (truncated, damaged, or
a format this checker cannot read), is *partial*: its files go up all the same, it never gets a
"complete" manifest, and the files that failed their check are named (`damaged`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from supervisor.sync.policy import is_temp_name
from supervisor.untrusted import (
    SAFETENSORS_PARSE_MAX,
    Unreadable,
    json_doc,
    safetensors_end,
    safetensors_header_len,
    zip_ends_whole,
)

FUTURE_SKEW_S = 5.0  # mtimes further ahead than this are a clock problem, not activity
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
          waiting: str = "") -> Verdict:
    """The verdict for one unit. `kind` is "dir" or "file"; `files` are all files observed in
    the unit (selected or not: any activity counts); `marker` is the file a `checkpoint-N`
    folder must hold (sync.complete_marker; "" = the quiet period alone decides); `fmt` and
    `waiting`: the unit's format and what its rule still waits for (formats.py; "" = holds)."""
    v = _judge(unit_name, kind, files, wall_now, mono_now, quiet, forced, marker, waiting)
    if fmt or (waiting and not v.complete):
        v = replace(v, format=fmt, waiting_for=waiting if not v.complete else "")
    return v


def _judge(unit_name: str, kind: str, files: list[FileObs], wall_now: float, mono_now: float,
           quiet: float, forced: bool, marker: str, waiting: str) -> Verdict:
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
        return Verdict(False, f"still writing ({temps[0]})", quiet)
    wait = 0.0
    for f in real:
        age = wall_now - f.mtime
        if age < -FUTURE_SKEW_S:
            age = float("inf")  # skewed mtime: only our own observation can tell
        wait = max(wait, quiet - age)
        if f.stable_since is not None:
            wait = max(wait, quiet - (mono_now - f.stable_since))
    if wait > 0:
        return Verdict(False, f"writer active (quiet in {wait:.0f}s)", wait)
    if truncated:
        return Verdict(False, f"{truncated[0]} is truncated", None, damaged=truncated)
    if marker_missing(unit_name, kind, real, marker):
        return Verdict(False, f"waiting for {marker}", None)
    if waiting:
        return Verdict(False, f"waiting for {waiting}", None)
    return Verdict(True, "complete")


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
    if low.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "zip"
    if low.endswith(".json"):
        return "json"
    return None
