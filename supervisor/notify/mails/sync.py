"""The sync engine's words: the "sync failing" mail, and "sync refused" when the target rejects our credentials."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.durations import format_bytes, format_duration
from supervisor.notify.mails import Mail
from supervisor.status.words import UNSELECTED_FIX as UNSELECTED_FIX  # one wording with the status text
from supervisor.status.words import behind_line as behind_line
from supervisor.status.words import unselected_line as unselected_line
from supervisor.timefmt import when


def sync_failing(target: str, failing_for_s: float, last_error: str, pending_files: int, pending_bytes: int) -> Mail:
    """Uploads to `target` have failed for `failing_for_s` seconds; what is not on it yet."""
    failing_for = format_duration(failing_for_s)
    return Mail(
        f"sync failing: {target} for {failing_for}",
        f"Uploads to {target} have been failing for {failing_for}.\n"
        f"Last error: {last_error}\nNot yet on the target: {pending_files} files ({format_bytes(pending_bytes)}).\n\n"
        "Retries continue with backoff; a final sync before any stop will wait for the target.\n"
        "Check with: supervisorctl status; retry now with: supervisorctl sync --wait")


def sync_public_refused(target: str, error: str, pending_files: int, pending_bytes: int) -> Mail:
    """The hf:// repo is public and sync.hf_allow_public is not set: nothing is uploaded there."""
    return Mail(
        f"sync refused: {target} is a public repo",
        f"Nothing is uploaded to {target}: {error}\n"
        f"Not yet on the target: {pending_files} files ({format_bytes(pending_bytes)}).\n\n"
        "A typo or a reused repo name must not publish weights trained on private data. Nothing is lost:\n"
        "the files stay on this machine, and a final sync before any stop waits for the target.\n"
        "Either make the repo private on the Hub, or point sync.target at another repo, or set\n"
        "sync.hf_allow_public = true if the checkpoints are meant to be public; then: supervisorctl sync --wait")


def sync_refused(target: str, error: str, pending_files: int, pending_bytes: int) -> Mail:
    """`target` refused our credentials (bad token, no write access): nothing goes up until a
    person fixes them, so this is sent at once, not after the failing delay."""
    return Mail(
        f"sync refused: {target} rejects the credentials",
        f"Uploads to {target} are refused: {error}\n"
        f"Not yet on the target: {pending_files} files ({format_bytes(pending_bytes)}).\n\n"
        "Nothing is lost: the files stay on this machine and the daemon tries again with backoff, and at once\n"
        "after `supervisorctl sync`. A final sync before any stop will wait for the target.\n"
        "Fix the credentials, then: supervisorctl sync --wait")


def sync_no_credentials(target: str, error: str, pending_files: int, pending_bytes: int) -> Mail:
    """No credentials for `target` at all: sent at the first failure (the probe at daemon start
    or at `run`, or the first upload), naming where the daemon looks."""
    return Mail(
        f"sync: no credentials for {target}: nothing leaves this machine",
        f"Nothing can be uploaded to {target}: {error}\n"
        f"Not yet on the target: {pending_files} files ({format_bytes(pending_bytes)}).\n\n"
        "Until keys are found, every checkpoint exists only on this machine: a trainer that rotates its\n"
        "checkpoints (save_total_limit) deletes the oldest ones, and those are then lost, and so is all of it\n"
        "if the machine goes. Add the keys where the daemon looks; it sees them within seconds and\n"
        "uploads at once, no restart needed. Then check: supervisorctl sync --wait")


def checkpoint_lost(path: str, target: str, files: int, size: int, cause: str, target_error: str,
                    advice: str = "") -> Mail:
    """A checkpoint was deleted here before it was all on the target: it is gone. `advice`: what to
    do, for the cause found (sync/lost.py; a healthy target is not told to be fixed)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    why_not = f"\nThe target's last error: {target_error}" if target_error else ""
    return Mail(
        f"checkpoint LOST: {name} was deleted before it left the machine",
        f"{path} ({files} files, {format_bytes(size)}) was deleted on this machine before all of it was on {target}.\n"
        f"It exists nowhere now. Likely cause: {cause}.{why_not}\n\n"
        + (advice or "To keep the next ones: fix the target first (supervisorctl status says what fails), and give the\n"
           "trainer room to wait for it: a larger save_total_limit, or disk.prune = \"synced\", which deletes\n"
           "a local checkpoint only once it is verified on the target."))


def sparse_left_out(path: str, size: int, on_disk: int) -> Mail:
    """A sparse file (sync.complete.sparse) is left out of its folder's upload."""
    return Mail(
        f"sync: {path.rsplit('/', 1)[-1]} left out (sparse: {format_bytes(size)} long, {format_bytes(on_disk)} on disk)",
        f"{path} is {format_bytes(size)} long but holds only {format_bytes(on_disk)} on disk (a file made with "
        f"truncate, or preallocated and never filled). Uploading it would send and store all {format_bytes(size)}, "
        "so it is left out: the rest of its folder goes up with a manifest that names it and says the folder is "
        "not complete, and no stop waits on it.\nIf the file is real, set sync.upload_sparse = true.")


def checkpoint_stuck(unit: str, target: str, waiting_for: str, quiet_for_s: float, fmt: str) -> Mail:
    """A checkpoint whose format's rule still waits, long after its writers went quiet."""
    return Mail(f"checkpoint STUCK: {unit} waits for {waiting_for}"[:150],
                f"{unit} ({fmt}) has not changed for {format_duration(quiet_for_s)} and is still not complete: it "
                f"waits for {waiting_for}.\nIts siblings took far less to save: a rank probably died mid-save (an "
                f"out-of-memory kill, a lost node). It is not uploaded as complete to {target} and no restore "
                f"will take it; the newest complete checkpoint stays the one to resume from.\n"
                f"Look at the training's log for the rank that failed.\n")


# --- a target behind the saves (sync/targethealth.py Behind) ------------------------------------------------

def target_behind(target: str, path: str, saves: int, since: float | None, note: str = "") -> Mail:
    """A unit here was saved more than a save or two since the version `target` holds."""
    first = f" (the first of them at {when(since)})" if since else ""
    why_not = f"\nIt goes up without a snapshot now: {note}." if note else ""
    return Mail(
        f"sync: target {saves} saves behind for {path.rstrip('/').rsplit('/', 1)[-1]}",
        f"{behind_line(path, saves)}.\n{path} was saved {saves} times since the version {target} holds{first}.\n"
        "Each upload lands whole (sent from a snapshot taken while the file was whole), but newer saves are "
        "here by the time it does: if this machine went now, a restore would get the target's older version."
        f"{why_not}\n\nTo catch up: save less often, or give the upload more bandwidth (sync.bandwidth_limit, "
        "a faster link).\nThis resolves by itself once the target holds the newest save.")


# --- training output no include selects (saves/unselected.py): one wording on every surface ----------------



@dataclass(frozen=True)
class Unselected:
    """What the mails say of it: up to 20 names, every file counted, and whether a checkpoint among
    them is newer than anything selected (a stop waits for it)."""

    names: tuple[str, ...] = ()
    files: int = 0
    bytes: int = 0
    hold: bool = False

    @classmethod
    def of(cls, d: dict | None) -> Unselected:
        """From the `sync` block of status --json or a stop record's summary of the final sync."""
        d = d or {}
        names = tuple(d.get("unselected") or ())
        return cls(names, int(d.get("unselected_files") or len(names)), int(d.get("unselected_bytes") or 0),
                   bool(d.get("unselected_newer") or d.get("unselected_hold")))

    def __bool__(self) -> bool:
        return bool(self.names or self.files)

    def block(self) -> str:
        return unselected_block(self.files, self.bytes, self.names, hold=self.hold)

    def count(self) -> str:
        """`3 files, 48.0 MiB`"""
        return f"{self.files} file{'' if self.files == 1 else 's'}, {format_bytes(self.bytes)}"


def unselected_block(files: int, nbytes: int, names: list[str] | tuple[str, ...], items: int = 0,
                     hold: bool = False) -> str:
    """The mails' paragraph: what stays on this machine, each name on its line (up to 20)."""
    if not names and not files:
        return ""
    more = max(items, len(names)) - len(names[:20])
    one = files == 1
    out = (f"NOT SELECTED (stay on this machine): {files} file{'' if one else 's'}, {format_bytes(nbytes)} "
           f"in the watched folders {'looks' if one else 'look'} like training output, and no sync.include glob "
           f"selects {'it' if one else 'them'}:\n"
           + "".join(f"  {n}\n" for n in names[:20]) + (f"  and {more} more\n" if more > 0 else ""))
    if hold:
        out += ("A checkpoint among them is newer than anything on the target: a stop waits for it (unless "
                "stop.stop_even_if_sync_fails is set).\n")
    return out + (f"Fix: add a sync.include glob that selects {'it' if one else 'them'} (docs/sync.md, "
                  "\"What is selected\") and restart "
                  "the daemon (train-supervisor-start --restart, or systemctl restart train-supervisor); or an "
                  "exclude glob for what you mean to leave here.\n")
