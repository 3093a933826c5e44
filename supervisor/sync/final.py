"""The final sync's bookkeeping: which files and manifests the target must hold for the folders
asked for, and what to forget when the target turns out to have lost some. Pure but for
`forget_lost`, which writes the ledger."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from supervisor.interfaces import FinalSyncResult
from supervisor.sync.ledger import Entry, Ledger
from supervisor.sync.policy import FILE_MANIFEST_SUFFIX, MANIFEST_NAME, manifest_key
from supervisor.sync.scan import Unit, final_saves, holds, needs_manifest, newest_checkpoints

VERIFY_ROUNDS = 3        # re-upload what the target lost at most this often


@dataclass(eq=False)
class FinalJob:
    paths: list[str]
    deadline: float      # clock.monotonic()
    started_ok: int      # uploaded count when it began
    verify_rounds: int = 0
    verified: frozenset | None = None  # the scope's fingerprint when the target last held all of it


def fingerprint(scope: Iterable[Unit]) -> frozenset:
    """What a rescan must find unchanged before a final sync may say ok: every unit of the scope,
    how it was judged, and the version of each of its selected files."""
    return frozenset((u.key, u.verdict.complete, u.verdict.partial,
                      tuple(sorted((s.key, s.size, s.mtime_ns) for s in u.selected))) for u in scope)


def uploaded(scope: Iterable[Unit], synced: Callable[[Unit], bool]) -> bool:
    """Is every unit of the scope judged (complete or partial) and on the target per the ledger?"""
    return all((u.verdict.complete or u.verdict.partial) and synced(u) for u in scope)


def expected(scope: Iterable[Unit], current: Callable[[str, int, int], Entry | None]) -> dict[str, tuple[int, str]]:
    """key -> (size, the target's fingerprint recorded at upload) of every file that went up."""
    out: dict[str, tuple[int, str]] = {}
    for u in scope:
        for s in u.selected:
            e = holds(current, s)
            if e is not None:
                out[s.key] = (s.size, e.etag)
    return out


def unchecked(expected: Iterable[str], get: Callable[[str], Entry | None]) -> set[str]:
    """The keys whose copy on the target was not checked by content since it was sent: what a
    final sync checks by content. The rest were, in an earlier final sync, and are checked by the
    target's cheap means (so a stop costs what is new, not everything kept)."""
    return {k for k in expected if (e := get(k)) is None or not e.checked}


def versions(keys: Iterable[str], get: Callable[[str], Entry | None]) -> dict[str, str]:
    """key -> the sha256 of the version the ledger holds: what a content check vouched for."""
    return {k: e.sha256 for k in keys if (e := get(k)) is not None and e.sha256}


def manifest_units(scope: Iterable[Unit]) -> dict[str, str]:
    """The unit keys whose manifest must be on the target, each with its kind ("dir", "file")."""
    return {u.key: u.kind for u in scope if needs_manifest(u)}


def manifest_keys(units: Mapping[str, str] | Iterable[str]) -> dict[str, tuple[int, str]]:
    """What to ask the target about the manifests: only that they exist. `units`: unit key ->
    kind (plain keys: folders)."""
    kinds = units if isinstance(units, Mapping) else dict.fromkeys(units, "dir")
    return {manifest_key(k, kind): (-1, "") for k, kind in kinds.items()}


def manifest_unit(key: str) -> str | None:
    """The unit a lost key is the manifest of; None for a data file."""
    if key == MANIFEST_NAME:
        return ""
    if key.endswith("/" + MANIFEST_NAME):
        return key[: -len(MANIFEST_NAME) - 1]
    if key.endswith(FILE_MANIFEST_SUFFIX) and len(key) > len(FILE_MANIFEST_SUFFIX):
        return key[: -len(FILE_MANIFEST_SUFFIX)]  # beside a single-file unit
    return None


def forget_lost(ledger: Ledger, lost: list[str], manifests: Iterable[str]) -> None:
    """The target lost files the ledger says it holds: forget them (and the manifest of their
    folder) so the next pass sends them again, the manifest after them."""
    for k in lost:
        unit = manifest_unit(k)
        if unit is not None:
            ledger.manifest_forget(unit)
            continue
        ledger.forget(k)
        for uk in manifests:
            if not uk or k == uk or k.startswith(uk + "/"):
                ledger.manifest_forget(uk)


def verified(scope: list[Unit], expected: dict[str, tuple[int, str]], target: str, uploaded: int) -> FinalSyncResult:
    """The answer once the target holds all of the scope and a rescan found nothing new."""
    return FinalSyncResult(ok=True, target=target, files=len(expected), bytes=sum(v[0] for v in expected.values()),
                           uploaded_files=uploaded, unsynced=partial_notes(scope), damaged=damaged(scope),
                           partial_units=partial_units(scope), newest=newest_checkpoints(scope),
                           finals=final_saves(scope))


def partial_notes(scope: Iterable[Unit]) -> list[str]:
    """One line per folder that went up partial (FinalSyncResult.unsynced on success)."""
    return [f"{u.label} (partial: {u.verdict.reason}; uploaded "
            f"{'with a manifest naming its damaged files' if needs_manifest(u) else 'without manifest'})"
            for u in scope if u.verdict.partial]


def partial_units(scope: Iterable[Unit]) -> list[str]:
    """The folders that went up partial, each with why: `checkpoint-8 (never finished: no trainer_state.json)`."""
    return [f"{u.label} ({u.verdict.reason})" for u in scope if u.verdict.partial]


def damaged(scope: Iterable[Unit]) -> list[str]:
    """The files that went up although they fail their format check (paths on this machine)."""
    return sorted(s.path for u in scope for s in u.selected if s.rel in u.verdict.damaged)
