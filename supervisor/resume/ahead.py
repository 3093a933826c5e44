"""The newest unit's download, begun from the target's listing while the survey reads the manifests.

A restore must judge every unit on the target before it may choose (the newest is the highest
`global_step` in trainer_state.json, which a folder's name only suggests), and with twenty
checkpoints on the target that survey costs a GET round per SURVEY_THREADS folders: on a LoRA run
as long as the download itself. The listing already names the newest folder and every file in it
with its size, and that folder is nearly always the choice: its download starts as soon as the
listing is read (`offer()` of a unit `from_listing`), before its manifest is.

Nothing of it is checked against anything but the manifest, and nothing is placed before the
choice is final:
- when the survey judges that folder, `confirm()` keeps the download only if the manifest calls it
  complete and lists exactly the files and sizes being fetched; otherwise it is dropped, and the
  first complete unit judged after it is offered instead (`offer(u, dest)`);
- the fetch compares the bytes with the manifest's sha256 (`checked()` waits for the judged unit),
  then waits for the restore to take it (`place()`);
- a dropped download stops at its next chunk (Cancelled) and its staging folder is removed, as for
  any restore cut short. A place that already holds a folder is left to the restore proper (a
  differing folder is set aside there, which no guess may do)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from supervisor.resume.choose import COMPLETE, UnitInfo
from supervisor.saves.manifest_doc import ManifestFile
from supervisor.sync.policy import MANIFEST_NAME
from supervisor.untrusted.names import problem

LISTED = "listed"  # a unit known from the listing alone: its manifest not read yet


class Cancelled(Exception):
    """The download begun ahead was not the restore's choice (or the restore itself stopped)."""


class Declined(Exception):
    """The unit's place is taken: the restore proper decides what to do with what is there."""


def from_listing(key: str, keys: dict[str, int]) -> UnitInfo | None:
    """The unit folder `key` as the listing shows it (files and sizes, no checksums); None when it
    has no manifest on the target (it cannot be complete) or a name that judge() would refuse."""
    if f"{key}/{MANIFEST_NAME}" not in keys or problem(key):
        return None
    pre = key + "/"
    files = tuple(ManifestFile(k[len(pre):], size, "") for k, size in keys.items()
                  if k.startswith(pre) and k[len(pre):] != MANIFEST_NAME)
    if not files or any(problem(f.path) or f.size < 0 for f in files):
        return None
    return UnitInfo(key, LISTED, files=files, total_bytes=sum(f.size for f in files))


def _same_files(a: UnitInfo, b: UnitInfo) -> bool:
    return sorted((f.path, f.size) for f in a.files) == sorted((f.path, f.size) for f in b.files)


class Ahead:
    """fetch(unit, dest, hold) is the restore's own fetch; it calls hold.progress() to wrap its
    byte counter, hold.checked() for the unit to compare the bytes with, and hold.place() once
    they matched, and places them only when that is True."""

    def __init__(self, fetch: Callable[[UnitInfo, str, Ahead], bool]):
        self._fetch = fetch
        self.unit: UnitInfo | None = None
        self.dest = ""
        self.t0 = 0.0
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._confirmed = threading.Event()
        self._decided = threading.Event()
        self._go = False
        self._already: bool | None = None
        self._error: BaseException | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def waiting(self) -> bool:
        """Offered from the listing and its manifest not judged yet."""
        return self.started and not self._confirmed.is_set()

    def offer(self, u: UnitInfo, dest: str) -> None:
        """The download of u starts (only the first offer); a unit from_listing waits for
        confirm() before its bytes are checked."""
        if self._thread is not None or self._cancel.is_set():
            return
        self.unit, self.dest, self.t0 = u, dest, time.monotonic()
        if u.state != LISTED:
            self._confirmed.set()
        self._thread = threading.Thread(target=self._run, name="resume-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.unit is not None
        try:
            self._already = self._fetch(self.unit, self.dest, self)
        except BaseException as e:  # noqa: BLE001 - handed to the restore's thread by take()
            self._error = e

    def confirm(self, u: UnitInfo) -> bool:
        """The survey judged the unit offered from the listing: the download goes on when the
        manifest calls it complete and lists exactly the files and sizes being fetched (True);
        otherwise it is dropped (False)."""
        assert self.unit is not None and u.key == self.unit.key
        if u.state != COMPLETE or not _same_files(u, self.unit):
            self.drop()
            return False
        self.unit = u
        self._confirmed.set()
        return True

    # --- what the fetch asks ----------------------------------------------------------------------
    def progress(self, add: Callable[[int], None]) -> Callable[[int], None]:
        def counted(n: int) -> None:
            if self._cancel.is_set():
                raise Cancelled("not the restore's choice")
            add(n)
        return counted

    def checked(self) -> UnitInfo:
        """The unit as its manifest describes it, to check the bytes against (waits for the survey
        to judge a unit offered from the listing)."""
        self._confirmed.wait()
        if self._cancel.is_set():
            raise Cancelled("not the restore's choice")
        assert self.unit is not None
        return self.unit

    def place(self) -> bool:
        self._decided.wait()
        return self._go

    # --- what the restore decides -----------------------------------------------------------------
    def holds(self, u: UnitInfo, dest: str) -> bool:
        return (self.unit is not None and self._confirmed.is_set() and not self._cancel.is_set()
                and u.key == self.unit.key and u.digest == self.unit.digest and dest == self.dest)

    def take(self) -> bool:
        """The fetch's result (True: the place already held this unit), or what it raised;
        Declined when the place was taken and the restore proper must fetch."""
        assert self._thread is not None
        self._go = True
        self._decided.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._already is not None
        return self._already

    def drop(self) -> None:
        """Stop the download (its staging folder is removed) and wait for the thread: nothing of
        it may run beside the restore's own fetch. A no-op after take()."""
        if self._go:
            return
        self._cancel.set()
        self._confirmed.set()
        self._decided.set()
        if self._thread is not None:
            self._thread.join()
