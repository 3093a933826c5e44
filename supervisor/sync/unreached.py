"""What the scan did not look at, for the report of training output no include selects
(saves/unselected.py decides): the folders the walk never entered because no include glob can reach
them (`include = ["./checkpoint-*/**"]` and the trainer writes `out/ckpt.pt`) are listed here,
bounded, and the report is put together from the walk's files and these.

Bounded: at most ENTRIES_MAX entries and DEPTH_MAX folders deep per listing, never following a
symlink, never entering a cache, an excluded root, a folder an exclude glob covers, a virtualenv;
listed again at most every REFRESH_S, except for a final sync's scan (what it says must be now)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from supervisor.saves import wholes
from supervisor.saves.unselected import NOT_OUTPUT_DIRS, VENV_MARKER, Report, Seen, find
from supervisor.sync import scan as sc
from supervisor.sync.policy import Policy, is_cache_dir

ENTRIES_MAX = 20_000
DEPTH_MAX = 32
REFRESH_S = 30.0
DOWNLOAD_MARKS = wholes.DOWNLOAD_MARKS  # what `hf download --local-dir` leaves


class Outside:
    """The files under the folders the walk did not enter, listed again at most every REFRESH_S."""

    def __init__(self) -> None:
        self._last: tuple[float, tuple[tuple[str, str], ...], list[Seen], bool] | None = None

    def files(self, dirs: Iterable[tuple[str, str]], policy: Policy, mono: float,
              force: bool = False) -> tuple[list[Seen], bool]:
        """(files, complete) under `dirs` ((root, rel) pairs); complete False when the cap was hit."""
        key = tuple(sorted(set(dirs)))
        last = self._last
        if not force and last is not None and last[1] == key and mono - last[0] < REFRESH_S:
            return last[2], last[3]
        found, complete = list_under(key, policy)
        self._last = (mono, key, found, complete)
        return found, complete


def _skipped(policy: Policy, rel: str, path: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    if is_cache_dir(name) or name in NOT_OUTPUT_DIRS or policy.in_cache(rel, path):
        return True
    # an exclude glob that covers the folder whole: the user's choice, not listed
    return policy.excluded_by_glob(f"{rel}/\x00") and policy.excluded_by_glob(f"{rel}/\x00/\x00")


def list_under(dirs: Iterable[tuple[str, str]], policy: Policy, cap: int = ENTRIES_MAX) -> tuple[list[Seen], bool]:
    """Regular files under each (root, rel) folder, as Seen; (…, False) when `cap` entries were read."""
    out: list[Seen] = []
    entries = 0
    for root, top in dirs:
        stack = [top]
        while stack:
            reldir = stack.pop()
            absdir = os.path.join(root, reldir)
            if _skipped(policy, reldir, absdir) or reldir.count("/") >= DEPTH_MAX:
                continue
            try:
                with os.scandir(absdir) as it:
                    got = list(it)
            except OSError:
                continue
            if any(e.name == VENV_MARKER for e in got):
                continue
            for e in got:
                entries += 1
                if entries > cap:
                    return out, False
                rel = f"{reldir}/{e.name}"
                try:
                    if e.is_symlink():
                        continue
                    if e.is_dir(follow_symlinks=False):
                        stack.append(rel)
                    elif e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        out.append(Seen(root, rel, st.st_size, st.st_mtime_ns / 1e9))
                except OSError:
                    continue
    return out, True

downloaded = wholes.downloaded  # one answer for "a model downloaded there" (scan.saved_models asks it too)


def report(seen: dict[tuple[str, str], sc.Seen], outside: list[Seen], complete: bool,
           units: Iterable[sc.Unit], policy: Policy) -> Report:
    """The report for one scan: the walk's files (`seen`: (root, rel) -> what the walker remembers),
    the files under the folders it did not enter, and the units it made."""
    units = list(units)
    files = [Seen(root, rel, s.size, s.mtime_ns / 1e9) for (root, rel), s in seen.items()]
    # a single file the scan left out of its unit (a sparse one) is the sync's, told by its own alert
    selected = [s.path for u in units for s in u.selected] + [u.abspath for u in units if u.kind == "file"]
    mtimes = [s.mtime_ns for u in units for s in u.selected]
    return find([*files, *outside], selected, [u.abspath for u in units if u.kind == "dir"], policy.allowed,
                max(mtimes) / 1e9 if mtimes else None, complete, downloaded)
