"""A unit of a run on several machines: complete only when every node's part is. Pure.

On the target, node k's part of unit U is `node-<k>/U/` with its own manifest, written by node k
after every file of its part was verified there. No node alone can say U is complete (each holds
only its own ranks' shards), so the run-wide record `_cluster/U.json` is written (by rank 0) only
once every node's part is verified (cluster/nodes.unit_whole) and the union of the parts holds
every rank's files and the files only one rank writes (`covers`); a resume takes one unit for the
whole run (`run_choice`): the newest with a record, or whose every part's manifest, read afresh,
says complete (rank 0 may have been the node that died).

Everything read here came from the target: any writer of the bucket may have put it there. A
record that is not ours (not JSON, not an object, another unit's, unsigned where the run has a
key) is no record, never an error that stops the check. The caller reads; nothing here does I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from supervisor.config.cluster import PART_PREFIX
from supervisor.saves import formats as fm
from supervisor.saves.manifest_doc import digest, parse_doc
from supervisor.store.keys import MANIFEST_NAME
from supervisor.untrusted import Unreadable, json_object, signed

RECORD_MAX = 1 << 20  # a run-wide record names one digest per node
RECORD_DEPTH = 4
RECORDS = "_cluster"
RECORD_FORMAT = "train-supervisor-run-unit/1"
NONE = "none"         # a node that never held any of the unit
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Held:
    """What this node says of its units in its heartbeat (the sync engine's answer)."""

    scanned: bool                              # its first scan ended: before it, nothing is known
    units: tuple[tuple[str, str], ...] = ()    # (unit, its part's digest when verified on the target, else "")
    lost: tuple[str, ...] = ()                 # units deleted here before they were sent


def record_key(unit: str) -> str:
    return f"{RECORDS}/{unit}.json"


def part_manifest(rank: int, unit: str) -> str:
    return f"{PART_PREFIX}{rank}/{unit}/{MANIFEST_NAME}"


def part_files(manifest: bytes | None) -> tuple[str, list[str]]:
    """(the digest of a part whose manifest says complete, its files' paths), else ("", [])."""
    if manifest is None:
        return "", []
    try:
        doc, files = parse_doc(manifest)
    except ValueError:  # Unreadable included: a stranger's bytes are no manifest
        return "", []
    if doc.get("complete") is not True or not files:
        return "", []
    return digest(files), [f.path for f in files]


def part_digest(manifest: bytes | None) -> str:
    """The digest of a part whose manifest says complete (its file list's), else ""."""
    return part_files(manifest)[0]


def record_doc(unit: str, run_id: str, digests: dict[int, str], at: str, key: bytes | None = None) -> bytes:
    doc = {"format": RECORD_FORMAT, "unit": unit, "run_id": run_id, "created_at": at,
           "parts": {str(k): v for k, v in sorted(digests.items())}}
    return json.dumps(signed.seal(key, RECORD_FORMAT, doc), indent=1).encode()


def read_record(data: bytes | None, unit: str, nodes: int, key: bytes | None = None) -> tuple[dict[int, str] | None, str]:
    """(every node's part digest or "none", "") when the record is ours, for this unit, and names a
    part of every node; else (None, why not: "" when there is none)."""
    if data is None:
        return None, ""
    try:
        doc = json_object(data, limit=RECORD_MAX, depth=RECORD_DEPTH, what=f"the run-wide record of {unit[:200]}")
    except Unreadable as e:
        return None, str(e)
    why = signed.check(key, RECORD_FORMAT, doc)
    if why:
        return None, f"the run-wide record of {unit[:200]} is {why}"
    parts = doc.get("parts")
    if doc.get("format") != RECORD_FORMAT or doc.get("unit") != unit or not isinstance(parts, dict):
        return None, f"the run-wide record of {unit[:200]} is not one (another format or unit)"
    out: dict[int, str] = {}
    for k in range(nodes):
        v = parts.get(str(k))
        if not isinstance(v, str) or not (v == NONE or _DIGEST.match(v)):
            return None, f"the run-wide record of {unit[:200]} names no part of node {k}"
        out[k] = v
    if all(v == NONE for v in out.values()):
        return None, f"the run-wide record of {unit[:200]} names no part at all"
    return out, ""


def record_names_all(data: bytes | None, unit: str, nodes: int, key: bytes | None = None) -> bool:
    """The record is ours, for this unit, and names a complete part (or none) of every node."""
    return read_record(data, unit, nodes, key)[0] is not None


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


# --- the union of the parts ------------------------------------------------------------------------
def covers(files: Mapping[int, list[str]], world: int | None) -> str:
    """"" when the union of the nodes' parts (node -> the paths its manifest lists, relative to
    the unit) holds what the trainer's own rule asks of the whole checkpoint: every rank's
    DeepSpeed shards and each model-parallel rank's model states, the coordinator's .metadata
    beside every folder of DCP shards, every process's Accelerate random states and the Trainer's
    trainer_state.json; else what is missing, wherever the trainer wrote it (a shared disk puts
    every file in every part, a node-local one each rank's in its own node's)."""
    names = sorted({n for paths in files.values() for n in paths})
    folders: dict[str, set[str]] = {}
    for r in names:
        d, _, n = r.rpartition("/")
        folders.setdefault(d, set()).add(n)
    for d, here in sorted(folders.items()):
        where = f"{d}/" if d else ""
        if any(fm.DCP_SHARD.search(n) for n in here) and fm.DCP_METADATA not in here:
            return f"{where}{fm.DCP_METADATA} in no node's part (the coordinator, rank 0, writes it last)"
        why = _deepspeed_union(where, here, world)
        if why:
            return why
    top = folders.get("", set())
    for rx, what in ((fm.ACCEL_RNG, "random_states_{}.pkl"), (fm.HF_RNG, "rng_state_{}.pth")):
        got = {int(m.group(1)) for n in top if (m := rx.match(n)) and len(m.group(1)) <= 7}
        if not got:
            continue
        w = world or max(got) + 1
        if w > fm.RANKS_MAX:
            return f"{what.format('N')} of {w} processes, more than any run has"
        missing = next((r for r in range(w) if r not in got), None)  # stops at the first gap
        if missing is not None:
            return f"{what.format(missing)} in no node's part (process {missing} of {w} writes it)"
        if what.startswith("rng") and fm.HF_STATE not in top:
            return f"{fm.HF_STATE} in no node's part (the main process writes it last)"
    return ""


def _deepspeed_union(where: str, here: set[str], world: int | None) -> str:
    shards: set[tuple[int, int]] = set()
    owned: set[tuple[int, int]] = set()
    models: set[int] = set()
    for n in here:
        m = fm.DS_SHARD.match(n) or fm.DS_RANK_MODEL.match(n) or fm.DS_MODEL.match(n)
        if m is None:
            continue
        if any(len(g) > 7 for g in m.groups()):
            return f"{where}{n[:80]} to name a rank any run has"
        if n.endswith("_optim_states.pt"):
            shards.add((int(m.group(1)), int(m.group(2))))
        elif n.startswith("zero_pp_rank_"):
            owned.add((int(m.group(1)), int(m.group(2))))
        else:
            models.add(int(m.group(1)))
    if not (shards or owned or models):
        return ""
    mps = max((mp for _, mp in (*shards, *owned)), default=max(models, default=0)) + 1
    dps = (world // mps if world and world % mps == 0 else 0) or max((dp for dp, _ in (*shards, *owned)), default=0) + 1
    if dps * mps > fm.RANKS_MAX:
        return f"{where}shards of {dps * mps} ranks, more than any run has"
    for mp in range(mps):
        if mp not in models and not owned:
            return f"{where}mp_rank_{mp:02d}_model_states.pt in no node's part (data-parallel rank 0 writes it)"
    for have, what in ((shards, "optim"), (owned, "model")):
        if not have:
            continue
        for mp in range(mps):  # stops at the first rank missing: at most len(have) + 1 turns
            for dp in range(dps):
                if (dp, mp) not in have:
                    return (f"rank {dp * mps + mp} of {dps * mps}: {where}zero_pp_rank_{dp}_mp_rank_{mp:02d}_{what}"
                            "_states.pt in no node's part")
    return ""


# --- one unit for the whole run --------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    unit: str                  # the run's unit ("" when none is whole)
    mine: str                  # this node's part of it: its digest, NONE, or "" when none is whole
    skipped: tuple[tuple[str, str], ...] = ()   # newer units, each with why it is not whole


def run_choice(candidates: list[str], record: Callable[[str], tuple[dict[int, str] | None, str]],
               parts_now: Callable[[str], dict[int, str]], nodes: int, me: int) -> Choice:
    """The newest of `candidates` (newest first) that is whole on the run, the same answer on
    every node from the same target: by its record, when every part the record names is on the
    target as recorded (`parts_now`: node -> digest of its complete part now, absent when not);
    else when every node's part is complete there now. The node's own part may be "none" (it
    never held the unit): then it restores nothing, and never an older unit."""
    skipped: list[tuple[str, str]] = []
    for u in candidates:
        rec, why = record(u)
        now = parts_now(u)
        if rec is not None:
            changed = [k for k, d in rec.items() if d != NONE and now.get(k) != d]
            if not changed:
                return Choice(u, rec[me], tuple(skipped))
            why = f"node {changed[0]}'s part is no longer on the target as the run-wide record names it"
        elif all(now.get(k) for k in range(nodes)):
            return Choice(u, now[me], tuple(skipped))
        else:
            k = next(k for k in range(nodes) if not now.get(k))
            why = (why + "; " if why else "") + f"node {k}'s part is not complete on the target"
        skipped.append((u, why))
    return Choice("", "", tuple(skipped))
