"""The newest complete unit's download, begun while the survey still reads the other manifests.

A restore must judge every unit on the target before it may choose (the newest is the highest
`global_step` in trainer_state.json, which a folder's name only suggests), and with twenty
checkpoints on the target that survey costs a GET round per SURVEY_THREADS folders: on a LoRA run
as long as the download itself. The survey reads the folders newest first by name, so the first
complete unit it judges is nearly always the choice; its download starts then, in a thread.

Nothing of it is placed before the choice is final: the fetch stops once its files are checked and
waits. The restore then takes it (the same unit, the same manifest digest, the same place) or drops
it: the next chunk written raises Cancelled and its staging folder is removed, as for any restore
cut short. A place that already holds a folder is left to the restore proper (a differing folder is
set aside there, which no guess may do)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from supervisor.resume.choose import UnitInfo


class Cancelled(Exception):
    """The download begun ahead was not the restore's choice (or the restore itself stopped)."""


class Declined(Exception):
    """The unit's place is taken: the restore proper decides what to do with what is there."""


class Ahead:
    """fetch(unit, dest, hold) is the restore's own fetch; it calls hold.progress() to wrap its
    byte counter and hold.place() once the files matched, and places them only when that is True."""

    def __init__(self, fetch: Callable[[UnitInfo, str, Ahead], bool]):
        self._fetch = fetch
        self.unit: UnitInfo | None = None
        self.dest = ""
        self.t0 = 0.0
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._decided = threading.Event()
        self._go = False
        self._already: bool | None = None
        self._error: BaseException | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def offer(self, u: UnitInfo, dest: str) -> None:
        """The first complete unit the survey judged: its download starts (only the first offer)."""
        if self._thread is not None or self._cancel.is_set():
            return
        self.unit, self.dest, self.t0 = u, dest, time.monotonic()
        self._thread = threading.Thread(target=self._run, name="resume-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.unit is not None
        try:
            self._already = self._fetch(self.unit, self.dest, self)
        except BaseException as e:  # noqa: BLE001 - handed to the restore's thread by take()
            self._error = e

    # --- what the fetch asks ----------------------------------------------------------------------
    def progress(self, add: Callable[[int], None]) -> Callable[[int], None]:
        def counted(n: int) -> None:
            if self._cancel.is_set():
                raise Cancelled("not the restore's choice")
            add(n)
        return counted

    def place(self) -> bool:
        self._decided.wait()
        return self._go

    # --- what the restore decides -----------------------------------------------------------------
    def holds(self, u: UnitInfo, dest: str) -> bool:
        return (self.unit is not None and not self._cancel.is_set() and u.key == self.unit.key
                and u.digest == self.unit.digest and dest == self.dest)

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
        self._decided.set()
        if self._thread is not None:
            self._thread.join()
