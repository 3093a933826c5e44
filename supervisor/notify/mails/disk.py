"""Words about the training's disk: the one-line forecast status shows, and the alert that the disk
fills up before the next saves (what fills it, what would free space, why nothing was freed)."""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.notify.mails import Mail

GIB = 1024**3
FAR_S = 30 * 86400  # a forecast further out than this says nothing a person can act on


def size(n: float | None) -> str:
    """41 GiB, 8.0 GiB, 512 MiB."""
    if n is None:
        return "?"
    if n >= 10 * GIB:
        return f"{n / GIB:.0f} GiB"
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= 1024**2:
        return f"{n / 1024**2:.0f} MiB"
    return f"{n / 1024:.0f} KiB"  # a tiny run's checkpoint is not "0 MiB"


def span(s: float | None) -> str:
    """2h10m, 25 min, 40s."""
    if s is None:
        return "?"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    h, m = divmod(round(s / 60), 60)
    return f"{h}h{m:02d}m" if h < 48 else f"{h // 24}d{h % 24}h"


def line(fs: dict) -> str:
    """`/workspace 41 GiB free of 500 GiB; full in ~2h10m (38 GiB per checkpoint every 25 min);
    6 checkpoints here, 4 verified off the machine` (one filesystem of status' disk block)."""
    out = f"{fs['mount']} {size(fs['free_bytes'])} free of {size(fs['total_bytes'])}"
    per, every = fs.get("checkpoint_bytes"), fs.get("interval_s")
    if fs.get("full_in_s") is not None:
        full = ("full before the next save" if fs["full_in_s"] <= 0 else
                f"full in ~{span(fs['full_in_s'])}" if fs["full_in_s"] < FAR_S else "not full within a month")
        out += f"; {full}"
        if per:
            out += f" ({size(per)} per checkpoint" + (f" every {span(every)})" if every else ")")
        if fs.get("reclaimable_bytes"):
            out += f", counting {size(fs['reclaimable_bytes'])} prune may free"
    elif per and fs.get("prune_keeps_up"):
        out += f"; prune keeps it free ({size(per)} per checkpoint" + (f" every {span(every)})" if every else ")")
    elif per:
        out += f"; {size(per)} per checkpoint" + (f" every {span(every)}" if every else "")
    n = fs.get("checkpoints", 0)
    out += f"; {n} checkpoint{'s' if n != 1 else ''} here, {fs.get('verified_off', 0)} verified off the machine"
    return out


def fills(fs: dict) -> list[str]:
    """What fills the disk: the checkpoints (how many, how big, how many off the machine), other folders."""
    out = []
    n, nbytes = fs.get("checkpoints", 0), fs.get("checkpoints_bytes", 0)
    if n:
        out.append(f"- {n} checkpoint{'s' if n != 1 else ''} ({size(nbytes)}), newest {size(fs.get('checkpoint_bytes'))}; "
                   f"{fs.get('verified_off', 0)} of them already off the machine")
    for path, b in fs.get("large_folders", []):
        out.append(f"- {path}: {size(b)}")
    return out


def remedies(fs: dict, prune: str, keep_local: int) -> list[str]:
    """What would free space, from what is known."""
    out = []
    behind = fs.get("checkpoints", 0) - fs.get("verified_off", 0)
    if prune != "synced":
        if fs.get("verified_off"):
            out.append(f"- set [disk] prune = \"synced\": {fs['verified_off']} checkpoint(s) here are verified off "
                       "the machine and could be deleted automatically (or run `supervisorctl prune` once)")
        else:
            out.append("- [disk] prune = \"synced\" deletes checkpoints once they are verified off the machine")
    if behind > 0:
        out.append(f"- {behind} checkpoint(s) are not off the machine yet: a sync that is behind or failing "
                   "(`supervisorctl status`, `supervisorctl sync --wait`) keeps them here")
    if prune == "synced":
        out.append(f"- disk.keep_local = {keep_local} keeps the newest {keep_local} here; a lower value frees more")
    out.append("- keep fewer checkpoints (save_total_limit) or make them smaller (no frozen base model in a LoRA checkpoint)")
    return out


def disk_full_soon(fs: dict, prune: str, keep_local: int, why_kept: str = "") -> Mail:
    """The alert: this filesystem fills up before (or at) one of the next saves."""
    if "short" in fs.get("reasons", []):
        head = f"disk full at the next save: {fs['mount']} has {size(fs['free_bytes'])} free, the next checkpoint needs {size(fs.get('need_bytes'))}"
    elif "forecast" in fs.get("reasons", []):
        head = f"disk full in ~{span(fs.get('full_in_s'))} at {fs['mount']}: {size(fs['free_bytes'])} free"
    else:
        head = (f"disk almost full: {size(fs['free_bytes'])} free of {size(fs['total_bytes'])} "
                f"({fs.get('free_pct', 0):.1f}%) at {fs['mount']}")
    body = [f"{head}.", line(fs), "", "What fills it:", *(fills(fs) or ["- (no checkpoints found)"])]
    if why_kept:
        body += ["", f"Nothing was deleted: {why_kept}"]
    body += ["", "What would free space:", *remedies(fs, prune, keep_local),
             "", "A save that meets a full disk crashes the run and often leaves the newest checkpoint half-written."]
    return Mail(head, "\n".join(body))


def full_at_end(folder: str, mount: str, free: int, total: int, biggest: list[tuple[str, int]]) -> str:
    """The lines a failure mail opens with when the run died of a full disk."""
    out = (f"The disk is full: {folder} (on {mount}) has {size(free)} free of {size(total)}; the training "
           f"could not write its files.\nBiggest here:\n")
    out += "".join(f"  {path}: {size(b)}\n" for path, b in biggest[:6]) or "  (nothing large found)\n"
    return out + ('Free space (or set [disk] prune = "synced": checkpoints verified off the machine are then '
                  "deleted before a save needs the room), then start the training again.\n")

DISK_ADVICE = ("What to do: keep fewer checkpoints (save_total_limit), delete ones already synced off the "
               "machine, move the Hugging Face cache (HF_HOME) to a larger volume, or save less often.")

def disk_full(free_bytes: int, total_bytes: int, free_pct: float, paths: Sequence[str], min_pct: float) -> Mail:
    subject = (f"disk almost full: {free_bytes / GIB:.1f} GiB free of {total_bytes / GIB:.1f} GiB "
               f"({free_pct:.1f}%) at {', '.join(paths)}")
    return Mail(subject, f"{subject}.\nBelow alerts.disk_free_min_pct = {min_pct:g}%. The next checkpoint save "
                         f"may fail or leave a truncated checkpoint.\n\n{DISK_ADVICE}")
