"""The target probe: write a tiny object, read it back, delete it.

Run when the daemon starts and at every `run`, so missing keys, a bucket that refuses writes or a
read-only token are told before the first checkpoint is saved, not after the Trainer's rotation
has deleted checkpoints that never left the machine. The object lives under PROBE_FOLDER, which a
restore never takes for a unit; one left behind by a daemon killed mid-probe is overwritten by the
next probe from this host.

The Hub is not probed by writing (each write is a commit in the repo's history): its probe builds
the client, makes sure the repo exists and is ours, and asks whoami, which finds a missing or
read-only token.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.store._log import get_logger
from supervisor.store.base import AccessDenied, TargetError, join_key, reader
from supervisor.sync.policy import MANIFEST_NAME, PROBE_FOLDER

if TYPE_CHECKING:
    from supervisor.clock import Clock
    from supervisor.store.credentials import CredentialWatch
    from supervisor.sync.targethealth import Health

log = get_logger("sync")


def probe_key(hostname: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in hostname)[:64] or "host"
    # one top-level folder per host: deleting it leaves nothing behind on a disk or over rsync,
    # and never touches another node's probe in flight
    return f"{PROBE_FOLDER}-{safe}"


def probe(target: object, hostname: str) -> None:
    """Raises TargetError (AccessDenied for refused or missing credentials) naming what failed."""
    hub = getattr(target, "repo", None)
    if getattr(target, "lands_units", False) and hub is not None:
        hub.check_writable()
        return
    base = getattr(target, "base", None)
    if isinstance(base, Path) and not base.exists():
        # a folder target not there yet: the first upload makes it. The probe does not, so that a
        # restore still tells "missing" (an unmounted volume?) from "empty" (resume/gate.py)
        parent = next(p for p in base.parents if p.exists())
        if not os.access(parent, os.W_OK):
            raise TargetError(f"{base}: the target folder is missing and {parent} is not writable")
        return
    unit = probe_key(hostname)
    data = json.dumps({"probe": secrets.token_hex(8), "host": hostname, "pid": os.getpid()}).encode()
    target.write_manifest(unit, data)  # type: ignore[attr-defined]
    try:
        got = reader(target).read_file(join_key(unit, MANIFEST_NAME))
    except AccessDenied:
        got = data  # a write-only key is a fine setup: uploads are verified by what the target returns
    if got != data:
        raise TargetError(f"the target {getattr(target, 'display', '')} did not give back the probe it was sent "
                          f"({'nothing' if got is None else f'{len(got)} other bytes'} under {unit})")
    if getattr(target, "bucket", None) is not None:
        target.delete_manifest(unit)  # type: ignore[attr-defined]  # S3 has no folders to leave behind
    else:
        target.delete_prefix(unit)  # type: ignore[attr-defined]  # the folder too, on a disk or over rsync


class Access:
    """The engine's side of the target's credentials: the sources watched, the client built
    again when one moves, and the probe (when wanted: at start, at `run`, and again at each try
    while it fails; the engine's pass does not clear a failure the probe found)."""

    def __init__(self, creds: CredentialWatch, target: object, hostname: str, health: Health, clock: Clock):
        self.creds = creds
        self.target = target
        self.hostname = hostname
        self.health = health
        self.clock = clock
        self.failed = False
        self.overruled = False
        self.result: dict = {}
        self._wanted = threading.Event()

    def soon(self) -> None:
        self._wanted.set()

    def reload(self, why: str) -> None:
        """The target builds its client again, from the sources as they are now."""
        reload = getattr(self.target, "reload_credentials", None)
        if callable(reload):
            reload(why)

    @property
    def due(self) -> bool:
        return self.target is not None and not self.overruled and (self._wanted.is_set() or self.failed)

    def sent(self) -> None:
        """A folder went up although the probe failed: a bucket policy that admits only some
        keys under the prefix, say. The uploads are the truth; the probe is not run again."""
        if self.failed:
            self.failed, self.overruled = False, True
            self.result = {**self.result, "overruled": True}
            log.warning("sync_probe_overruled", target=getattr(self.target, "display", ""),
                        why="a folder was uploaded although the probe was refused; not probing again")

    def changed(self) -> bool:
        """A credential source moved (keys exported into the environment file, written to
        ~/.aws/credentials, ...): the target builds its client again, the backoff is over, and
        a failed probe is tried again. True when the engine should try at once."""
        moved = self.creds.changed() if self.target is not None else []
        if not moved:
            return False
        log.info("sync_credentials_changed", sources=moved)
        self.reload("changed: " + ", ".join(moved))
        with self.health.board.lock:
            self.health.backoff.retry_now()
        return True

    def run(self) -> None:
        self._wanted.clear()
        try:
            probe(self.target, self.hostname)
        except TargetError as e:
            self.failed = True
            self.result = {"ok": False, "at": self.clock.time(), "error": str(e)}
            log.warning("sync_probe_failed", target=getattr(self.target, "display", ""), error=str(e))
            self.health.failed(f"probe: {e}", e)
            self.health.evaluate_alert()  # refused or missing keys: at once, not after the next pass
            return
        except Exception as e:  # noqa: BLE001 - a probe must never take the worker down
            self.failed = False
            self.result = {"ok": False, "at": self.clock.time(), "error": f"{type(e).__name__}: {e}"}
            log.exception("sync_probe_error")
            return
        was, self.failed = self.failed, False
        self.result = {"ok": True, "at": self.clock.time(), "error": ""}
        log.info("sync_probe_ok", target=getattr(self.target, "display", ""), after_failure=was or None)
        self.health.recovered()

    def status(self) -> dict:
        if self.target is None:
            return {}
        return {"probe": dict(self.result),
                "credentials": {"sources": self.creds.paths(), "problem": self.creds.problem}}
