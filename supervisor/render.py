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
    lines.extend(notify_lines(st))
    orch = st.get("orchestrator") or {}
    if orch.get("name"):
        name = {"skypilot": "SkyPilot", "dstack": "dstack"}.get(orch["name"], orch["name"])
        lines.append(f"stoppers  two: {name} can stop this machine too ({orch.get('evidence', '')}); "
                     "see the README, \"Under SkyPilot or dstack\"")
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


def notify_lines(st: dict) -> list[str]:
    """A line per notification channel that is failing (the working ones say nothing)."""
    now = st.get("now") or 0
    out = []
    for ch in (st.get("notify") or {}).get("channels") or []:
        if ch.get("state") != "failing":
            continue
        retry = f", retry {_clock(ch['next_try'], now)}" if ch.get("next_try") else ""
        out.append(f"notify    {ch.get('name')} ({ch.get('target')}) FAILING since {_clock(ch.get('failing_since'), now)}: "
                   f"{ch.get('last_error')}; {ch.get('queued', 0)} queued{retry}")
    return out


def render_alerts(res: dict) -> str:
    out = []
    for a in res.get("recent", []):
        t = stamp(a.get("at", 0))
        what = a.get("what", "")
        extra = f"  ({a['error']})" if a.get("error") else (f"  ({a['reason']})" if a.get("reason") else "")
        via = f" [{a['channel']}]" if a.get("channel") and a.get("channel") != "email" else ""
        out.append(f"{t}  {what:<11} {a.get('kind', ''):<18} {a.get('subject', '')}{via}{extra}")
    return "\n".join(out) if out else "no alerts"
