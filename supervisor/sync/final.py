"""The final sync's bookkeeping: which files and manifests the target must hold for the folders
asked for, and what to forget when the target turns out to have lost some. Pure but for
`forget_lost`, which writes the ledger."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .ledger import Entry, Ledger
from .policy import MANIFEST_NAME
from .scan import Unit
from .targets.base import join_key

VERIFY_ROUNDS = 3        # re-upload what the target lost at most this often


@dataclass(eq=False)
class FinalJob:
    paths: list[str]
    deadline: float      # clock.monotonic()
    started_ok: int      # uploaded count when it began
    verify_rounds: int = 0


def uploaded(scope: Iterable[Unit], synced: Callable[[Unit], bool]) -> bool:
    """Is every unit of the scope judged (complete or partial) and on the target per the ledger?"""
    return all((u.verdict.complete or u.verdict.partial) and synced(u) for u in scope)


def expected(scope: Iterable[Unit], current: Callable[[str, int, int], Entry | None]) -> dict[str, tuple[int, str]]:
    """key -> (size, the target's fingerprint recorded at upload) of every file that went up."""
    out: dict[str, tuple[int, str]] = {}
    for u in scope:
        skip = set(u.verdict.skip)
        for s in u.selected:
            e = current(s.key, s.size, s.mtime_ns) if s.rel not in skip else None
            if e is not None:
                out[s.key] = (s.size, e.etag)
    return out


def manifest_units(scope: Iterable[Unit]) -> set[str]:
    """The unit keys whose manifest must be on the target (complete folders)."""
    return {u.key for u in scope if u.kind == "dir" and u.verdict.complete}


def manifest_keys(units: Iterable[str]) -> dict[str, tuple[int, str]]:
    """What to ask the target about the manifests: only that they exist."""
    return {join_key(k, MANIFEST_NAME): (-1, "") for k in units}


def manifest_unit(key: str) -> str | None:
    """The unit a lost key is the manifest of; None for a data file."""
    if key == MANIFEST_NAME:
        return ""
    if key.endswith("/" + MANIFEST_NAME):
        return key[: -len(MANIFEST_NAME) - 1]
    return None


def forget_lost(ledger: Ledger, lost: list[str], manifests: set[str]) -> None:
    """The target lost files the ledger says it holds: forget them (and the manifest of their
    folder) so the next pass sends them again, the manifest after them."""
    for k in lost:
        unit = manifest_unit(k)
        if unit is not None:
            ledger.manifest_forget(unit)
            continue
        ledger.forget(k)
        for uk in manifests:
            if not uk or k.startswith(uk + "/"):
                ledger.manifest_forget(uk)


def partial_notes(scope: Iterable[Unit]) -> list[str]:
    return [f"{u.label} (partial: {u.verdict.reason}; uploaded without manifest)" for u in scope if u.verdict.partial]
