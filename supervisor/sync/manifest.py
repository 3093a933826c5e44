"""The small JSON file written LAST into every uploaded folder on the target.

Its presence says "this remote folder is complete"; its content (path, size, sha256 of every
file) lets anyone check the remote copy without trusting us:

    python -m supervisor.sync.manifest check /mnt/remote/checkpoint-1200

A folder on the target without `_MANIFEST.json` is partial (still uploading, or its writer never
finished it) and must not be used as a checkpoint. A final sync before a stop uploads every file
of a folder even when one fails its format check (the machine's disk may be the only copy); such
a folder's manifest says `"complete": false` and names those files under `"damaged"`, with the
reason under `"partial"`: its bytes are on the target exactly as they were on the machine, but it
is not a checkpoint to resume from blindly.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass

from supervisor.fileopen import open_regular
from supervisor.sync.names import BadName, check_tree, remote_path, shown
from supervisor.sync.policy import MANIFEST_NAME

FORMAT = "train-supervisor-manifest/1"
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
          damaged: tuple[str, ...] = (), partial: str = "") -> bytes:
    """The manifest of a folder; with `damaged` (files that failed their format check) or a
    `partial` reason it says the folder is not complete."""
    fs = sorted(files, key=lambda f: f.path)
    doc: dict = {
        "format": FORMAT,
        "complete": not damaged and not partial,
        "unit": unit,
        "created_at": dt.datetime.fromtimestamp(created_at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": host,
        "source": source,
        "file_count": len(fs),
        "total_bytes": sum(f.size for f in fs),
        "digest": digest(fs),
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in fs],
    }
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
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"manifest is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not a train-supervisor manifest")
    out = []
    files = doc.get("files") or []
    if not isinstance(files, list):
        raise ValueError("manifest 'files' is not a list")
    for i, f in enumerate(files):
        try:
            path, size, sha = f["path"], f["size"], f["sha256"]
        except (KeyError, TypeError):
            raise ValueError(f"manifest entry {i} is malformed") from None
        # the target's words, not ours: checked before anything joins them to a folder here
        try:
            rel = remote_path(path, f"manifest entry {i}: the path")
        except BadName as e:
            raise ValueError(str(e)) from None
        if type(size) is not int or size < 0:
            raise ValueError(f"manifest entry {i} ({shown(path)}): size {shown(size)} is not a byte count")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise ValueError(f"manifest entry {i} ({shown(path)}): sha256 {shown(sha)} is not 64 hex digits")
        out.append(ManifestFile(rel, size, sha))
    clash = check_tree([f.path for f in out])  # type: ignore[misc]
    if clash:
        raise ValueError(f"manifest {clash}")
    if doc.get("digest") and doc["digest"] != digest(out):
        raise ValueError("manifest digest does not match its file list")
    return doc, out


def check_folder(folder: str) -> list[str]:
    """Problems found comparing a local copy of a folder with its manifest; [] when it matches."""
    try:
        with open(os.path.join(folder, MANIFEST_NAME), "rb") as fh:
            doc, files = parse_doc(fh.read())
    except FileNotFoundError:
        return [f"{folder}: no {MANIFEST_NAME} (partial upload)"]
    except ValueError as e:
        return [f"{folder}: {e}"]
    problems = []
    if doc.get("complete") is not True:
        damaged = ", ".join(doc.get("damaged") or []) or "none named"
        problems.append(f"{folder}: not complete ({doc.get('partial') or 'partial'}; damaged: {damaged})")
    for f in files:
        p = os.path.join(folder, f.path)
        try:
            h = hashlib.sha256()
            n = 0
            with os.fdopen(open_regular(p), "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
                    n += len(chunk)
        except OSError as e:
            problems.append(f"{f.path}: {e.strerror or e}")
            continue
        if n != f.size:
            problems.append(f"{f.path}: size {n}, manifest says {f.size}")
        elif h.hexdigest() != f.sha256:
            problems.append(f"{f.path}: sha256 differs from the manifest")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "check":
        sys.stderr.write("usage: python -m supervisor.sync.manifest check FOLDER...\n")
        return 2
    bad = 0
    for folder in args[1:]:
        problems = check_folder(folder)
        for p in problems:
            sys.stderr.write(p + "\n")
        if problems:
            bad += 1
        else:
            sys.stdout.write(f"{folder}: OK\n")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
