"""The human `supervisorctl status` screen, from the same dict `status --json` prints."""

from __future__ import annotations

from .durations import format_bytes, format_duration, format_hms
from .mails import describe_exit
from .timefmt import clock as _clock
from .timefmt import hm, stamp


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
    """The `sync` block: target and state, what is pending and uploaded, units still waiting,
    partial ones, and the error (FAILING while the target fails)."""
    sy = st.get("sync") or {}
    if not sy:
        return []
    if sy.get("state") == "disabled":
        return ["sync      disabled (no sync.target configured)"]
    now = st.get("now") or 0
    head = f"sync      {sy.get('target', '')}  {sy.get('state', '?')}"
    if sy.get("current_file") and sy.get("state") == "uploading":
        head += f"  {sy['current_file']}"
        if sy.get("rate_bps"):
            head += f" at {format_bytes(sy['rate_bps'])}/s"
    lines = [head]
    last_ok = sy.get("last_ok_at")
    ok = f"{format_duration(now - last_ok)} ago" if last_ok else "never"
    lines.append(f"          pending {sy.get('pending_files', 0)} files ({format_bytes(sy.get('pending_bytes', 0))})  "
                 f"uploaded {sy.get('uploaded_files', 0)} files ({format_bytes(sy.get('uploaded_bytes', 0))})  "
                 f"last ok {ok}")
    for w in (sy.get("waiting") or [])[:3]:
        lines.append(f"          waiting {w.get('unit')}: {w.get('reason')}")
    for p in (sy.get("partial") or [])[:3]:
        lines.append(f"          partial {p}")
    err = sy.get("last_error")
    if err and sy.get("state") == "failing":
        retry = sy.get("next_retry_in_s")
        retry_text = f", retry in {format_duration(retry)}" if retry is not None else ""
        lines.append(f"          FAILING for {format_duration(sy.get('failing_for_s'))}{retry_text}: {err}")
    elif err:
        lines.append(f"          last error: {err}")
    return lines


def idle_lines(st: dict) -> list[str]:
    """The idle clock and the stop, from `idle` and `stop` of the status dict."""
    i, s = st.get("idle") or {}, st.get("stop") or {}
    now = st.get("now") or 0
    state = i.get("state", "?")
    lines = []
    if state == "ACTIVE":
        why = "; ".join(i.get("reasons") or []) or "starting up"
        lines.append(f"idle      ACTIVE  {why}")
        if i.get("mode") == "finish":
            lines.append(f"          training ended: stops {format_duration(i.get('finish_grace_s') or 0)} after "
                         "the last activity ends")
        else:
            lines.append(f"          warns {format_duration(i.get('warn_after_s') or 0)} after the last activity, "
                         f"stops {format_duration(i.get('stop_after_warning_s') or 0)} after the warning")
    elif state == "IDLE":
        lines.append(f"idle      IDLE for {format_duration(i.get('idle_for_s') or 0)} (since {hm(i.get('idle_since'))})  "
                     f"warn {_clock(i.get('warn_at'), now)}  stop {_clock(i.get('stop_at'), now)}")
    elif state == "WARNED":
        head = "training ended, grace" if i.get("mode") == "finish" else f"warned {hm(i.get('warn_at'))}"
        lines.append(f"idle      WARNED  {head}  stop {_clock(i.get('stop_at'), now)}  "
                     "prevent: supervisorctl keepalive 2h")
    else:
        lines.append(f"idle      {state}  ({s.get('reason') or 'idle'})  stop {s.get('action')}  "
                     f"phase {s.get('phase') or '-'}")
    if i.get("idle_cost"):
        lines.append(f"          idle cost so far {i['idle_cost']:.2f} {i.get('currency') or ''}".rstrip())
    if i.get("training_stalled") and state != "ACTIVE" and s.get("phase") != "interrupting":
        lines.append("          training is still running but looks stalled (no GPU load, no log output)")
    fs = s.get("final_sync") or {}
    if fs.get("ok") and (fs.get("damaged") or fs.get("partial_units")):
        named = [*(fs.get("partial_units") or []), *(fs.get("damaged") or [])]
        lines.append(f"stop      final sync sent as they are: {'; '.join(named[:3])}"
                     + (f" and {len(named) - 3} more" if len(named) > 3 else ""))
    if s.get("phase") == "interrupting":
        lines.append(f"stop      interrupting run {s.get('interrupted_run')} (since {hm(s.get('interrupted_at'))}) "
                     "so it can save; the final sync follows its end")
    if s.get("last_error"):
        lines.append(f"stop      {s['last_error'][:200]}")
    elif s.get("result"):
        lines.append(f"stop      {s['result'][:200]}")
    return lines


def render_alerts(res: dict) -> str:
    out = []
    for a in res.get("recent", []):
        t = stamp(a.get("at", 0))
        what = a.get("what", "")
        extra = f"  ({a['error']})" if a.get("error") else (f"  ({a['reason']})" if a.get("reason") else "")
        out.append(f"{t}  {what:<11} {a.get('kind', ''):<18} {a.get('subject', '')}{extra}")
    return "\n".join(out) if out else "no alerts"
