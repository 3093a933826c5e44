"""A unit of a run on several machines: complete only when every node's part is. Pure.

On the target, node k's part of unit U is `node-<k>/U/` with its own manifest, written by node k
after every file of its part was verified there. No node alone can say U is complete (each holds
only its own ranks' shards), so the run-wide record `_cluster/U.json` is written (by rank 0) only
once every node's manifest says complete, and a resume takes a unit only when that record is there
or, read afresh, every part's manifest says complete (rank 0 may have been the node that died).

The caller reads; nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from supervisor.config.cluster import PART_PREFIX
from supervisor.sync.manifest_doc import digest, parse_doc
from supervisor.sync.policy import MANIFEST_NAME
from supervisor.untrusted import Unreadable, json_object

RECORD_MAX = 1 << 20  # a run-wide record names one digest per node

RECORDS = "_cluster"
RECORD_FORMAT = "train-supervisor-run-unit/1"


def record_key(unit: str) -> str:
    return f"{RECORDS}/{unit}.json"


def part_manifest(rank: int, unit: str) -> str:
    return f"{PART_PREFIX}{rank}/{unit}/{MANIFEST_NAME}"


def part_digest(manifest: bytes | None) -> str:
    """The digest of a part whose manifest says complete (its file list's), else ""."""
    if manifest is None:
        return ""
    try:
        doc, files = parse_doc(manifest)
    except ValueError:
        return ""
    return digest(files) if doc.get("complete") is True and files else ""


def record_doc(unit: str, run_id: str, digests: dict[int, str], at: str) -> bytes:
    return json.dumps({"format": RECORD_FORMAT, "unit": unit, "run_id": run_id, "created_at": at,
                       "parts": {str(k): v for k, v in sorted(digests.items())}}, indent=1).encode()


def record_names_all(data: bytes | None, unit: str, nodes: int) -> bool:
    """The record is ours, for this unit, and names a complete part of every node."""
    if data is None:
        return False
    try:
        doc = json_object(data, limit=RECORD_MAX, what="a run-wide record")
    except Unreadable:
        return False
    parts = doc.get("parts")
    return (doc.get("format") == RECORD_FORMAT and doc.get("unit") == unit and isinstance(parts, dict)
            and all(isinstance(parts.get(str(k)), str) and parts[str(k)] for k in range(nodes)))


def whole(read: Callable[[str], bytes | None], nodes: int, unit: str) -> tuple[dict[int, str], str]:
    """Every node's part digest of `unit` as the target holds them now, or ({}, why not) naming
    the first node whose part is not complete there."""
    out: dict[int, str] = {}
    for k in range(nodes):
        d = part_digest(read(part_manifest(k, unit)))
        if not d:
            return {}, f"node {k}'s part is not complete on the target"
        out[k] = d
    return out, ""
