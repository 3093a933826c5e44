"""The human `supervisorctl status` screen, from the same dict `status --json` prints."""

from __future__ import annotations

from .durations import format_hms
from .mails import describe_exit
from .timefmt import clock as _clock
from .timefmt import stamp


def training_line(st: dict) -> str:
    """supervisord's shape: name padded, state padded to 10, then details."""
    tr = st.get("training", {})
    now = st.get("now") or 0
    name = (tr.get("session") or "train").ljust(32)
    state = tr.get("state", "UNKNOWN")
    if state in ("RUNNING", "STARTING", "STOPPING") and tr.get("pid"):
        detail = f"pid {tr['pid']}, uptime {format_hms(now - (tr.get('started_at') or now))}"
    elif state in ("FINISHED", "FAILED", "STOPPED") and tr.get("ended_at"):
        how = describe_exit(tr.get("exit_code"), tr.get("signal"))
        detail = f"{how}, ended {_clock(tr['ended_at'], now)}"
    else:
        detail = tr.get("note") or ("no training started" if state == "STOPPED" else "")
    return f"{name} {state.ljust(10)} {detail}".rstrip()


def render_status(st: dict) -> str:
    now = st.get("now") or 0
    tr = st.get("training", {})
    lines = [training_line(st)]
    if tr.get("command"):
        lines.append(f"  command   {tr['command']}")
    if tr.get("log"):
        lines.append(f"  log       {tr['log']}")
    if tr.get("note") and tr.get("state") not in ("STOPPED",):
        lines.append(f"  note      {tr['note']}")
    pl = progress_line(st)
    if pl:
        lines.append(f"  {pl}")
    gl = gpu_lines(st)
    if gl:
        lines.extend(gl)
    elif st.get("gpu_error"):
        lines.append(f"gpus      none ({st['gpu_error']})")
    lines.extend(sync_lines(st))
    lines.extend(idle_lines(st))
    alerts = st.get("alerts") or []
    if alerts:
        for a in alerts[:5]:
            lines.append(f"alert     [{a.get('severity')}] {a.get('subject')} (since {_clock(a.get('since'), now)})")
    else:
        lines.append("alerts    none active")
    probs = (st.get("daemon") or {}).get("problems") or []
    for p in probs[-3:]:
        lines.append(f"problem   {p}")
    return "\n".join(lines)


# --- the sections: each built from the status dict alone ----------------------------------------------
# (transitional: until each subsystem's lines move here, they come pre-rendered in st["lines"])


def progress_line(st: dict) -> str:
    return (st.get("lines") or {}).get("progress") or ""


def gpu_lines(st: dict) -> list[str]:
    return list((st.get("lines") or {}).get("gpus") or [])


def sync_lines(st: dict) -> list[str]:
    return list((st.get("lines") or {}).get("sync") or [])


def idle_lines(st: dict) -> list[str]:
    got = (st.get("lines") or {}).get("idle") or []
    if got:
        return list(got)
    now = st.get("now") or 0
    idle = st.get("idle") or {}
    return [f"idle      {idle.get('state', '?')}  warn {_clock(idle.get('warn_at'), now)}  "
            f"stop {_clock(idle.get('stop_at'), now)}"]


_DELIVERY = ("mailed", "not_mailed", "mail_failed")


def _delivery_note(d: dict) -> str:
    if d.get("what") == "mailed":
        return f"mailed {stamp(d.get('at', 0))}"
    if d.get("what") == "not_mailed":
        return f"not mailed: {d.get('reason') or 'no [email] configured'}"
    return f"mail failed: {d.get('error') or '?'}"


def render_alerts(res: dict) -> str:
    """One line per alert, with what became of its mail folded in: the log records an alert and
    its delivery separately, and two lines with the same subject read as two alerts."""
    recent = res.get("recent", [])
    lines: list[list] = []  # [entry, delivery entry or None]
    for a in recent:
        if a.get("what") in _DELIVERY:
            subj = a.get("subject", "")
            for line in reversed(lines):
                e = line[0]
                if (e.get("what") not in _DELIVERY and e.get("key") == a.get("key")
                        and subj in (e.get("subject"), f"RESOLVED: {e.get('subject')}")):
                    if line[1] is None or line[1].get("what") == "mail_failed":
                        line[1] = a
                        break
            else:
                lines.append([a, None])  # a reminder, or its alert is older than the list
            continue
        lines.append([a, None])
    out = []
    for a, d in lines:
        t = stamp(a.get("at", 0))
        what = a.get("what", "")
        if d is not None:
            extra = f"  ({_delivery_note(d)})"
        elif what in _DELIVERY:
            extra = f"  ({a['error']})" if a.get("error") else (f"  ({a['reason']})" if a.get("reason") else "")
        else:
            extra = ""
        out.append(f"{t}  {what:<11} {a.get('kind', ''):<18} {a.get('subject', '')}{extra}")
    return "\n".join(out) if out else "no alerts"
