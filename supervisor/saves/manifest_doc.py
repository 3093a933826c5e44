"""The manifest document: its file list, its digest, building it and parsing what a target hands
back. Pure: bytes and values in and out (sync/manifest.py checks a folder against one; the engine
writes them).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from supervisor.saves.complete import HF_LAST_FILE
from supervisor.timefmt import utc_stamp
from supervisor.untrusted import Unreadable, finite_int, int_or_none, json_doc, json_object
from supervisor.untrusted.names import BadName, check_tree, problem, remote_path, shown

FORMAT = "train-supervisor-manifest/1"
STATE_NAME = HF_LAST_FILE           # the HF Trainer's trainer_state.json; its step ranks a unit
STATE_MAX = 16 << 20                # a trainer_state.json larger than this is not read for its step
MANIFEST_MAX = 64 << 20             # a manifest larger than this is not one of ours
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ManifestFile:
    path: str      # relative to the folder, POSIX
    size: int
    sha256: str


def digest(files: list[ManifestFile]) -> str:
    """A fingerprint of the content list alone (not of the timestamp), to tell whether a folder's
    manifest on the target still describes it."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return h.hexdigest()


def build(unit: str, files: list[ManifestFile], created_at: float, host: str = "", source: str = "",
          damaged: tuple[str, ...] = (), partial: str = "", trainer: tuple[int, int | None] | None = None,
          kind: str = "dir", links: tuple[str, ...] = (), step_seen: int | None = None) -> bytes:
    """The manifest of a folder; with `damaged` (files that failed their format check) or a
    `partial` reason it says the folder is not complete. `trainer`: (global_step, max_steps) from
    the folder's trainer_state.json as it went up, so that a restore ranks the units on the
    target from their manifests alone (state_facts). `kind` "file": the manifest of a single-file
    unit, beside it (policy.manifest_key); its one file's path is the file's name. `links`: the
    names of the symbolic links beside that file that point at it (Lightning's `save_last="link"`
    makes `last.ckpt` one), so that a restore makes them again. `step_seen`: the training's step when
    the unit was saved, as the daemon read it from the training's log or trackers, for a unit whose
    name and files state none."""
    fs = sorted(files, key=lambda f: f.path)
    doc: dict = {
        "format": FORMAT,
        "complete": not damaged and not partial,
        "unit": unit,
        **({"kind": "file"} if kind == "file" else {}),
        **({"links": sorted(links)} if kind == "file" and links else {}),
        "created_at": utc_stamp(created_at),
        "host": host,
        "source": source,
        "file_count": len(fs),
        "total_bytes": sum(f.size for f in fs),
        "digest": digest(fs),
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in fs],
    }
    if trainer is not None:
        doc["trainer_state"] = {"global_step": trainer[0], **({"max_steps": trainer[1]} if trainer[1] else {})}
    if step_seen is not None and step_seen >= 0:
        doc["step_seen"] = step_seen
    if damaged or partial:
        doc["partial"] = partial or "damaged files"
        doc["damaged"] = sorted(damaged)
    return (json.dumps(doc, indent=1) + "\n").encode()


def parse(data: bytes) -> list[ManifestFile]:
    """The files a manifest lists; ValueError naming what is wrong."""
    return parse_doc(data)[1]


def parse_doc(data: bytes) -> tuple[dict, list[ManifestFile]]:
    """The manifest's document and its files; ValueError naming what is wrong."""
    try:
        doc = json_doc(data, limit=MANIFEST_MAX, what="manifest")
    except Unreadable as e:
        raise Unreadable(f"manifest is not readable: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise Unreadable("not a train-supervisor manifest")
    out = []
    files = doc.get("files") or []
    if not isinstance(files, list):
        raise Unreadable("manifest 'files' is not a list")
    for i, f in enumerate(files):
        try:
            path, size, sha = f["path"], f["size"], f["sha256"]
        except (KeyError, TypeError):
            raise Unreadable(f"manifest entry {i} is malformed") from None
        # the target's words, not ours: checked before anything joins them to a folder here
        try:
            rel = remote_path(path, f"manifest entry {i}: the path")
        except BadName as e:
            raise Unreadable(str(e)) from None
        if type(size) is not int or size < 0:
            raise Unreadable(f"manifest entry {i} ({shown(path)}): size {shown(size)} is not a byte count")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise Unreadable(f"manifest entry {i} ({shown(path)}): sha256 {shown(sha)} is not 64 hex digits")
        out.append(ManifestFile(rel, size, sha))
    clash = check_tree([f.path for f in out])  # type: ignore[misc]
    if clash:
        raise Unreadable(f"manifest {clash}")
    if doc.get("digest") and doc["digest"] != digest(out):
        raise Unreadable("manifest digest does not match its file list")
    return doc, out


LINKS_MAX = 16  # links a manifest may ask a restore to make beside its file


def seen_step(doc: dict) -> int | None:
    """What build(step_seen=...) put in a manifest; None when absent or not a step."""
    return int_or_none(doc.get("step_seen"), lo=0)


def links_of(doc: dict) -> tuple[str, ...]:
    """The link names a single file's manifest lists: plain names (no folder, nothing a path check
    refuses), at most LINKS_MAX; () for anything else. The target's words: a restore makes only
    links to the restored file itself, beside it."""
    raw = doc.get("links")
    if doc.get("kind") != "file" or not isinstance(raw, list):
        return ()
    out = []
    for n in raw[:LINKS_MAX]:
        if isinstance(n, str) and not problem(n) and "/" not in n:
            out.append(n)
    return tuple(out)


def state_facts(data: bytes | None) -> tuple[int, int | None] | None:
    """(global_step, max_steps or None) of a trainer_state.json; None when it says neither."""
    if data is None:
        return None
    try:
        doc = json_object(data, limit=STATE_MAX, what=STATE_NAME)
        step = finite_int(doc.get("global_step"), what="global_step")
    except Unreadable:
        return None
    mx = int_or_none(doc.get("max_steps"), lo=1)
    return step, mx


def trainer_facts(doc: dict) -> tuple[int, int | None] | None:
    """What build(trainer=...) put in a manifest: (global_step, max_steps or None), or None when the
    manifest says nothing of it (an older one, or not an HF Trainer's folder) or says it wrongly."""
    t = doc.get("trainer_state")
    if not isinstance(t, dict):
        return None
    step = t.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    step = int_or_none(step)
    return None if step is None else (step, int_or_none(t.get("max_steps"), lo=1))
