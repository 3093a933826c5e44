"""Where the store keeps a unit's manifest: the names sync writes and resume reads.

Pure: names only.
"""

from __future__ import annotations

MANIFEST_NAME = "_MANIFEST.json"
# A single-file unit (a Lightning `.ckpt`, nanoGPT's `ckpt.pt`) has no folder of its own to hold a
# `_MANIFEST.json`: its manifest sits beside it, named for it (`ckpt.pt._MANIFEST.json`). The `.`
# before `_MANIFEST.json` tells it from a folder's manifest (`.../_MANIFEST.json`) in any listing.
FILE_MANIFEST_SUFFIX = "." + MANIFEST_NAME


def manifest_key(unit_key: str, kind: str = "dir") -> str:
    """Where a unit's manifest is on the target: `KEY/_MANIFEST.json` for a folder,
    `KEY._MANIFEST.json` beside a single file."""
    if kind == "file":
        return unit_key + FILE_MANIFEST_SUFFIX
    return f"{unit_key.strip('/')}/{MANIFEST_NAME}" if unit_key.strip("/") else MANIFEST_NAME
