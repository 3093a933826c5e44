"""Which unit on the target to resume from, decided from what the target lists and its manifests.

A unit is a folder on the target that holds a `_MANIFEST.json` or is named `checkpoint-N`, or a
single checkpoint file with its manifest beside it (`epoch=2-step=300.ckpt._MANIFEST.json`). It is
*complete* only when its manifest parses, says `"complete": true`, and every file it lists is on
the target with the listed size; anything else is skipped with the reason named (a half-uploaded
`checkpoint-30` without a manifest is the classic trap). Newest = highest step: `global_step` from
the unit's `trainer_state.json` when known, else the step its name gives (`checkpoint-300`,
`epoch=2-step=300.ckpt`, `global_step300`), then the number in its name, then the time it was saved.

Pure: the caller lists the target and reads the manifests; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from supervisor.saves.manifest_doc import (
    ManifestFile,
    digest,
    links_of,
    parse_doc,
    seen_step,
    state_facts,
    trainer_facts,
)
from supervisor.sync.policy import FILE_MANIFEST_SUFFIX, MANIFEST_NAME, PROBE_FOLDER, manifest_key
from supervisor.training.checkpoints import checkpoint_step, name_order, named_step
from supervisor.untrusted.names import problem, shown

COMPLETE, PARTIAL, DAMAGED, NO_MANIFEST = "complete", "partial", "damaged", "no manifest"
REFUSED = "refused"   # a name in it would lead outside its folder: never restored, and named


@dataclass(frozen=True)
class UnitInfo:
    key: str                               # the folder's key on the target ("checkpoint-20", "out/checkpoint-20")
    state: str                             # COMPLETE | PARTIAL | DAMAGED | NO_MANIFEST | REFUSED
    why: str = ""                          # for a skipped unit: what is wrong, in words
    step: int | None = None
    files: tuple[ManifestFile, ...] = ()
    total_bytes: int = 0
    saved_at: str = ""                     # the manifest's created_at (ISO-8601 UTC)
    host: str = ""                         # the machine that wrote it
    digest: str = ""
    max_steps: int | None = None
    count: int = 0                         # files listed, when `files` was let go (summary)
    step_known: bool = False               # step from trainer_state.json (or its manifest's copy), not the name
    kind: str = "dir"                      # "file": a single checkpoint file, its manifest beside it
    links: tuple[str, ...] = ()            # links to that file beside it, to make again (Lightning's last.ckpt)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def folder(self) -> str:
        """The key its files' paths are relative to: the folder itself, or a single file's folder."""
        return self.key if self.kind == "dir" else (self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def file_key(self, path: str) -> str:
        return f"{self.folder}/{path}" if self.folder else path

    @property
    def file_count(self) -> int:
        return self.count or len(self.files)

    def summary(self) -> UnitInfo:
        """The unit without its file list (a survey keeps the lists of only the few it may restore)."""
        return replace(self, files=(), count=self.file_count)

    def to_json(self) -> dict:
        return {"unit": self.key, "kind": self.kind, "state": self.state, "why": self.why, "step": self.step,
                "files": self.file_count, "bytes": self.total_bytes, "saved_at": self.saved_at,
                "host": self.host, "max_steps": self.max_steps}


@dataclass
class Choice:
    order: list[UnitInfo] = field(default_factory=list)     # complete units, newest first: try in turn
    skipped: list[UnitInfo] = field(default_factory=list)   # newer than the first complete one, not usable


def unit_keys(keys: dict[str, int]) -> list[str]:
    """The unit folders among the target's keys (key -> size), and the single checkpoint files
    with a manifest beside them (file_units)."""
    out: set[str] = set(file_units(keys))
    for k in keys:
        if "/" not in k:
            continue
        folder, name = k.rsplit("/", 1)
        if folder.split("/", 1)[0].startswith(PROBE_FOLDER):
            continue  # a probe a daemon killed mid-way left behind (sync/probe.py)
        if name == MANIFEST_NAME:
            out.add(folder)
        for i, part in enumerate(folder.split("/")):
            if checkpoint_step(part) is not None:
                out.add("/".join(folder.split("/")[: i + 1]))
                break
    return sorted(out)


def file_units(keys: dict[str, int]) -> set[str]:
    """The single-file units among the target's keys: a file with `NAME._MANIFEST.json` beside it."""
    out = set()
    for k in keys:
        if k.endswith(FILE_MANIFEST_SUFFIX) and not k.endswith("/" + MANIFEST_NAME):
            f = k[: -len(FILE_MANIFEST_SUFFIX)]
            if f and not f.endswith("/") and not f.split("/", 1)[0].startswith(PROBE_FOLDER):
                out.add(f)
    return out


def kind_of(key: str, keys: dict[str, int]) -> str:
    """"file" for a single-file unit (its manifest beside it), "dir" for a folder."""
    return "file" if manifest_key(key, "file") in keys and manifest_key(key) not in keys else "dir"


def judge(key: str, manifest: bytes | None, keys: dict[str, int], kind: str = "dir") -> UnitInfo:
    """A unit as its manifest and the target's listing describe it (`kind` "file": a single file,
    its manifest beside it, listing that one file by its name)."""
    bad = problem(key)
    if bad:  # a key with `..`, a leading `/`, `//` ...: it names no folder here, and nothing of it is read
        return UnitInfo(key, REFUSED, f"the unit's key {shown(key)} is refused: {bad}", kind=kind)
    step = named_step(key.rsplit("/", 1)[-1])
    if manifest is None:
        return UnitInfo(key, NO_MANIFEST, f"no {MANIFEST_NAME}: a partial upload", step, kind=kind)
    try:
        doc, listed = parse_doc(manifest)
    except ValueError as e:
        refused = "is refused" in str(e)
        return UnitInfo(key, REFUSED if refused else DAMAGED, f"manifest {'refused' if refused else 'unreadable'}: {e}",
                        step)
    files = tuple(listed)
    d = digest(list(files))
    facts = trainer_facts(doc)  # what its trainer_state.json said as it went up (newer manifests)
    if step is None:
        step = seen_step(doc)  # the training's step when it was saved, from its log or trackers
    base = UnitInfo(key, COMPLETE, "", facts[0] if facts else step, files, sum(f.size for f in files),
                    str(doc.get("created_at") or ""), str(doc.get("host") or ""), d,
                    max_steps=facts[1] if facts else None, step_known=facts is not None, kind=kind,
                    links=links_of(doc) if kind == "file" else ())
    if doc.get("digest") and doc["digest"] != d:
        return _with(base, DAMAGED, "manifest digest does not match its file list")
    if doc.get("complete") is not True:
        damaged = ", ".join(doc.get("damaged") or []) or "none named"
        return _with(base, PARTIAL, f"manifest says not complete ({doc.get('partial') or 'partial'}; "
                                    f"damaged: {damaged})")
    if not files:
        return _with(base, PARTIAL, "manifest lists no files")
    if kind == "file" and [f.path for f in files] != [base.name]:
        # the manifest beside a file vouches for that file alone: any other name it lists would
        # be written next to it, where the restore has no business
        return _with(base, REFUSED, f"the manifest beside {shown(base.name)} lists other files: "
                                    f"{', '.join(shown(f.path) for f in files[:3])}")
    gone = [f.path for f in files if keys.get(base.file_key(f.path)) is None]
    if gone:
        return _with(base, PARTIAL, f"{len(gone)} listed file(s) missing on the target ({', '.join(gone[:3])})")
    short = [f.path for f in files if keys.get(base.file_key(f.path), f.size) not in (f.size, -1)]
    if short:
        return _with(base, DAMAGED, f"size differs from the manifest: {', '.join(short[:3])}")
    return base


def with_state(u: UnitInfo, trainer_state: bytes | None) -> UnitInfo:
    """The unit's step and max_steps from its `trainer_state.json` (when read), else as named."""
    facts = state_facts(trainer_state)
    if facts is None:
        return u
    return replace(u, step=facts[0], max_steps=facts[1], step_known=True)


def _with(u: UnitInfo, state: str, why: str) -> UnitInfo:
    return replace(u, state=state, why=why)


def _rank(u: UnitInfo) -> tuple[int, int, str]:
    # the step; else the number its name gives (checkpoint_7 after checkpoint_6 of the same second);
    # the time it was saved only last
    return (u.step if u.step is not None else -1, name_order(u.name), u.saved_at)


def choose(units: list[UnitInfo], name: str | None = None) -> Choice:
    """The complete units to try, newest first, and the newer ones skipped (with their reasons).
    `name` (`--checkpoint NAME`): only that unit (its key or folder name), skipped when unusable."""
    if name:
        want = [u for u in units if name in (u.key, u.name)]
        return Choice([u for u in want if u.state == COMPLETE], [u for u in want if u.state != COMPLETE])
    ranked = sorted(units, key=_rank, reverse=True)
    order = [u for u in ranked if u.state == COMPLETE]
    top = _rank(order[0]) if order else None
    # a refused unit is named whatever its age: a name that leads outside its folder is someone's doing
    skipped = [u for u in ranked if u.state != COMPLETE and (top is None or _rank(u) > top or u.state == REFUSED)]
    return Choice(order, skipped)


def local_rel(unit_key: str, prefixes: list[tuple[str, str]]) -> tuple[str, str] | None:
    """(watched folder, path inside it) of a unit key, given (folder, key prefix) per watched folder
    (a lone watched folder maps to the target's top, several each to their prefix); None when the
    unit belongs to no watched folder."""
    for folder, prefix in prefixes:
        if not prefix:
            if len(prefixes) == 1:
                return folder, unit_key
            continue
        if unit_key.startswith(prefix + "/"):
            return folder, unit_key[len(prefix) + 1:]
    return None

