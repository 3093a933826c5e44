"""Which local checkpoints may be deleted, and which go first.

A local checkpoint may be deleted only when all of these hold:
  (a) the target holds the unit complete per its manifest, and
  (b) a content check against the target passed just before (the sync engine's, as the final
      sync verifies) -- both are the `Proof` the shell hands in, for exactly the files here;
  (c) it is not among the newest `keep_local` checkpoints (by step);
  (d) it is not the Trainer's `best_model_checkpoint`;
  (e) nothing is writing into it.
Oldest first, and (when freeing space for the next save) only until enough is free.

Pure: no I/O, no clock reads."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Local:
    """A checkpoint folder on this machine."""

    path: str
    step: int
    bytes: int
    writing: bool = False    # incomplete (no trainer_state.json), changed lately, or a file open for writing


@dataclass(frozen=True)
class Proof:
    """The sync engine's answer for one folder: the target holds it complete per its manifest and a
    content check against the target just passed (ok), or why not."""

    ok: bool
    reason: str = ""


@dataclass
class Plan:
    delete: list[str] = field(default_factory=list)       # paths, oldest first
    kept: dict[str, str] = field(default_factory=dict)    # path -> why it stays
    freed: int = 0
    enough: bool = True                                   # free + freed covers the need


def protected(local: Iterable[Local], best: set[str], keep_local: int) -> tuple[list[Local], dict[str, str]]:
    """Conditions (c), (d), (e): the checkpoints that may be deleted once proven off the machine,
    oldest first, and why each other one stays."""
    ordered = sorted(local, key=lambda c: (c.step, c.path))
    newest = {c.path for c in ordered[-keep_local:]} if keep_local > 0 else set()
    out: list[Local] = []
    kept: dict[str, str] = {}
    for c in ordered:
        if c.path in newest:
            kept[c.path] = f"among the newest {keep_local} (disk.keep_local)"
        elif c.path in best:
            kept[c.path] = "the Trainer's best_model_checkpoint"
        elif c.writing:
            kept[c.path] = "being written"
        else:
            out.append(c)
    return out, kept


def to_check(local: Iterable[Local], best: set[str], keep_local: int, free: int, need: int | None,
             on_target: Iterable[str]) -> list[str]:
    """The folders worth a content check now, oldest first: deletable but for the proof, believed
    on the target (the ledger), and only as many as the need asks (all when need is None)."""
    believed = set(on_target)
    out, got = [], free
    for c in protected(local, best, keep_local)[0]:
        if need is not None and got >= need:
            break
        if c.path in believed:
            out.append(c.path)
            got += c.bytes
    return out


def plan(local: Iterable[Local], best: set[str], keep_local: int, proofs: dict[str, Proof], free: int,
         need: int | None) -> Plan:
    """What to delete now. need=None (by hand): every checkpoint allowed; otherwise oldest first
    until free space covers `need`."""
    cands, kept = protected(local, best, keep_local)
    p = Plan(kept=kept)
    for c in cands:
        if need is not None and free + p.freed >= need:
            p.kept[c.path] = "not needed: enough free space"
            continue
        proof = proofs.get(c.path)
        if proof is None:
            p.kept[c.path] = "not verified on the target"
        elif not proof.ok:
            p.kept[c.path] = proof.reason or "not verified on the target"
        else:
            p.delete.append(c.path)
            p.freed += c.bytes
    p.enough = need is None or free + p.freed >= need
    return p
