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

The document itself (build, parse, digest) is manifest_doc.py, pure; this module checks a folder
against it and is the command line above.
"""

from __future__ import annotations

import hashlib
import os
import sys

from supervisor.saves.manifest_doc import (
    FORMAT,
    LINKS_MAX,
    STATE_MAX,
    STATE_NAME,
    ManifestFile,
    build,
    digest,
    parse,
    parse_doc,
    state_facts,
    trainer_facts,
)
from supervisor.sync.policy import MANIFEST_NAME
from supervisor.untrusted.fileopen import open_regular

__all__ = ["FORMAT", "LINKS_MAX", "STATE_MAX", "STATE_NAME", "ManifestFile", "build", "check_folder", "digest", "parse", "parse_doc",
           "state_facts", "trainer_facts"]

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
