"""The human `supervisorctl status` screen, from the same dict `status --json` prints."""

from __future__ import annotations

from supervisor.durations import format_bytes, format_duration, format_hms
from supervisor.notify.mails import describe_exit
from supervisor.notify.mails.progress import money, steps_rate
from supervisor.notify.mails.sync import behind_line, unselected_line
from supervisor.timefmt import clock as _clock
from supervisor.timefmt import hm, stamp


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
    for x in (st.get("gpu_waste") or [])[:4]:
        who = f" ({x['user']}: {x['command'][:40]})" if x.get("user") else ""
        lines.append(f"  waste   GPU {x['gpu']}: {_gib(x['mem_bytes'])} GiB held by PID {x['pid']}{who}, {x['kind']}, "
                     f"for {format_duration(x['for_s'])}")
    lines.extend(sync_lines(st))
    lines.extend(disk_lines(st))
    lines.extend(idle_lines(st))
    lines.extend(budget_lines(st))
    lines.extend(preemption_lines(st))
    lines.extend(health_lines(st))
    lines.extend(resume_lines(st))
    lines.extend(cluster_lines(st))
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
                     "see docs/fleet.md, \"Under SkyPilot or dstack\"")
    probs = (st.get("daemon") or {}).get("problems") or []
    for p in probs[-3:]:
        lines.append(f"problem   {p}")
    return "\n".join(lines)


# --- the sections: each built from the status dict alone ----------------------------------------------


def progress_line(st: dict) -> str:
    """`progress  [######--------------]  1200/3750  32.0%  loss 1.214  2,410 tok/s  ETA 1h12m
    spent €4.21, to finish ~€4.68`, from `training.progress` and `cost`; "" before any run."""
    p = (st.get("training") or {}).get("progress") or {}
    if p.get("started_at") is None:
        return ""
    try:
        return _progress_line(p, st.get("cost") or {}, st.get("now") or 0)
    except (TypeError, ValueError, KeyError):
        return "progress  unknown"


def _progress_line(p: dict, cost: dict, now: float) -> str:
    parts = ["progress"]
    pct = p.get("percent")
    if pct is not None:
        filled = int(round(pct / 100 * 20))
        parts.append("[" + "#" * filled + "-" * (20 - filled) + "]")
    step, max_steps, epoch, num_epochs = p.get("step"), p.get("max_steps"), p.get("epoch"), p.get("num_epochs")
    if step is not None:
        parts.append(f"{step:,}/{max_steps:,}" if max_steps else f"step {step:,}")
    elif epoch is not None:
        parts.append(f"epoch {epoch:.2f}" + (f"/{num_epochs:g}" if num_epochs else ""))
    else:
        parts.append("unknown (no progress in the log or a checkpoint yet)")
    if pct is not None:
        parts.append(f"{pct:.1f}%")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.4g}")
    finished, ended_at, elapsed = p.get("finished"), p.get("ended_at"), p.get("elapsed_s")
    running = ended_at is None and not finished
    if p.get("tokens_per_s") is not None:
        parts.append(f"{p['tokens_per_s']:,.0f} tok/s")
    elif p.get("steps_per_s") is not None and running:
        parts.append(steps_rate(p["steps_per_s"]))
    if finished:
        took = p["finished_at"] - p["started_at"] if p.get("finished_at") is not None else elapsed
        parts.append(f"done in {format_duration(took)}")
    elif ended_at is not None:
        parts.append(f"ended after {format_duration(elapsed)}")
    elif p.get("stalled_since") is not None:
        parts.append(f"ETA unknown (no progress for {format_duration(now - p['stalled_since'])})")
    else:
        parts.append(f"ETA {format_duration(p.get('eta_s'))}")
    cur = cost.get("currency") or ""
    money_bits = []
    if cost.get("spent") is not None:
        money_bits.append(f"spent {money(cost['spent'], cur)}")
    if cost.get("eta_cost") is not None and running:
        money_bits.append(f"to finish ~{money(cost['eta_cost'], cur)}")
    if money_bits:
        parts.append(", ".join(money_bits))
    elif elapsed is not None:
        parts.append(f"elapsed {format_duration(elapsed)}")
    if p.get("stalled") and p.get("since_step_s") is not None:
        parts.append(f"STALLED: no step for {format_duration(p['since_step_s'])} "
                     f"(since {hm(now - p['since_step_s'])})")
    return "  ".join(parts)


def gpu_lines(st: dict) -> list[str]:
    """One line per GPU from `gpus`; empty when there are none (render_status then shows gpu_error)."""
    return [gpu_line(g) for g in st.get("gpus") or [] if isinstance(g, dict)]


MAX_PROCS_SHOWN = 3
_GIB = 1024**3


def _gib(b: int | None) -> str:
    return "?" if b is None else f"{b / _GIB:.1f}"


def gpu_line(g: dict) -> str:
    """`GPU0 NVIDIA H100 80GB HBM3  util  97%  mem 71.2/80.0 GiB  train pid 1234 70.1 GiB`"""
    head = f"GPU{g.get('index')} {g.get('name') or 'unknown GPU'}"
    if g.get("error"):
        return f"{head}  FAILED: {g['error']}"
    u = g.get("util_pct")
    util = "  ?%" if u is None else f"{u:3.0f}%"
    if u is None and g.get("mig"):
        util += " (MIG)"
    parts = [head, f"util {util}", f"mem {_gib(g.get('mem_used_bytes'))}/{_gib(g.get('mem_total_bytes'))} GiB"]
    # the training's processes first; a crowded GPU is summarised instead of wrapping the screen
    procs = sorted((p for p in g.get("processes") or [] if isinstance(p, dict)),
                   key=lambda p: (not p.get("training"), -(p.get("mem_bytes") or 0)))
    for p in procs[:MAX_PROCS_SHOWN]:
        who = "train" if p.get("training") else "other"
        parts.append(f"{who} pid {p.get('pid')} {_gib(p.get('mem_bytes'))} GiB")
    if len(procs) > MAX_PROCS_SHOWN:
        parts.append(f"+{len(procs) - MAX_PROCS_SHOWN} more")
    return "  ".join(parts)


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
    lines += target_info_lines(sy.get("target_info") or {})
    for w in (sy.get("waiting") or [])[:3]:
        lines.append(f"          waiting {w.get('unit')}: {w.get('reason')}")
    for p in (sy.get("partial") or [])[:3]:
        lines.append(f"          partial {p}")
    for b in (sy.get("target_behind") or [])[:3]:  # a file saved faster than it uploads (targethealth.Behind)
        since = f"behind for {format_duration(now - b['since'])}; " if b.get("since") else ""
        lines.append(f"          {behind_line(b.get('path') or b.get('unit', '?'), b.get('saves', 0))} "
                     f"({since}{b.get('note') or 'save less often, or give the upload more bandwidth'})")
    names = sy.get("unselected") or []
    if names:  # training output no include selects: it stays here (one wording with sync --wait and the mails)
        line = unselected_line(sy.get("unselected_files", len(names)), sy.get("unselected_bytes") or 0, names,
                               sy.get("unselected_items") or len(names))
        lines.append(f"          {line}" + ("; newer than anything on the target: a stop waits for it"
                                           if sy.get("unselected_newer") else ""))
    err = sy.get("last_error")
    if err and sy.get("state") == "failing":
        retry = sy.get("next_retry_in_s")
        retry_text = f", retry in {format_duration(retry)}" if retry is not None else ""
        lines.append(f"          FAILING for {format_duration(sy.get('failing_for_s'))}{retry_text}: {err}")
    elif err:
        lines.append(f"          last error: {err}")
    return lines


def disk_lines(st: dict) -> list[str]:
    """The `disk` block: one forecast line per filesystem, then the last deletes (docs/disk.md)."""
    dk = st.get("disk") or {}
    out = [f"disk      {fs.get('line', '')}" for fs in dk.get("filesystems") or []]
    if out and dk.get("prune") == "synced":
        out.append(f"          prune synced, keep_local {dk.get('keep_local')}: {dk.get('deleted', 0)} deleted "
                   f"({format_bytes(dk.get('freed_bytes', 0))})")
    for e in [e for e in dk.get("recent") or [] if e.get("event") in ("deleted", "delete_failed")][-3:]:
        what = "deleted" if e["event"] == "deleted" else f"delete FAILED ({e.get('error', '')})"
        out.append(f"          {what} {e.get('path')} ({format_bytes(e.get('bytes', 0))}, verified on "
                   f"{e.get('target', 'the target')} {_clock(e.get('verified_at'), st.get('now') or 0)})")
    return out


def target_info_lines(info: dict) -> list[str]:
    """What `sync.target_info` adds (a Hub repo: which upload path and why, private or public,
    the branch; the warning when an existing repo is public). Nothing for targets without it."""
    if info.get("kind") != "hf":
        return []
    path = {"xet": "Xet", "lfs": "LFS"}.get(info.get("upload_path") or "", info.get("upload_path") or "?")
    why = f" ({info['upload_path_reason']})" if info.get("upload_path_reason") else ""
    vis = {True: "private", False: "PUBLIC"}.get(info.get("private"), "not checked yet")
    lines = [f"          via {path}{why}  {info.get('repo_type') or 'model'} repo {vis}, "
             f"branch {info.get('revision') or 'main'}"]
    if info.get("warning"):
        lines.append(f"          WARNING: {info['warning']}")
    return lines


def budget_lines(st: dict) -> list[str]:
    """`budget  spend cap 50.00 USD at 12:10 (in 2h)  stop begins 11:55  spent 38.20 USD` and the projection."""
    b = st.get("budget") or {}
    cap = b.get("cap")
    if not cap:
        return []
    now = st.get("now") or 0
    cur = b.get("currency") or ""
    name = {"max_cost": f"spend cap {b.get('max_cost') or 0:.2f} {cur}", "deadline": "deadline",
            "max_runtime": f"runtime cap {format_duration(b.get('max_runtime_s') or 0)}"}.get(cap["kind"], cap["kind"])
    head = f"budget    {name} at {_clock(cap['at'], now)}  stop begins {_clock(cap['act_at'], now)}"
    if b.get("spent") is not None:
        head += f"  spent {b['spent']:.2f} {cur}"
        if b.get("billing_since"):
            head += f" (billing since {hm(b['billing_since'])}, {b.get('billing_from') or 'boot'})"
    lines = [head]
    p = b.get("projection") or {}
    if p.get("eta_at"):
        need = f"{p['need_cost']:.2f} {cur} " if p.get("need_cost") is not None else ""
        fits = "fits" if p.get("fits") else "does NOT fit: stops before the end"
        ck = f", last checkpoint before the stop about checkpoint-{p['last_checkpoint']}" if p.get("last_checkpoint") else ""
        lines.append(f"          at this rate the run needs {need}(ETA {_clock(p['eta_at'], now)}): {fits}{ck}")
    if b.get("acted"):
        lines.append(f"          stop asked for {b['acted']}")
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
    pv = s.get("provider") or {}
    if pv.get("line") and pv.get("name"):  # the provider's stop and what still bills after it (issue 52)
        lines.append(f"stop      {pv['line']}")
        if "cannot work here" in (s.get("how") or ""):
            lines.append(f"          stops {s['how']}")
    elif s.get("how") and state in ("ACTIVE", "IDLE", "WARNED"):
        lines.append(f"          stops {s['how']}")
    for w in (pv.get("warning"), pv.get("problem")):
        if w:
            lines.append(f"          WARNING: {w}")
    if s.get("confirmed"):
        lines.append(f"stop      confirmed by the provider: {s['confirmed'].get('state')} at {hm(s['confirmed'].get('at'))}")
    if s.get("last_error"):
        lines.append(f"stop      {s['last_error'][:200]}")
    elif s.get("result"):
        lines.append(f"stop      {s['result'][:200]}")
    return lines


_DELIVERY = ("mailed", "not_mailed", "mail_failed")


def _delivery_note(d: dict) -> str:
    if d.get("what") == "mailed":
        return f"mailed {stamp(d.get('at', 0))}"
    if d.get("what") == "not_mailed":
        return f"not mailed: {d.get('reason') or 'no [email] configured'}"
    return f"mail failed: {d.get('error') or '?'}"


def preemption_lines(st: dict) -> list[str]:
    """A spot notice on this machine, or one a previous machine got (told at this boot); else nothing."""
    now = st.get("now") or 0
    p = st.get("preemption") or {}
    out = []
    n = p.get("notice")
    if n:
        newest = n.get("newest") or n.get("newest_at_notice") or "no complete checkpoint"
        where = "on the target" if n.get("newest_on_target") else "NOT on the target yet"
        result = {"synced": "everything complete is on the target", "deadline": "time ran out",
                  "exited": "the daemon exited first"}.get(n.get("outcome") or "", "emergency sync running")
        out.append(f"preempt   NOTICE ({n.get('provider')} {n.get('kind')}) at {_clock(n.get('noticed_at'), now)}; "
                   f"machine goes {_clock(n.get('deadline'), now)}; newest {newest} {where}; {result}")
        if n.get("not_made"):
            out.append(f"          not on the target: {', '.join(n['not_made'][:5])}")
    prev = p.get("previous")
    if prev:
        newest = prev.get("newest") or "no complete checkpoint"
        made = "made it" if prev.get("newest_on_target") else "did NOT make it"
        out.append(f"preempt   the previous machine was preempted at {_clock(prev.get('noticed_at'), now)}; "
                   f"newest {newest} {made}")
    return out


def resume_lines(st: dict) -> list[str]:
    """The restore from the target before a start: progress, the wait while unreachable, the result."""
    r = st.get("resume") or {}
    state = r.get("state")
    if not r.get("enabled") and state in (None, "idle"):
        return []
    if state == "restoring":
        p = r.get("progress") or {}
        eta = p.get("eta_s")
        return [f"resume    restoring {p.get('unit') or '...'}: {_mib(p.get('bytes_done'))} of "
                f"{_mib(p.get('bytes_total'))} MiB at {_mib(p.get('rate_bps'))} MiB/s"
                f"{', ETA ' + format_duration(eta) if eta is not None else ''}"]
    if state == "waiting":
        return [f"resume    WAITING for the target (try {r.get('attempts')}, next in "
                f"{format_duration(r.get('next_try_in_s'))}): {r.get('error')}"]
    if state == "done":
        return [f"resume    {r.get('line') or 'restored'}"]
    if state in ("fresh", "failed"):
        return [f"resume    {state}: {r.get('note') or r.get('error') or ''}"]
    return [f"resume    on; resume from {r.get('resume_from') or 'nothing here yet'}"]


def cluster_lines(st: dict) -> list[str]:
    """A line for the run, then one per node (a run of several machines only)."""
    c = st.get("cluster") or {}
    if not c:
        return []
    nodes = c.get("nodes") or []
    lost = c.get("on_node_lost") == "save_and_stop"
    out = [f"cluster   run {c.get('run_id') or '?'}: node {c.get('rank')} of {len(nodes)}, heartbeats every "
           f"{c.get('heartbeat_s', 0):g}s on {c.get('target')}; a node silent {c.get('silent_after_s', 0):g}s is lost"
           f" ({'save and stop' if lost else 'alert only'})"]
    if c.get("error"):
        out.append(f"  target    {c['error']}")
    trust = c.get("trust") or {}
    if trust and not trust.get("signed"):
        out.append(f"  trust     {trust.get('words')}")
    for n in nodes:
        quiet = n.get("quiet_s")
        seen = "" if n.get("rank") == c.get("rank") else " never heard from" if quiet is None else f" heard {quiet:g}s ago"
        why = f": {n['why']}" if n.get("why") and n.get("state") != "ok" else ""
        me = " (this node)" if n.get("rank") == c.get("rank") else ""
        bad = f"; its heartbeat file: {n['problem']}" if n.get("problem") else ""
        out.append(f"  node {n.get('rank'):<3} {n.get('state', '?'):<8} {n.get('host') or '?'}{me}{seen}{why}{bad}")
    for w in ((c.get("records") or {}).get("waiting") or [])[:3]:
        out.append(f"  waiting   {w.get('unit')}: {w.get('why')}")
    return out


def _mib(n: float | None) -> str:
    return f"{(n or 0) / 2**20:.1f}"


def notify_lines(st: dict) -> list[str]:
    """Where alerts go (or that they go nowhere but here), then a line per failing channel."""
    now = st.get("now") or 0
    out = []
    if "notify" in st:
        chans = (st.get("notify") or {}).get("channels") or []
        out.append("notify    " + (", ".join(f"{c.get('kind') or c.get('name')} ({c.get('target')})" for c in chans)
                                  if chans else "none: alerts reach only `supervisorctl alerts` and the log; "
                                  "add [email] or [notify]"))
    for ch in (st.get("notify") or {}).get("channels") or []:
        if ch.get("state") != "failing":
            continue
        retry = f", retry {_clock(ch['next_try'], now)}" if ch.get("next_try") else ""
        out.append(f"notify    {ch.get('name')} ({ch.get('target')}) FAILING since {_clock(ch.get('failing_since'), now)}: "
                   f"{ch.get('last_error')}; {ch.get('queued', 0)} queued{retry}")
    return out


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
        via = f" [{a['channel']}]" if a.get("channel") and a.get("channel") != "email" else ""
        out.append(f"{t}  {what:<11} {a.get('kind', ''):<18} {a.get('subject', '')}{via}{extra}")
    return "\n".join(out) if out else "no alerts"


def health_lines(st: dict) -> list[str]:
    """The GPU health verdict: one line, and the advice when it is not OK."""
    h = st.get("health") or {}
    v = h.get("verdict")
    if not v:
        return []
    if v == "OK":
        unknown = len(h.get("unknown") or [])
        return [f"health    OK ({h.get('count')} GPU(s)" + (f", {unknown} field(s) unknown" if unknown else "") + ")"]
    out = [f"health    {v}" + (f": {h['advice'].splitlines()[0]}" if h.get("advice") else "")]
    out += [f"          {ln}" for ln in (h.get("advice") or "").splitlines()[1:4]]
    for f in (h.get("live") or [])[:3]:
        out.append(f"          during the run: {'GPU ' + str(f['gpu']) + ': ' if f.get('gpu') is not None else ''}"
                   f"{f.get('what')}")
    if h.get("refused"):
        out.append("          no training starts (health.on_bad)")
    return out


_HEALTH_COLUMNS = (("ecc_mode", "ECC"), ("ecc_uncorrected_volatile", "unc.vol"), ("ecc_uncorrected_aggregate", "unc.agg"),
                   ("retired_pending", "retire.pend"), ("remap_pending", "remap.pend"), ("remap_failed", "remap.fail"),
                   ("pcie_gen", "gen"), ("pcie_gen_max", "gen.max"), ("pcie_width", "width"),
                   ("pcie_width_max", "width.max"), ("throttle", "clk.events"), ("temp_c", "temp C"),
                   ("power_w", "power W"), ("persistence", "persist"), ("nvlink_down", "nvlink.down"),
                   ("nvlink_up", "nvlink.up"))


def _cell(k: str, v) -> str:
    if v is None:
        return "?"
    if isinstance(v, bool):
        return "on" if v and k in ("ecc_mode", "persistence") else "off" if k in ("ecc_mode", "persistence") \
            else "yes" if v else "no"
    if k == "throttle":
        return hex(v)
    if isinstance(v, float):
        return f"{v:.0f}"
    return str(v)


def render_health(h: dict) -> str:
    """`supervisorctl health`: the verdict, what to do, and every field per GPU ("?" = unknown)."""
    lines = [f"verdict   {h.get('verdict') or 'not checked yet'}"
             + (f" ({h.get('preflight')})" if h.get("preflight") else "")]
    if h.get("advice"):
        lines += [f"  {ln}" for ln in h["advice"].splitlines()]
    exp = h.get("expect_gpus")
    lines.append(f"gpus      {h.get('count') if h.get('count') is not None else 'none'}"
                 + (f" of {exp} expected ({h.get('expect_source')})" if exp else " (no expectation set)")
                 + f"; driver {h.get('driver_version') or '?'}, CUDA {h.get('cuda_version') or '?'}")
    if h.get("nvml_error"):
        lines.append(f"nvml      {h['nvml_error']}")
    for g in h.get("gpus") or []:
        if g.get("error"):
            lines.append(f"GPU {g['index']}     {g.get('name') or ''}: {g['error']}")
            continue
        cells = ", ".join(f"{label} {_cell(k, g.get(k))}" for k, label in _HEALTH_COLUMNS)
        lines.append(f"GPU {g['index']}     {g.get('name') or ''}: {cells}")
    b = h.get("burn_in") or {}
    if b.get("state") not in (None, "off"):
        tf = b.get("tflops") or {}
        lines.append(f"burn-in   {b.get('state')}" + (f": {b['note']}" if b.get("note") else "")
                     + (": " + ", ".join(f"GPU {i} {v} TFLOP/s" for i, v in sorted(tf.items(), key=lambda x: int(x[0])))
                        if tf else ""))
    for n in h.get("notes") or []:
        lines.append(f"note      {n}")
    for f in h.get("live") or []:
        lines.append(f"live      {'GPU ' + str(f['gpu']) + ': ' if f.get('gpu') is not None else ''}{f.get('what')}"
                     f" — {f.get('advice')}")
    if h.get("refused"):
        lines.append(f"refused   {h['refused']}")
    lines.append(f"on_bad    {h.get('on_bad')}")
    return "\n".join(lines)
