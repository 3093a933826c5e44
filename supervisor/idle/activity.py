"""Activity probes: is a person or a working job on this machine right now?

Each probe looks afresh on every poll (nothing is cached between polls: a cached session map
once hid a new login and a cluster was stopped under its user) and returns `(active, reason)`,
where the reason is a short line a user reads in status and mails. No probe raises: a probe
that fails reports inactive with the error as its reason, and logs it once.

The few probes that need a previous reading to see a change (log growth, CPU time) keep only
that reading, never a verdict.
"""

from __future__ import annotations

import datetime as dt
import glob
import os
import stat
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
import structlog

from supervisor.config import IdleConfig
from supervisor.durations import format_duration
from supervisor.idle.machine import Now, Signal, Signals
from supervisor.interfaces import GpuView, TrainingInfo
from supervisor.proc import CpuProbe
from supervisor.states import TRAINING_ALIVE, TrainingState
from supervisor.untrusted import Unreadable, json_doc

log = structlog.get_logger("activity")

Probe = tuple[bool, str]

# the per-connection server processes a remote shell hangs from (OpenSSH >= 9.8 forks
# "sshd-session", 10.0 also "sshd-auth"; mosh-server detaches from sshd but is a remote terminal all the same)
SSH_SERVERS = frozenset({"sshd", "sshd-session", "sshd-auth", "mosh-server", "dropbear"})

_logged: dict[str, str] = {}


def _log_once(key: str, message: str, **kw) -> None:
    """Log a probe problem when it first appears or changes, not on every poll."""
    if _logged.get(key) != message:
        _logged[key] = message
        log.warning("probe_problem", probe=key, problem=message, **kw)


def _log_cleared(key: str) -> None:
    if _logged.pop(key, None) is not None:
        log.info("probe_recovered", probe=key)


def safe(name: str, fn: Callable[..., Probe], *args, **kwargs) -> Probe:
    """Run a probe; any exception becomes (False, "<name>: probe failed: ...")."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a probe must never take the guard down
        msg = f"{type(e).__name__}: {e}"[:200]
        _log_once(f"{name}:crash", msg)
        return False, f"{name}: probe failed ({msg})"


def _ago(seconds: float) -> str:
    return format_duration(max(0.0, seconds))


# --- SSH -----------------------------------------------------------------------------------------
def _pts_devices() -> dict[int, str]:
    """Device number -> /dev/pts/N, read now. psutil's Process.terminal() uses a map it builds
    once per process and memoizes, so a terminal opened later is never recognised: exactly the
    cached-map bug that stopped a cluster under a freshly logged-in user."""
    out: dict[int, str] = {}
    for path in glob.glob("/dev/pts/[0-9]*"):
        try:
            out[os.stat(path).st_rdev] = path
        except OSError:
            continue
    return out


def _proc_table() -> dict[int, dict]:
    """pid -> {pid, ppid, name, tty} for every process, from one read of /proc/PID/stat each
    (comm is cut at 15 characters there, which every name in SSH_SERVERS fits)."""
    out: dict[int, dict] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue  # gone, or not ours to read
        open_, close = raw.find(b"("), raw.rfind(b")")
        rest = raw[close + 2:].split()  # state ppid pgrp session tty_nr ...
        try:
            out[int(entry.name)] = {"pid": int(entry.name), "name": raw[open_ + 1:close].decode("utf-8", "replace"),
                                    "ppid": int(rest[1]), "tty": int(rest[4])}
        except (IndexError, ValueError):
            continue
    return out


def ssh_sessions(count_tunnels: bool = False) -> list[dict]:
    """The people connected over SSH now, each {user, tty, host, pid, kind}:
    - "pty": a /dev/pts/* with an SSH-server ancestor (a login; what SkyPilot counts), and utmp logins
      whose process is alive (utmp is often absent in containers, and can hold stale entries);
    - "session": a command running under an SSH connection without a terminal. VS Code Remote-SSH,
      Cursor and JetBrains Gateway work this way: their server re-parents to init and owns its own
      ptys, and the editor keeps an SSH session open (a shell waiting on its stdin) while it is open;
    - "tunnel" (only with `count_tunnels`): a connection that carries no session at all, only
      forwarded ports (`ssh -N -L ...`)."""
    procs = _proc_table()
    pts = _pts_devices()
    found: dict[str, dict] = {}
    servers: dict[str, int] = {}
    for pid, info in procs.items():
        tty = pts.get(info["tty"]) if pts and info["tty"] else None
        if not tty or tty in found:
            continue
        server = _server_ancestor(pid, procs)
        if server is None:
            continue
        found[tty] = {"user": _username(pid), "tty": tty[len("/dev/"):], "host": "", "pid": pid, "kind": "pty"}
        servers[tty] = server
    in_pty = set(servers.values())
    for pid in sorted(procs):
        info = procs[pid]
        if info["name"] in SSH_SERVERS or (pts and pts.get(info["tty"])):
            continue
        server = _server_ancestor(pid, procs)
        key = f"ssh-session:{server}"
        if server is None or server in in_pty:
            continue
        if key in found and (info["ppid"] != server or procs[found[key]["pid"]]["ppid"] == server):
            continue  # one entry per connection, named after the command sshd started (its direct child)
        if "[" in _title(server):
            continue  # a helper of the login itself (PAM's unix_chkpwd under "sshd: me [priv]"): nobody yet
        found[key] = {"user": _username(pid), "tty": "", "host": "", "pid": pid, "kind": "session",
                      "command": info["name"]}
        servers[key] = server
    peers = _peers(procs) if servers or count_tunnels else {}
    for key, server in servers.items():
        found[key]["host"] = _peer_of(server, procs, peers)
    if count_tunnels:
        _tunnels(procs, peers, list(servers.values()), found)
    try:
        users = psutil.users()
    except Exception as e:  # noqa: BLE001 - a broken utmp is reported, the /proc view still counts
        _log_once("ssh:utmp", f"{type(e).__name__}: {e}")
        users = []
    for u in users:
        term = u.terminal or ""
        key = f"/dev/{term}" if term and not term.startswith("/") else term
        if not key or key in found:
            continue
        if getattr(u, "pid", None) and not psutil.pid_exists(u.pid):
            continue  # a stale utmp record of a session that is gone
        found[key] = {"user": u.name, "tty": term, "host": u.host or "", "pid": getattr(u, "pid", None),
                      "kind": "pty"}
    return sorted(found.values(), key=lambda s: (s["tty"] == "", s["tty"], s["pid"] or 0))


def _tunnels(procs: dict[int, dict], peers: dict[int, str], session_servers: list[int], found: dict) -> None:
    """Add the authenticated SSH connections that carry no session (bare port forwards)."""
    kids: dict[int, list[int]] = {}
    for pid, info in procs.items():
        if info["name"] in SSH_SERVERS:
            kids.setdefault(info["ppid"], []).append(pid)
    carrying = [_ancestry(sv, procs) for sv in session_servers]
    for pid in sorted(peers):
        info = procs.get(pid)
        if info is None or info["name"] not in SSH_SERVERS:
            continue
        mine = _ancestry(pid, procs)
        if any(pid in a or a[0] in mine for a in carrying):
            continue  # this connection carries a session already counted
        group, todo = [], [pid]
        while todo:
            q = todo.pop()
            group.append(q)
            todo.extend(kids.get(q, []))
        # sshd titles its processes: "[listener]", "[priv]", "[net]", "[accepted]" before and during
        # authentication (a scanner knocking is nobody); "user@notty" or "sshd: user" once logged in
        authed = [q for q in group if "[" not in _title(q)]
        if not authed:
            continue
        carrying.append(mine)
        found[f"ssh-tunnel:{pid}"] = {"user": _username(authed[-1]), "tty": "", "host": peers[pid], "pid": pid,
                                      "kind": "tunnel"}


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(512).replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return "["  # gone or unreadable: not known to be logged in


def _ancestry(pid: int, procs: dict[int, dict]) -> list[int]:
    """pid, its parent, its parent's parent ... (at most 64)."""
    out = [pid]
    cur = procs.get(pid)
    while cur is not None and len(out) < 64:
        ppid = cur.get("ppid")
        if not ppid or ppid in out:
            break
        out.append(ppid)
        cur = procs.get(ppid)
    return out


def _username(pid: int) -> str:
    try:
        return psutil.Process(pid).username()
    except (psutil.Error, KeyError):
        return "?"


def _server_ancestor(pid: int, procs: dict[int, dict]) -> int | None:
    seen = 0
    cur = procs.get(pid)
    while cur is not None and seen < 64:
        if cur.get("name") in SSH_SERVERS:
            return cur["pid"]
        ppid = cur.get("ppid")
        if not ppid or ppid == cur["pid"]:
            return None
        cur = procs.get(ppid)
        seen += 1
    return None


def _peers(procs: dict[int, dict]) -> dict[int, str]:
    """SSH server pid -> remote address of its first established TCP connection. Only the SSH
    servers' own sockets are looked at (all that is asked of this map): psutil.net_connections()
    would list every fd of every process on the machine, a training's thousands included."""
    out: dict[int, str] = {}
    for pid, info in procs.items():
        if info["name"] not in SSH_SERVERS:
            continue
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.Error, OSError):
            continue
        for c in conns:
            if c.status == psutil.CONN_ESTABLISHED and c.raddr:
                out[pid] = c.raddr.ip
                break
    return out


def _peer_of(server: int, procs: dict[int, dict], peers: dict[int, str]) -> str:
    """The session sshd's socket, or its privileged monitor's (the parent holds it too)."""
    cur = procs.get(server)
    for _ in range(4):
        if cur is None or cur.get("name") not in SSH_SERVERS:
            break
        if cur["pid"] in peers:
            return peers[cur["pid"]]
        cur = procs.get(cur.get("ppid") or 0)
    return ""


def describe_session(s: dict) -> str:
    where = f" from {s['host']}" if s.get("host") else ""
    kind = s.get("kind", "pty")
    what = s["tty"] if kind == "pty" else (f"no terminal: {s.get('command') or '?'}" if kind == "session"
                                           else "tunnel, no session")
    return f"ssh: {s['user']}{where} ({what})"


def probe_ssh(count_tunnels: bool = False) -> Probe:
    sessions = ssh_sessions(count_tunnels)
    if not sessions:
        return False, "ssh: nobody logged in"
    text = "; ".join(describe_session(s) for s in sessions[:3])
    if len(sessions) > 3:
        text += f" and {len(sessions) - 3} more"
    return True, text


# --- tmux ----------------------------------------------------------------------------------------
def probe_tmux(socket: str, session: str, binary: str = "tmux") -> Probe:
    """Clients attached to the training's tmux session: someone is watching it."""
    if not socket:
        return False, "tmux: no training session"
    try:
        mode = os.stat(socket).st_mode
    except OSError:
        return False, "tmux: no training session"
    if not mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH):
        # the tmux server marks its socket executable while any client is attached (and clears it
        # when the last one leaves): no mark, nobody attached, and no tmux client started to ask
        return False, f"tmux: nobody attached to {session}"
    try:
        cp = subprocess.run([binary, "-S", socket, "list-clients", "-t", f"={session}", "-F", "#{client_tty}"],
                            capture_output=True, text=True, timeout=5, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return False, "tmux: not installed"
    except subprocess.TimeoutExpired:
        _log_once("tmux", "list-clients timed out")
        return False, "tmux: list-clients timed out"
    ttys = [t.strip() for t in cp.stdout.splitlines() if t.strip()] if cp.returncode == 0 else []
    if not ttys:
        return False, f"tmux: nobody attached to {session}"
    n = len(ttys)
    return True, f"tmux: {n} client{'s' if n > 1 else ''} attached to {session} ({', '.join(ttys[:3])})"


# --- Jupyter -------------------------------------------------------------------------------------
def _parse_ts(v: object) -> float | None:
    if not isinstance(v, str) or not v:
        return None
    try:
        t = dt.datetime.fromisoformat(v)
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)  # Jupyter Server writes UTC
    return t.timestamp()


class JupyterProbe:
    """A Jupyter Server's REST API. `/api/status` is free to poll; the kernel and terminal lists
    are asked for with `?no_track_activity=1`, or polling them would itself count as activity.
    Unreachable or refusing counts as no activity, logged once."""

    def __init__(self, url: str, token_file: str = "", timeout: float = 3.0):
        self.base = url.rstrip("/")
        self.token_file = token_file
        self.timeout = timeout

    def _token(self) -> str:
        if not self.token_file:
            return os.environ.get("JUPYTER_TOKEN", "")
        return Path(self.token_file).read_text(encoding="utf-8").strip()

    def _get(self, path: str, token: str) -> object:
        import urllib.request  # here: ~1 MiB of a daemon at rest that has no Jupyter to ask

        req = urllib.request.Request(self.base + path, headers={"Accept": "application/json"})
        if token:
            req.add_header("Authorization", f"token {token}")
        with urllib.request.urlopen(req, timeout=self.timeout) as r:  # noqa: S310 - the configured URL
            try:
                return json_doc(r.read(4 * 1024 * 1024), what="Jupyter's answer")
            except Unreadable:
                return None

    def probe(self, now_wall: float, window: float) -> Probe:
        if not self.base:
            return False, "jupyter: not configured"
        import urllib.error
        try:
            token = self._token()
        except OSError as e:
            _log_once("jupyter", f"cannot read jupyter_token_file: {e.strerror or e}")
            return False, f"jupyter: cannot read the token file {self.token_file}"
        try:
            status = self._get("/api/status", token)
            kernels = self._get("/api/kernels?no_track_activity=1", token)
        except urllib.error.HTTPError as e:
            why = "token rejected" if e.code in (401, 403) else f"HTTP {e.code}"
            _log_once("jupyter", f"{why} at {self.base}")
            return False, f"jupyter: {why}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            _log_once("jupyter", f"unreachable at {self.base}: {reason}")
            return False, "jupyter: unreachable (counted as no activity)"
        _log_cleared("jupyter")
        try:
            terminals = self._get("/api/terminals?no_track_activity=1", token)
        except (urllib.error.URLError, OSError, ValueError):
            terminals = []  # terminals are an optional extension; 404 when disabled
        kernels = kernels if isinstance(kernels, list) else []
        terminals = terminals if isinstance(terminals, list) else []
        for k in kernels:
            if isinstance(k, dict) and k.get("execution_state") == "busy":
                return True, f"jupyter: kernel {k.get('name') or k.get('id', '?')} busy"
        recent: list[tuple[float, str]] = []
        for k in kernels:
            if isinstance(k, dict) and (t := _parse_ts(k.get("last_activity"))) is not None:
                recent.append((now_wall - t, f"kernel {k.get('name') or '?'}"))
        for term in terminals:
            if isinstance(term, dict) and (t := _parse_ts(term.get("last_activity"))) is not None:
                recent.append((now_wall - t, f"terminal {term.get('name') or '?'}"))
        recent.sort()
        if recent and recent[0][0] < window:
            return True, f"jupyter: {recent[0][1]} active {_ago(recent[0][0])} ago"
        # the server's own clock covers every request (an open notebook tab polls it)
        t = _parse_ts(status.get("last_activity")) if isinstance(status, dict) else None
        if t is not None:
            recent.append((now_wall - t, "request"))
            if now_wall - t < window:
                return True, f"jupyter: last request {_ago(now_wall - t)} ago"
        if recent:
            n = len(kernels)
            return False, f"jupyter: quiet for {_ago(min(recent)[0])} ({n} kernel{'s' if n != 1 else ''})"
        return False, "jupyter: no activity recorded"


# --- GPU -----------------------------------------------------------------------------------------
class GpuProbe:
    """GPU load over the rolling window, above the threshold.

    Unknown utilization is not idleness when a training runs on a GPU that exists (too few samples
    after a restart, an NVML timeout): it counts as busy, but only for `2 x window`, so a GPU that
    never reports utilization (MIG, NotSupported) cannot keep a stalled job alive forever; the
    training is then judged by its log output. No GPU or no driver at all never keeps the machine up.
    """

    def __init__(self) -> None:
        self.unknown_since: float | None = None
        self.figure = ""  # the reading in two words, for a mail about the training ("GPU 3%")

    def probe(self, gpu: GpuView | None, now_mono: float, window: float, threshold: float,
              training_alive: bool) -> Probe:
        self.figure = "no GPU"
        if gpu is None:
            return False, "gpu: not monitored"
        util = gpu.utilization(window)
        span = format_duration(window)
        self.figure = "GPU unknown" if util is None else f"GPU {util:.0f}%"
        if util is not None:
            self.unknown_since = None
            if util > threshold:
                return True, f"gpu: {util:.0f}% over {span}"
            return False, f"gpu: {util:.0f}% over {span} (idle below {threshold:g}%)"
        st = gpu.status() or {}
        if not st.get("gpus"):
            self.figure = "no GPU"
            return False, f"gpu: none ({st.get('gpu_error') or 'no GPU found'})"
        if not training_alive:
            self.unknown_since = None
            return False, "gpu: utilization unknown, no training running"
        if self.unknown_since is None:
            self.unknown_since = now_mono
        unknown_for = now_mono - self.unknown_since
        if unknown_for < 2 * window:
            return True, "gpu: utilization unknown while training runs (counted as busy)"
        return False, f"gpu: utilization unknown for {_ago(unknown_for)} (no longer counted)"


# --- the training's own signs of life ------------------------------------------------------------
class OutputProbe:
    """The training log grew within `window`. Growth is seen by comparing size/mtime between polls
    on the monotonic clock, so a wall-clock jump cannot make an old log look fresh; only the very
    first look falls back to the file's mtime."""

    def __init__(self) -> None:
        self._last: tuple | None = None
        self._grew_mono: float | None = None
        self.figure = ""

    def probe(self, path: str, now_mono: float, now_wall: float, window: float) -> Probe:
        self.figure = "no output yet"
        if not path:
            return False, "training: no log file"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False, "training: no log output yet"
        key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
        if self._last is None or self._last[0] != path or self._grew_mono is None:
            self._grew_mono = now_mono - max(0.0, now_wall - st.st_mtime)
        elif key != self._last:
            self._grew_mono = now_mono
        self._last = key
        age = max(0.0, now_mono - self._grew_mono)
        self.figure = f"output {_ago(age)} ago" if age < window else f"no output for {_ago(age)}"
        if age < window:
            return True, f"training: log written {_ago(age)} ago"
        return False, f"training: no log output for {_ago(age)}"


# --- all of them ---------------------------------------------------------------------------------
class Probes:
    """Every probe `[idle]` turns on, looked at afresh on each poll. Only the probes that compare
    with their previous reading (GPU unknown-since, log growth, CPU time) keep anything."""

    def __init__(self, cfg: IdleConfig, tmux_socket: str, session: str, stopping_patience: float = 120.0):
        self.cfg = cfg
        self.tmux_socket = tmux_socket
        self.session = session
        # a training on its way out (SIGINT, SIGTERM, SIGKILL) counts as work this long at most: one
        # that outlives SIGKILL (uninterruptible) must not keep the machine billed for ever
        self.stopping_patience = stopping_patience
        self._stopping: tuple[int, float] | None = None  # (run, monotonic time it was first seen STOPPING)
        self.jupyter = JupyterProbe(cfg.jupyter_url, cfg.jupyter_token_file) if cfg.jupyter_url else None
        self.gpu = GpuProbe()
        self.output = OutputProbe()
        self.cpu = CpuProbe()

    def gather(self, info: TrainingInfo, now: Now, gpu: GpuView | None,
               training_pids: Callable[[], Iterable[int]]) -> Signals:
        c = self.cfg
        alive = info.state in TRAINING_ALIVE
        items: list[Signal] = []
        if c.count_ssh:
            items.append(Signal("ssh", *safe("ssh", probe_ssh, c.count_ssh_tunnels)))
        if c.count_tmux_clients:
            items.append(Signal("tmux", *safe("tmux", probe_tmux, self.tmux_socket, info.session or self.session)))
        if self.jupyter is not None:
            items.append(Signal("jupyter", *safe("jupyter", self.jupyter.probe, now.wall, c.activity_window)))
        items.append(Signal("gpu", *safe("gpu", self.gpu.probe, gpu, now.mono, c.gpu_window,
                                         c.gpu_util_threshold, alive)))
        signs = [self.gpu.figure]
        if info.state == TrainingState.STARTING:
            items.append(Signal("training", True, "training: starting"))
        elif info.state == TrainingState.STOPPING:
            items.append(Signal("training", *self._stopping_signal(info, now)))
        elif info.state == TrainingState.RUNNING:
            if c.count_training_output:
                items.append(Signal("training_output", *safe("training", self.output.probe, info.log_path,
                                                             now.mono, now.wall, c.activity_window)))
                signs.insert(0, self.output.figure)
            if c.count_training_cpu:
                items.append(Signal("training_cpu", *safe("training_cpu", lambda: self.cpu.probe(
                    training_pids(), now.mono, c.training_cpu_threshold))))
                signs.append(self.cpu.figure)
        if info.state != TrainingState.STOPPING:
            self._stopping = None
        return Signals(tuple(items), training_alive=alive,
                       training_signs=tuple(x for x in signs if x) if alive else ())

    def _stopping_signal(self, info: TrainingInfo, now: Now) -> Probe:
        if self._stopping is None or self._stopping[0] != info.run_id:
            self._stopping = (info.run_id, now.mono)
        for_s = now.mono - self._stopping[1]
        if for_s < self.stopping_patience:
            return True, "training: stopping"
        return False, f"training: stopping for {_ago(for_s)}, still alive after SIGKILL (no longer counted)"
