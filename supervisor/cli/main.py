"""supervisorctl: one function per verb; each asks the daemon over the control socket and formats.

Exit codes follow supervisorctl's LSB habit: 0 training RUNNING (or FINISHED cleanly), 3 not
running, 4 daemon unreachable, 1 refused/failed, 2 bad config or usage, 5 (sync --wait) output unselected.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.cli.client import request, socket_path
from supervisor.cli.render import render_alerts, render_health, render_status
from supervisor.durations import format_bytes
from supervisor.errors import ClientError, ConfigError, RequestError
from supervisor.notify.mails.sync import unselected_line

if TYPE_CHECKING:
    from supervisor.config import Config

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_UNREACHABLE, EXIT_UNSELECTED = 0, 1, 2, 3, 4, 5


def _cfg(args: argparse.Namespace) -> Config:
    from supervisor.config import load

    return load(args.config)


def _socket(args: argparse.Namespace) -> str:
    return args.socket or socket_path(args.config)


def _req(args: argparse.Namespace, cmd: str, a: dict | None = None, timeout: float = 15.0):
    return request(_socket(args), cmd, a, timeout=timeout)


def cmd_status(args: argparse.Namespace) -> int:
    if args.host or args.hosts_file:
        return cmd_status_hosts(args)
    if args.cluster:
        return cmd_status_cluster(args)
    st = _req(args, "status")
    if args.json:
        st = {k: v for k, v in st.items() if k != "lines"}
        sys.stdout.write(json.dumps(st, indent=2, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(render_status(st) + "\n")
    state = st.get("training", {}).get("state")
    if state == "RUNNING" or (state == "FINISHED" and st["training"].get("exit_code") == 0):
        return EXIT_OK
    return EXIT_NOT_RUNNING


def cmd_status_cluster(args: argparse.Namespace) -> int:
    """Every node of the run from its heartbeat on the target. 0 when every node is ok or finished,
    3 when one is silent or lost, 4 when the target cannot be read."""
    from supervisor.cluster.view import all_well, read_cluster, render_cluster

    try:
        d = read_cluster(_cfg(args), os.environ)
    except ValueError as e:
        sys.stderr.write(f"supervisorctl: status --cluster: {e}\n")
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - the target's own words, one line
        sys.stderr.write(f"supervisorctl: status --cluster: cannot read the target: {e}\n")
        return EXIT_UNREACHABLE
    sys.stdout.write((json.dumps(d, indent=2, sort_keys=True) if args.json else render_cluster(d)) + "\n")
    return EXIT_OK if all_well(d) else EXIT_NOT_RUNNING


def cmd_status_hosts(args: argparse.Namespace) -> int:
    """Many machines: `status --json` on each over ssh, one line per machine. Exit 0 when every
    machine answered, 4 when any did not."""
    from supervisor.fleet.hosts import Host, parse_hosts_file, query_hosts, render_hosts

    hosts = [Host(h) if not args.remote_command else Host(h, args.remote_command) for h in args.host or []]
    if args.hosts_file:
        try:
            hosts += parse_hosts_file(Path(args.hosts_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            sys.stderr.write(f"supervisorctl: hosts file {args.hosts_file}: {getattr(e, 'strerror', None) or e}\n")
            return EXIT_USAGE
    bad = [h.target for h in hosts if h.target.startswith("-")]
    if bad or not hosts:
        sys.stderr.write(f"supervisorctl: not a host: {bad[0]!r}\n" if bad else "supervisorctl: no hosts given\n")
        return EXIT_USAGE
    results = query_hosts(hosts, timeout=args.timeout, ssh_config=args.ssh_config or "",
                          ssh_options=args.ssh_option or [])
    if args.json:
        out = [{"host": r.host, "ok": r.ok, "error": r.error or None, "exit_code": r.exit_code,
                "status": ({k: v for k, v in r.status.items() if k != "lines"} if r.status else None)}
               for r in results]
        sys.stdout.write(json.dumps(out, indent=2, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(render_hosts(results) + "\n")
    return EXIT_OK if all(r.ok for r in results) else EXIT_UNREACHABLE


def cmd_idle_check(args: argparse.Namespace) -> int:
    """For SkyPilot, dstack or any scheduler: exit 0 idle (and for how long), 1 active; any other
    exit (2 no verdict, 4 daemon unreachable, ...) must be treated as active."""
    from supervisor.fleet.hosts import VerdictError, idle_verdict, verdict_text

    try:
        v = idle_verdict(_req(args, "status"))
    except VerdictError as e:
        sys.stderr.write(f"supervisorctl: idle-check: {e}; treat as active\n")
        return EXIT_USAGE
    if args.json:
        sys.stdout.write(json.dumps(v, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(verdict_text(v) + "\n")
    return EXIT_OK if v["idle"] else EXIT_FAIL


def _print_training(res: dict) -> None:
    if res.get("resuming"):
        sys.stdout.write(f"{res.get('note')}\n")
        return
    pid = f" (pid {res['pid']})" if res.get("pid") else ""
    sys.stdout.write(f"{res.get('session', 'train')}: {res.get('state')}{pid}\n")


def cmd_start(args: argparse.Namespace) -> int:
    _print_training(_req(args, "start", timeout=30))
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    res = _req(args, "stop")
    _print_training(res)
    if args.no_wait:
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        st = _req(args, "status")["training"]
        if st["state"] not in ("STOPPING", "RUNNING", "STARTING"):
            _print_training(st)
            return EXIT_OK
        time.sleep(0.5)
    sys.stderr.write("training is still stopping (SIGINT, then SIGTERM, then SIGKILL after the grace)\n")
    return EXIT_FAIL


def cmd_restart(args: argparse.Namespace) -> int:
    _print_training(_req(args, "restart", timeout=args.timeout))
    return EXIT_OK


# Not sent with `run`: the shell's own bookkeeping and the terminal's (tmux gives the job its own),
# and LS_COLORS, which alone can be most of the request.
_RUN_ENV_DROP = frozenset({"_", "SHLVL", "OLDPWD", "PWD", "TMUX", "TMUX_PANE", "LS_COLORS", "COLUMNS", "LINES",
                           "PS1", "PS2", "PROMPT_COMMAND"})
RUN_WATCH_S = 5.0  # `run` waits this long to see the job alive (a typo dies in its first second)
RUN_TAIL_LINES = 15


def run_env(environ: dict[str, str]) -> dict[str, str]:
    """The caller's environment as `run` sends it: their PATH, venv or conda, exported variables."""
    return {k: v for k, v in environ.items() if k not in _RUN_ENV_DROP and not k.startswith("BASH_FUNC_")}


def cmd_run(args: argparse.Namespace) -> int:
    argv = [a for a in args.argv if a != "--"] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        sys.stderr.write("usage: supervisorctl run [--] CMD [ARGS...]\n")
        return EXIT_USAGE
    try:
        cwd = os.getcwd()
    except OSError:
        sys.stderr.write("run: the current folder no longer exists; cd somewhere and try again\n")
        return EXIT_USAGE
    res = _req(args, "run", {"argv": argv, "cwd": cwd, "env": run_env(dict(os.environ))}, timeout=30)
    _print_training(res)
    if res.get("env_withheld"):
        sys.stderr.write(f"run: not passed to the job, each holds a secret of the daemon's: "
                         f"{', '.join(res['env_withheld'])} (name it in training.pass_env to pass it)\n")
    if res.get("resuming"):
        return _follow_restore(args, res.get("after_run_id"))
    return _watch_start(args, res.get("run_id"), res.get("log") or "")


def _follow_restore(args: argparse.Namespace, after: int | None) -> int:
    """The run waits for a restore from the target ([resume] from_target): follow it to the run it
    starts, then watch that run's first seconds like any other. Never report the run before it:
    a restore or start that fails exits 1 with its error; a target that cannot be reached exits 3
    (not running yet: the daemon starts the run by itself once the target answers)."""
    settled: float | None = None  # when the restore ended without a new run showing yet
    while True:
        st = _req(args, "status")
        rs, tr = st.get("resume") or {}, st.get("training") or {}
        state, error = rs.get("state"), rs.get("error") or ""
        if state not in ("restoring", "waiting") and error.startswith("training did not start"):
            sys.stderr.write(f"run: {error}\n")
            return EXIT_FAIL
        if tr.get("run_id") not in (None, after) and state not in ("restoring", "waiting"):
            told = rs.get("line") if state == "done" else rs.get("note") or error
            if told:
                sys.stdout.write(f"{told}\n")
            return _watch_start(args, tr.get("run_id"), tr.get("log") or "")
        if state == "failed":
            sys.stderr.write(f"run: the restore from the target failed, nothing was started: {error}\n")
            return EXIT_FAIL
        if state == "waiting":
            sys.stderr.write(f"run: not started yet: the target cannot be reached ({error}); the training "
                             f"starts by itself once it answers (next try in {rs.get('next_try_in_s', 0):.0f}s; "
                             f"see supervisorctl status)\n")
            return EXIT_NOT_RUNNING
        if state != "restoring":
            settled = settled or time.monotonic()
            if time.monotonic() - settled > RUN_WATCH_S:
                sys.stderr.write(f"run: the restore ended ({state}) but no training started; see supervisorctl status\n")
                return EXIT_NOT_RUNNING
        time.sleep(0.25)


def _watch_start(args: argparse.Namespace, run_id: int | None, log_path: str) -> int:
    """Like a shell, say at once when the command dies in its first seconds (not found, a typo, a
    missing file): how it ended and its last log lines, with a non-zero exit."""
    deadline = time.monotonic() + RUN_WATCH_S
    while True:
        tr = _req(args, "status")["training"]
        if tr.get("run_id") != run_id or tr.get("state") not in ("STARTING", "RUNNING") or \
                time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    state = tr.get("state")
    if tr.get("run_id") != run_id or state in ("STARTING", "RUNNING", "STOPPING"):
        _print_training(tr)
        return EXIT_OK
    if state == "FINISHED":
        sys.stdout.write(f"{tr.get('session', 'train')}: FINISHED at once (exit code 0)\n")
        return EXIT_OK
    from supervisor.notify.mails import describe_exit

    sys.stderr.write(f"run: the training {state} within its first seconds: "
                     f"{describe_exit(tr.get('exit_code'), tr.get('signal'))}\n")
    from supervisor.training.runner import run_log_tail

    tail = run_log_tail(log_path, run_id, RUN_TAIL_LINES)
    if tail:
        sys.stderr.write(f"last lines of {log_path}:\n" + "".join(f"  {ln}\n" for ln in tail))
    return EXIT_FAIL




def cmd_tail(args: argparse.Namespace) -> int:
    """Reads the log file itself: a long `tail -f` should not hold a daemon connection open."""
    try:
        path = _req(args, "status")["training"]["log"]
    except (ClientError, RequestError):
        cfg = _cfg(args)
        path = cfg.training.log or str(Path(cfg.state_dir) / "train.log")
    try:
        f = open(path, "rb")  # noqa: SIM115
    except PermissionError as e:
        sys.stderr.write(f"cannot read the training log {path}: {e.strerror} (it belongs to "
                         f"{_owner(path)}; root can read it: sudo supervisorctl tail)\n")
        return EXIT_FAIL
    except OSError as e:
        sys.stderr.write(f"cannot read the training log {path}: {e.strerror}\n")
        return EXIT_FAIL
    with f:
        sys.stdout.buffer.write(_last_lines(f, args.n))
        sys.stdout.flush()
        if not args.follow:
            return EXIT_OK
        ino = os.fstat(f.fileno()).st_ino
        try:
            while True:
                chunk = f.read(65536)
                if chunk:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                    continue
                time.sleep(0.5)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if st.st_ino != ino or st.st_size < f.tell():  # rotated or truncated
                    f.close()
                    f = open(path, "rb")  # noqa: SIM115
                    ino = os.fstat(f.fileno()).st_ino
        except KeyboardInterrupt:
            return EXIT_OK


def _owner(path: str) -> str:
    import pwd

    try:
        uid = os.stat(path).st_uid
        return pwd.getpwuid(uid).pw_name
    except (OSError, KeyError):
        return "another user"


def _last_lines(f, n: int) -> bytes:
    f.seek(0, os.SEEK_END)
    end = f.tell()
    block = 65536
    data = b""
    pos = end
    while pos > 0 and data.count(b"\n") <= n:
        pos = max(0, pos - block)
        f.seek(pos)
        data = f.read(end - pos)
    f.seek(end)
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:]) if n > 0 else b""


def cmd_attach(args: argparse.Namespace) -> int:
    tr = _req(args, "status")["training"]
    if tr["state"] not in ("RUNNING", "STARTING", "STOPPING"):
        sys.stderr.write(f"training is {tr['state']}: there is no session to attach to "
                         "(see `supervisorctl tail`)\n")
        return EXIT_NOT_RUNNING
    if not os.access(tr["tmux_socket"], os.R_OK | os.W_OK):
        # the session is root's: attaching would be a root shell, which a socket_group member is not given
        sys.stderr.write(f"attach is for root only: the training's tmux session ({tr['tmux_socket']}) "
                         "belongs to root (sudo supervisorctl attach); `supervisorctl tail -f` shows its output\n")
        return EXIT_FAIL
    argv = ["tmux", "-S", tr["tmux_socket"], "attach-session", "-t", f"={tr['session']}"]
    sys.stdout.write("attaching; detach with Ctrl-b d (the training keeps running)\n")
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return EXIT_FAIL  # not reached


def cmd_sync(args: argparse.Namespace) -> int:
    if not args.wait:
        res = _req(args, "sync", {"wait": False})
        s = res.get("sync", {})
        sys.stdout.write(f"sync requested ({s.get('target') or 'no target configured'}: {s.get('state')})\n")
        return EXIT_OK
    done = threading.Event()
    progress = threading.Thread(target=_sync_progress, args=(args, done), daemon=True)
    progress.start()
    try:
        res = _req(args, "sync", {"wait": True, "timeout_s": args.timeout}, timeout=args.timeout + 30)
    finally:
        done.set()
        progress.join(5)
    names = res.get("unselected") or []
    if names:  # never a plain "in sync" while training output no include selects stays here
        sys.stderr.write(f"{unselected_line(res['unselected_files'], res['unselected_bytes'], names, shown=20)}\n")
    if res["ok"]:
        sys.stdout.write(f"{'synced what sync.include selects' if names else 'in sync'}: "
                         f"{res['target'] or '(no target configured)'} holds {res['files']} files "
                         f"({res['bytes']} bytes); uploaded {res['uploaded_files']} now\n")
        return EXIT_UNSELECTED if names else EXIT_OK
    sys.stderr.write(f"sync FAILED: {res['error']}\n")
    units = res.get("unsynced_units") or []
    for line in units or [f"{p}" for p in res.get("unsynced") or []]:
        sys.stderr.write(f"  not synced: {line}\n")
    return EXIT_FAIL


def cmd_resume(args: argparse.Namespace) -> int:
    if args.list:
        res = _req(args, "resume", {"list": True}, timeout=300)
        sys.stdout.write(f"{res['target']}: newest complete: {res.get('newest_complete') or '-'}\n")
        for u in res["units"]:
            step = "-" if u.get("step") is None else str(u["step"])
            sys.stdout.write(f"  {u['unit']:<32} step {step:>8}  {u['state']:<11} {format_bytes(u['bytes']):>10}  "
                             f"saved {u.get('saved_at') or '-'} on {u.get('host') or '-'}"
                             f"{'  (' + u['why'] + ')' if u.get('why') else ''}\n")
        return EXIT_OK
    res = _req(args, "resume", {"checkpoint": args.checkpoint, "dry_run": args.dry_run}, timeout=24 * 3600)
    for s in res.get("skipped") or []:
        sys.stdout.write(f"skipped {s['unit']}: {s['why']}\n")
    for s in res.get("fallbacks") or []:
        sys.stdout.write(f"not used {s['unit']}: {s['why']}\n")
    verb = "would restore" if res.get("dry_run") else ("already here" if res.get("already_here") else "restored")
    step = f"step {res['step']}" if res.get("step") is not None else "step not stated by its name or manifest"
    sys.stdout.write(f"{verb} {res['unit']} ({step}) -> {res['path']} "
                     f"({format_bytes(res['bytes'])}, {res['seconds']}s)\n")
    for c in res.get("companions") or []:
        sys.stdout.write(f"  with {c} (Lightning's ckpt_path=\"last\")\n")
    return EXIT_OK


SYNC_PROGRESS_S = 5.0


def _sync_progress(args: argparse.Namespace, done: threading.Event) -> None:
    """While `sync --wait` waits: a line every few seconds with what is left and what is moving."""
    while not done.wait(SYNC_PROGRESS_S):
        try:
            s = _req(args, "status", timeout=5).get("sync") or {}
        except (ClientError, RequestError):
            continue
        rate = f" at {format_bytes(s['rate_bps'])}/s" if s.get("rate_bps") else ""
        now = f", sending {s['current_file']}{rate}" if s.get("current_file") else ""
        err = f"; last error: {s['last_error']}" if s.get("state") == "failing" and s.get("last_error") else ""
        sys.stderr.write(f"waiting: {s.get('pending_files', 0)} files ({format_bytes(s.get('pending_bytes', 0))}) "
                         f"to go, {s.get('state')}{now}{err}\n")


def cmd_keepalive(args: argparse.Namespace) -> int:
    if args.cancel:
        res = _req(args, "keepalive", {"cancel": True})
    elif args.duration:
        res = _req(args, "keepalive", {"duration": args.duration})
    else:
        sys.stderr.write("usage: supervisorctl keepalive DURATION | --cancel\n")
        return EXIT_USAGE
    sys.stdout.write((res.get("message") if isinstance(res, dict) and res.get("message") else json.dumps(res)) + "\n")
    return EXIT_OK


def cmd_budget(args: argparse.Namespace) -> int:
    req: dict = {}
    if args.amount is not None:
        req["amount"] = args.amount
    if args.deadline is not None:
        req["deadline"] = args.deadline
    if args.runtime is not None:
        req["runtime"] = args.runtime
    res = _req(args, "budget", req)
    sys.stdout.write((res.get("message") if isinstance(res, dict) and res.get("message") else json.dumps(res)) + "\n")
    return EXIT_OK


PRUNE_TIMEOUT_S = 900.0   # the content check of every folder to delete runs first


def cmd_prune(args: argparse.Namespace) -> int:
    """Delete (or with --dry-run list) every local checkpoint the disk wing may delete (root only)."""
    res = _req(args, "prune", {"dry_run": bool(args.dry_run)}, timeout=PRUNE_TIMEOUT_S)
    if not res.get("ok"):
        sys.stderr.write(f"prune: {res.get('error')}\n")
        return EXIT_FAIL
    for path in res.get("would_delete") or []:
        sys.stdout.write(f"would delete {path}\n")
    for path in res.get("deleted") or []:
        sys.stdout.write(f"deleted {path}\n")
    for path, why in sorted((res.get("kept") or {}).items()):
        sys.stdout.write(f"kept    {path}: {why}\n")
    if not (res.get("would_delete") or res.get("deleted") or res.get("kept")):
        sys.stdout.write("no checkpoints found\n")
    return EXIT_OK


def cmd_check_config(args: argparse.Namespace) -> int:
    from supervisor.cli import checkconfig
    from supervisor.config import nothing_watched, parse, resolve_path

    path = args.path or resolve_path(args.config)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        sys.stderr.write(f"{path}: cannot read config file: {e.strerror}\n")
        return EXIT_USAGE
    except UnicodeDecodeError:
        sys.stderr.write(f"{path}: not UTF-8 text\n")
        return EXIT_USAGE
    try:
        cfg = parse(text, path)
    except ConfigError as e:
        for p in e.problems:
            sys.stderr.write(p + "\n")
        return EXIT_USAGE
    plan = checkconfig.stop_plan(cfg)
    problems = nothing_watched(cfg) + checkconfig.channel_problems(cfg) + ([plan.problem] if plan.problem else [])
    if problems:
        sys.stderr.write("".join(p + "\n" for p in problems))
        return EXIT_USAGE
    for w in checkconfig.warnings(cfg, plan):
        sys.stderr.write(f"warning: {w}\n")
    sys.stdout.write(f"stop: {plan.line()}\n" + checkconfig.stop_settings(cfg))  # and where each setting lives
    if cfg.sync.watch_default:
        sys.stdout.write(f"sync.watch not set: watching {', '.join(cfg.sync.watch)} ({cfg.sync.watch_default})\n")
    sys.stdout.write(f"{path}: OK\n")
    return EXIT_OK


def cmd_alerts(args: argparse.Namespace) -> int:
    res = _req(args, "alerts", {"n": args.n})
    if args.json:
        sys.stdout.write(json.dumps(res, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(render_alerts(res) + "\n")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    """A fresh GPU health check. Exit 0 OK, 1 BAD, 3 DEGRADED or UNKNOWN, 4 daemon unreachable."""
    res = _req(args, "health", timeout=60.0)
    if args.json:
        sys.stdout.write(json.dumps(res, indent=2, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(render_health(res) + "\n")
    return {"OK": EXIT_OK, "BAD": EXIT_FAIL}.get(res.get("verdict") or "", EXIT_NOT_RUNNING)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="supervisorctl", description="control train-supervisor")
    ap.add_argument("--config", help="config file (for the socket path)")
    ap.add_argument("--socket", help="control socket path (overrides the config)")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")
    p = sub.add_parser("status", help="training, GPUs, sync, idle clock, alerts")
    p.add_argument("--json", action="store_true", help="machine-readable (stable contract)")
    p.add_argument("--host", action="append", metavar="HOST",
                   help="ask this machine over ssh instead (repeat for many: one line each)")
    p.add_argument("--hosts-file", metavar="FILE", help="machines, one per line: HOST [SUPERVISORCTL COMMAND]")
    p.add_argument("--remote-command", metavar="CMD", help="supervisorctl on the --host machines "
                   "(default: supervisorctl, also looked for in /opt/train-supervisor/bin)")
    p.add_argument("--ssh-config", metavar="FILE", help="ssh_config file for --host (ssh -F)")
    p.add_argument("--ssh-option", "-o", action="append", metavar="OPT", help="ssh -o option for --host")
    p.add_argument("--timeout", type=float, default=30, help="seconds to wait for each --host (default 30)")
    p.add_argument("--cluster", action="store_true", help="every node of the run, from the heartbeats on the target")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("idle-check", help="exit 0 when this machine is idle (and say for how long), 1 when "
                       "active; anything else: treat as active")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_idle_check)
    sub.add_parser("start", help="start the configured training").set_defaults(fn=cmd_start)
    p = sub.add_parser("stop", help="stop the training (SIGINT, SIGTERM, SIGKILL after grace)")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--timeout", type=float, default=300)
    p.set_defaults(fn=cmd_stop)
    p = sub.add_parser("restart", help="stop then start the training")
    p.add_argument("--timeout", type=float, default=300)
    p.set_defaults(fn=cmd_restart)
    p = sub.add_parser("run", help="start CMD as the training now")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("tail", help="the training log")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("-n", type=int, default=40)
    p.set_defaults(fn=cmd_tail)
    sub.add_parser("attach", help="tmux attach to the training session").set_defaults(fn=cmd_attach)
    p = sub.add_parser("sync", help="sync now")
    p.add_argument("--wait", action="store_true", help="block until the target holds everything")
    p.add_argument("--timeout", type=float, default=3600)
    p.set_defaults(fn=cmd_sync)
    p = sub.add_parser("resume", help="the target's checkpoints (--list), or restore the newest complete one")
    p.add_argument("--list", action="store_true", help="show the target's units: step, complete or not, size")
    p.add_argument("--checkpoint", metavar="NAME", help="restore this unit instead of the newest complete one")
    p.add_argument("--dry-run", action="store_true", help="say what would be restored, download nothing")
    p.set_defaults(fn=cmd_resume)
    p = sub.add_parser("keepalive", help="postpone the idle stop, e.g. 2h")
    p.add_argument("duration", nargs="?")
    p.add_argument("--cancel", action="store_true")
    p.set_defaults(fn=cmd_keepalive)
    p = sub.add_parser("budget", help="show or change a cap (root): budget +20, budget --deadline T")
    p.add_argument("amount", nargs="?", help="+20 raises the spend cap by 20; 50 sets it")
    p.add_argument("--deadline", help='a local time like "2026-12-05 08:00" or an ISO 8601 timestamp')
    p.add_argument("--runtime", help="a runtime cap since boot, e.g. 12h")
    p.set_defaults(fn=cmd_budget)

    p = sub.add_parser("prune", help="delete local checkpoints verified off the machine (root)")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted and why the rest stays")
    p.set_defaults(fn=cmd_prune)
    p = sub.add_parser("check-config", help="validate the config without starting anything")
    p.add_argument("path", nargs="?")
    p.set_defaults(fn=cmd_check_config)
    p = sub.add_parser("alerts", help="the last alerts sent (or that failed to send)")
    p.add_argument("-n", type=int, default=30)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_alerts)
    p = sub.add_parser("health", help="check the GPUs now: OK, DEGRADED or BAD, and what to do")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_health)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ClientError as e:
        sys.stderr.write(f"supervisorctl: {e}\n")
        return e.exit_code
    except RequestError as e:
        sys.stderr.write(f"supervisorctl: {e}\n")
        return EXIT_FAIL
    except ConfigError as e:
        sys.stderr.write("supervisorctl: the config has problems:\n" + "".join(f"  {p}\n" for p in e.problems))
        return EXIT_USAGE
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:  # one line, never a traceback, whatever broke between us and the daemon
        sys.stderr.write(f"supervisorctl: {e.strerror or e}\n")
        return 4


if __name__ == "__main__":
    sys.exit(main())
