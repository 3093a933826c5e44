"""A checkpoint deleted before it left the machine: told at once, naming it and the real cause.

A trainer's rotation (the HF Trainer's `save_total_limit`, Accelerate's `total_limit`, Lightning's
`save_top_k`, Orbax's `max_to_keep`) deletes the oldest checkpoint at each save, whether it went up
or not. Three different things make that lose work, and each has its own fix, so the mail names the
one that happened (`cause`, pure, from what the last scan knew of the unit):
- it was still waiting to be judged complete (its quiet period, or its format's rule) when the
  rotation took it: the saves come faster than `sync.quiet_period` (its value is named) — the target
  was never asked and is not blamed;
- it was complete and waiting its turn or going up, the target healthy: the link is slower than the
  saves;
- the target was failing: fix the target (its error is named).
Nothing can bring it back, but the owner must hear it the moment it happens instead of finding the
gap at the next resume.

`vanished` is pure: the folder units of the previous scan that this scan did not find, that were
not all on the target, and that no rule of ours retired. The shell checks that the folder is
really gone (a scan that could not read it is not a deletion) and alerts once per unit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from supervisor.config.hints import ROTATION
from supervisor.durations import format_duration
from supervisor.notify.mails.sync import checkpoint_lost, checkpoint_stuck
from supervisor.saves.complete import checkable
from supervisor.store._log import get_logger

if TYPE_CHECKING:
    from supervisor.sync.scan import Unit
    from supervisor.sync.targethealth import AlertSink

log = get_logger("sync")

KEEP = 20  # the units `status --json` lists (the newest losses)


def vanished(before: Mapping[object, Unit], after: Mapping[object, Unit], synced: Callable[[Unit], bool]) -> list[Unit]:
    """Folders, and single checkpoint files (a Lightning top-k `.ckpt`), gone since the last scan
    with some of their files never sent."""
    return [u for k, u in before.items()
            if k not in after and (u.kind == "dir" or _checkpoint_file(u.rel)) and u.selected and not u.retired
            and not synced(u)]


def _checkpoint_file(rel: str) -> bool:
    return checkable(rel.rsplit("/", 1)[-1]) in ("zip", "safetensors")


# Each trainer's rotation, in the words of its own settings (formats.py's format names)
ROTATIONS = {
    "hf": "the Trainer's save_total_limit", "deepspeed": "the Trainer's save_total_limit",
    "adapter": "the Trainer's save_total_limit",
    "accelerate": "Accelerate's ProjectConfiguration(total_limit=...)",
    "lightning": "Lightning's ModelCheckpoint(save_top_k=...)", "nemo": "NeMo's ModelCheckpoint(save_top_k=...)",
    "nemo2": "NeMo's ModelCheckpoint(save_top_k=...)", "orbax": "Orbax's CheckpointManager(max_to_keep=...)",
    "composer": "Composer's save_num_checkpoints_to_keep",
}
ANY_ROTATION = "the trainer's rotation (save_total_limit, total_limit, save_top_k, max_to_keep)"


def rotation(fmt: str, command: str) -> str:
    """Which setting deleted it, with its value where the training command says it."""
    m = ROTATION.search(command or "")
    if m:
        return f"the training's --save_total_limit {m.group(1)}"
    return ROTATIONS.get(fmt, ANY_ROTATION)


def cause(u: Unit, command: str, quiet: float, target_error: str, now: float) -> tuple[str, str]:
    """(the cause, what to do) for a unit deleted before all of it was on the target, from the
    verdict the last scan gave it, how long it lived after its last write, the configured
    sync.quiet_period and the target's last error ("" = healthy)."""
    v = u.verdict
    rot = rotation(v.format, command)
    lived = max(0.0, now - max((f.mtime for f in u.files), default=now))
    quiet_words = f"sync.quiet_period = {format_duration(quiet)}"
    if v.quiet is not None and v.quiet < quiet - 0.5:
        quiet_words += f", {format_duration(v.quiet)} at this save cadence"
    if target_error:
        return (f"{rot} deletes the oldest checkpoint at each save, and the target was failing, so checkpoints "
                "piled up waiting for it",
                "To keep the next ones: fix the target first (supervisorctl status says what fails), and give the "
                "trainer room to wait for it: a larger limit, or disk.prune = \"synced\", which deletes a local "
                "checkpoint only once it is verified on the target.")
    if not v.complete and not v.partial:
        if v.waiting_for:
            return (f"{rot} deleted it {format_duration(lived)} after its last write, while its format's rule "
                    f"({v.format}) still waited for {v.waiting_for}; the target was healthy and never asked",
                    _rule_advice(v.waiting_for, rot))
        suggest = max(2.0, min(quiet, lived / 2)) if lived else 5.0
        return (f"{rot} deleted it {format_duration(lived)} after its last write, before it had been quiet for "
                f"the quiet period ({quiet_words}): the trainer saves faster than that; the target was healthy "
                "and never asked",
                f"To keep the next ones: lower sync.quiet_period below the time between two saves (e.g. "
                f"quiet_period = \"{format_duration(suggest)}\" in [sync]), or keep more checkpoints ({rot}: one "
                "or two more). A checkpoint complete by its format's own rule (trainer_state.json, every rank's "
                "random_states, a torch zip whole by its end record) does not wait for the quiet period.")
    return (f"{rot} deleted it {format_duration(lived)} after its last write, while it waited its turn or went "
            "up: the trainer saves faster than the link to the target sends (the target answered, with no error)",
            f"To keep the next ones: keep more checkpoints ({rot}: enough to cover one upload), save less often, "
            "or give the upload more bandwidth (sync.bandwidth_limit, sync.concurrency); disk.prune = \"synced\" "
            "deletes a local checkpoint only once it is verified on the target.")


def _rule_advice(waiting: str, rot: str) -> str:
    if "sync.world_size" in waiting:
        return ("To keep the next ones: set sync.world_size to the number of processes the training runs (the daemon "
                "could not read it from the training's environment), or keep more checkpoints.")
    return (f"To keep the next ones: if the save really finishes without it, tell the daemon so (docs/sync.md, "
            f"\"Each trainer's own rule\"); else keep more checkpoints ({rot}) so each save is whole before the "
            "next one deletes it.")


def likely_cause(command: str) -> str:
    """The cause when nothing is known of the unit (the HF Trainer's rotation named in the command)."""
    m = ROTATION.search(command or "")
    if m:
        return (f"the training's --save_total_limit {m.group(1)}: the trainer deletes its oldest checkpoint at "
                f"each save, and more than {m.group(1)} were waiting to go up")
    return ("most likely the trainer's rotation (save_total_limit) deleting its oldest checkpoint while newer "
            "ones still waited to go up, or someone's rm")


class LostWatch:
    def __init__(self, alerts: AlertSink | None, target: str, command: str = "", quiet: float = 30.0):
        self.alerts = alerts
        self.target = target
        self.command = command
        self.quiet = quiet  # sync.quiet_period, named in the mail when it was the cause
        self.lost: list[dict] = []
        self._stuck: set[str] = set()

    def look(self, before: Mapping[object, Unit], after: Mapping[object, Unit], synced: Callable[[Unit], bool],
             now: float, target_error: str) -> None:
        for u in vanished(before, after, synced):
            if os.path.lexists(u.abspath):
                continue  # not read this time, not deleted
            size = sum(s.size for s in u.selected)
            why, advice = cause(u, self.command, self.quiet, target_error, now)
            self.lost = [{"unit": u.label, "path": u.abspath, "at": now, "files": len(u.selected), "bytes": size,
                          "cause": why}, *self.lost][:KEEP]
            log.error("sync_unit_lost", unit=u.label, path=u.abspath, files=len(u.selected), bytes=size, cause=why)
            if self.alerts is None:
                continue
            mail = checkpoint_lost(u.abspath, self.target, len(u.selected), size, why, target_error, advice)
            try:
                self.alerts.fire(f"sync:lost:{u.label}", "checkpoint_lost", "critical", mail.subject, mail.body)
            except Exception:  # noqa: BLE001 - alerting must never stop the sync
                log.exception("sync_alert_fire_failed")

    def stuck(self, entries: list[tuple[str, str, float]], formats: dict[str, str]) -> None:
        """Units their format's rule keeps waiting on long after the writers went quiet (scan.pending):
        alerted once each, resolved when they complete or go."""
        now = {label for label, _, _ in entries}
        for label, waiting, quiet_for in entries:
            if label in self._stuck or self.alerts is None:
                continue
            self._stuck.add(label)
            log.error("sync_unit_stuck", unit=label, waiting_for=waiting, quiet_for_s=round(quiet_for))
            mail = checkpoint_stuck(label, self.target, waiting, quiet_for, formats.get(label, ""))
            try:
                self.alerts.fire(f"sync:stuck:{label}", "checkpoint_stuck", "warning", mail.subject, mail.body)
            except Exception:  # noqa: BLE001 - alerting must never stop the sync
                log.exception("sync_alert_fire_failed")
        for label in self._stuck - now:
            self._stuck.discard(label)
            if self.alerts is not None:
                try:
                    self.alerts.resolve(f"sync:stuck:{label}")
                except Exception:  # noqa: BLE001
                    log.exception("sync_alert_resolve_failed")
