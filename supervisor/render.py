"""The human `supervisorctl status` screen, from the same dict `status --json` prints."""

from __future__ import annotations

import datetime as dt

from .durations import format_duration, format_hms


def _clock(t: float | None, now: float) -> str:
    if not t:
        return "-"
    local = dt.datetime.fromtimestamp(t).astimezone()
    when = local.strftime("%H:%M:%S") if abs(t - now) < 20 * 3600 else local.strftime("%Y-%m-%d %H:%M")
    delta = t - now
    rel = f"in {format_duration(delta)}" if delta > 0 else f"{format_duration(-delta)} ago"
    return f"{when} ({rel})"


def training_line(st: dict) -> str:
    """supervisord's shape: name padded, state padded to 10, then details."""
    tr = st.get("training", {})
    now = st.get("now") or 0
    name = (tr.get("session") or "train").ljust(32)
    state = tr.get("state", "UNKNOWN")
    if state in ("RUNNING", "STARTING", "STOPPING") and tr.get("pid"):
        detail = f"pid {tr['pid']}, uptime {format_hms(now - (tr.get('started_at') or now))}"
    elif state in ("FINISHED", "FAILED", "STOPPED") and tr.get("ended_at"):
        how = f"killed by {tr['signal']}" if tr.get("signal") else (
            f"exit code {tr['exit_code']}" if tr.get("exit_code") is not None else "exit status unknown")
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
    pl = (st.get("lines") or {}).get("progress")
    if pl:
        lines.append(f"  {pl}")
    gl = (st.get("lines") or {}).get("gpus") or []
    if gl:
        lines.extend(gl)
    elif st.get("gpu_error"):
        lines.append(f"gpus      none ({st['gpu_error']})")
    lines.extend((st.get("lines") or {}).get("sync") or [])
    idle_lines = (st.get("lines") or {}).get("idle") or []
    if idle_lines:
        lines.extend(idle_lines)
    else:
        idle = st.get("idle") or {}
        lines.append(f"idle      {idle.get('state', '?')}  warn {_clock(idle.get('warn_at'), now)}  "
                     f"stop {_clock(idle.get('stop_at'), now)}")
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


def render_alerts(res: dict) -> str:
    out = []
    for a in res.get("recent", []):
        t = dt.datetime.fromtimestamp(a.get("at", 0)).astimezone().strftime("%Y-%m-%d %H:%M:%S")
        what = a.get("what", "")
        extra = f"  ({a['error']})" if a.get("error") else (f"  ({a['reason']})" if a.get("reason") else "")
        out.append(f"{t}  {what:<11} {a.get('kind', ''):<18} {a.get('subject', '')}{extra}")
    return "\n".join(out) if out else "no alerts"
