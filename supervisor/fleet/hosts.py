"""Fitting into a fleet: the idle verdict an outer scheduler asks for (`supervisorctl idle-check`),
and one line per machine for many machines over SSH (`supervisorctl status --host ...`).

Both are pure functions of the `status --json` dict (and, for hosts, of what ssh returned), so
what a scheduler or a person sees is exactly what the machine's own daemon decided. No listener is
added for this: `status --host` runs `supervisorctl status --json` on each machine through ssh.
"""

from __future__ import annotations

import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from supervisor.durations import format_duration
from supervisor.status import View
from supervisor.status.alerts import AlertsBlock
from supervisor.status.gpu import GpusBlock
from supervisor.status.health import HealthBlock
from supervisor.status.idle import IdleBlock
from supervisor.status.misc import OrchestratorBlock
from supervisor.status.sync import SyncBlock
from supervisor.status.training import CostBlock, DaemonBlock, TrainingBlock
from supervisor.timefmt import clock
from supervisor.untrusted import Unreadable, json_doc

IDLE_STATES = ("IDLE", "WARNED", "STOPPING", "STOPPED")
ACTIVE_STATES = ("ACTIVE",)


class VerdictError(Exception):
    """The status does not say whether the machine is idle; a caller treats that as active."""


@dataclass(frozen=True)
class Verdict:
    """What `idle-check` answers; its fields are the keys of `idle-check --json` (a contract with
    schedulers), so idle_verdict() hands it on as a dict and verdict_text() reads that dict back."""

    idle: bool
    state: str
    idle_since: float | None
    idle_for_s: float | None
    warn_at: float | None
    stop_at: float | None
    keepalive_until: float | None
    reasons: list[str]
    training: str | None
    orchestrator: dict | None  # the status's `orchestrator` block as it came (null when none)
    now: float | None


def idle_verdict(st: dict) -> dict:
    """{"idle", "state", "idle_since", "idle_for_s", "warn_at", "stop_at", "reasons", ...} by this
    daemon's definition: any idle state but ACTIVE is idle. Raises VerdictError when unsure."""
    v = View(st)
    idle = v.block(IdleBlock)
    state = idle.state
    if state not in IDLE_STATES + ACTIVE_STATES:
        raise VerdictError(f"the daemon reports no usable idle state ({state!r})")
    now, since = v.block(DaemonBlock).now, idle.idle_since
    is_idle = state in IDLE_STATES
    idle_for = None
    if is_idle and now is not None and since is not None:
        idle_for = max(float(now) - float(since), 0.0)
    orch = v.block(OrchestratorBlock)
    return asdict(Verdict(idle=is_idle, state=state, idle_since=since if is_idle else None, idle_for_s=idle_for,
                          warn_at=idle.warn_at, stop_at=idle.stop_at, keepalive_until=idle.keepalive_until,
                          reasons=idle.reasons, training=v.block(TrainingBlock).state,
                          orchestrator=orch.to_dict() if orch.reported else None, now=now))


def verdict_text(verdict: dict) -> str:
    v = Verdict(**verdict)
    now = v.now or 0
    if v.idle:
        out = f"idle for {format_duration(v.idle_for_s)} ({v.state})"
        if v.stop_at:
            out += f"; stop {clock(v.stop_at, now)}"
        elif v.warn_at:
            out += f"; warning {clock(v.warn_at, now)}"
    else:
        out = "active: " + ("; ".join(v.reasons) or "(no reason given)")
    orch = OrchestratorBlock.of(v.orchestrator)
    if orch.filled:
        out += f"\nnote: {orch.note or orch.name}"
    return out


# --- many machines -------------------------------------------------------------------------------

# A non-login ssh command does not read the profile, so the install folder is added to PATH.
DEFAULT_REMOTE = 'PATH="$PATH:/opt/train-supervisor/bin:/usr/local/bin" supervisorctl'


@dataclass
class Host:
    target: str                 # what ssh gets: host, user@host or a Host alias from ssh_config
    remote: str = DEFAULT_REMOTE  # the supervisorctl command line on that machine


@dataclass
class HostResult:
    host: str
    ok: bool
    status: dict | None = None
    error: str = ""
    exit_code: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_hosts_file(text: str) -> list[Host]:
    """One machine per line: `HOST [SUPERVISORCTL COMMAND...]`; blank lines and # comments skipped."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        target, _, remote = line.partition(" ")
        if target.startswith("-"):
            raise ValueError(f"line {n}: a host may not start with '-': {target!r}")
        out.append(Host(target, remote.strip() or DEFAULT_REMOTE))
    return out


def ssh_argv(host: Host, *, connect_timeout: int = 10, ssh_config: str = "",
             ssh_options: list[str] | None = None) -> list[str]:
    """Unattended (BatchMode: never a password prompt); "--" so a host can never be read as an option."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout}", "-T"]
    if ssh_config:
        argv += ["-F", ssh_config]
    for o in ssh_options or []:
        argv += ["-o", o]
    return [*argv, "--", host.target, f"{host.remote} status --json"]


def interpret(host: str, rc: int, stdout: str, stderr: str) -> HostResult:
    """What one ssh run means. supervisorctl exits 0/3 with the status (running or not), 4 when its
    daemon is down; ssh exits 255 when it cannot connect or log in; the shell 127 when the command
    is missing."""
    err = _last_line(stderr)
    if rc == 255:
        return HostResult(host, False, error=f"unreachable: {err or 'ssh failed'}", exit_code=rc)
    if rc == 127:
        return HostResult(host, False, error="supervisorctl not found there (set the command in the hosts file)",
                          exit_code=rc)
    if rc in (0, 3):
        try:
            st = json_doc(stdout, what="status JSON")
        except Unreadable:
            return HostResult(host, False, error="answered with something that is not status JSON", exit_code=rc)
        if isinstance(st, dict):
            return HostResult(host, True, status=st, exit_code=rc)
        return HostResult(host, False, error="answered with something that is not status JSON", exit_code=rc)
    if rc == 4:
        return HostResult(host, False, error=f"daemon not running: {err}", exit_code=rc)
    return HostResult(host, False, error=f"exit {rc}: {err or 'no message'}", exit_code=rc)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def query_hosts(hosts: list[Host], *, timeout: float = 30.0, connect_timeout: int = 10, ssh_config: str = "",
                ssh_options: list[str] | None = None) -> list[HostResult]:
    """Ask every machine at once; a slow or dead one costs at most `timeout`, never the others' answers."""
    def one(h: Host) -> HostResult:
        argv = ssh_argv(h, connect_timeout=connect_timeout, ssh_config=ssh_config, ssh_options=ssh_options)
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                               errors="replace")
        except subprocess.TimeoutExpired:
            return HostResult(h.target, False, error=f"unreachable: no answer within {timeout:g}s")
        except OSError as e:
            return HostResult(h.target, False, error=f"cannot run ssh: {e.strerror or e}")
        return interpret(h.target, r.returncode, r.stdout, r.stderr)

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(len(hosts), 32)) as pool:
        return list(pool.map(one, hosts))


def host_line(r: HostResult, width: int = 16) -> str:
    """One line per machine: state, step/ETA, GPU util, idle clock, cost; or why it did not answer."""
    name = r.host.ljust(width)
    if not r.ok or r.status is None:
        return f"{name} {'UNREACHABLE' if r.error.startswith('unreachable') else 'ERROR':<10} {r.error}"
    v = View(r.status)
    now = v.now
    tr = v.block(TrainingBlock)
    pr = tr.progress
    parts = []
    if pr.step is not None:
        prog = f"step {pr.step}" + (f"/{pr.max_steps}" if pr.max_steps else "")
        if pr.percent is not None:
            prog += f" {pr.percent:.0f}%"
        if pr.eta_s is not None and tr.state == "RUNNING":
            prog += f" ETA {format_duration(pr.eta_s)}"
        parts.append(prog)
    gpu = v.block(GpusBlock)
    utils = [g.util_pct for g in gpu.gpus if g.util_pct is not None]
    if gpu.gpus:
        n = len(gpu.gpus)
        parts.append(f"GPU {sum(utils) / len(utils):.0f}% x{n}" if utils else f"GPU ? x{n}")
    elif gpu.gpu_error:
        parts.append("no GPU")
    idle = v.block(IdleBlock)
    istate = idle.state or "?"
    if istate in IDLE_STATES and idle.idle_since is not None:
        idle_txt = f"idle {istate} {format_duration(now - idle.idle_since)}"
        if idle.stop_at:
            idle_txt += f", stop {clock(idle.stop_at, now)}"
        parts.append(idle_txt)
    else:
        parts.append(f"idle {istate}")
    cost = v.block(CostBlock)
    if cost.spent is not None:
        c = f"{cost.spent:.2f} {cost.currency or ''}".rstrip()
        if cost.eta_cost is not None and tr.state == "RUNNING":
            c += f" (+{cost.eta_cost:.2f} to finish)"
        parts.append(c)
    if v.block(SyncBlock).state == "failing":
        parts.append("SYNC FAILING")
    health = v.block(HealthBlock).verdict
    if health in ("BAD", "DEGRADED"):
        parts.append(f"health {health}")
    n_alerts = len(v.block(AlertsBlock).alerts)
    if n_alerts:
        parts.append(f"{n_alerts} alert{'s' if n_alerts > 1 else ''}")
    return f"{name} {str(tr.state or '?'):<10} " + "  ".join(parts)


def render_hosts(results: list[HostResult]) -> str:
    width = max([len(r.host) for r in results] + [8]) + 1
    return "\n".join(_safe_line(r, width) for r in results)


def _safe_line(r: HostResult, width: int) -> str:
    """A machine running another version may send figures of other types: one odd machine must
    never hide the others' lines."""
    try:
        return host_line(r, width)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        return f"{r.host.ljust(width)} {'ERROR':<10} its status could not be read ({type(e).__name__})"


def quote_remote(argv: list[str]) -> str:
    """A remote supervisorctl command line from argv (for tests and hosts files written by tools)."""
    return " ".join(shlex.quote(a) for a in argv)
