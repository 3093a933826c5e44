"""Checks across keys, after every key was read: what one key means for another (a stop command
without action = "command", an Apprise URL that is not a URL, a metrics listener off loopback)."""

from __future__ import annotations

import os
import re
import shlex

from supervisor.config.schema import (
    HOOK_EVENTS,
    PREEMPTION_PROVIDERS,
    PROGRESS_SOURCES,
    TRAINING_SIGNALS,
    Config,
    keyname,
    show_value,
)
from supervisor.config.target import parse_target
from supervisor.timefmt import parse_moment

_OUTPUT_DIR_FLAGS = ("--output_dir", "--output-dir")


def command_output_dir(command: str, workdir: str) -> str:
    """The Trainer's output_dir a command names (`--output_dir X`, `--output-dir=X`), absolute
    (relative ones are under `workdir`); "" when it names none or it cannot be placed."""
    try:
        words = shlex.split(command)
    except ValueError:
        return ""
    for i, w in enumerate(words):
        value = ""
        if w in _OUTPUT_DIR_FLAGS and i + 1 < len(words):
            value = words[i + 1]
        elif w.startswith(tuple(f + "=" for f in _OUTPUT_DIR_FLAGS)):
            value = w.split("=", 1)[1]
        if value and not value.startswith(("$", "~")):
            if os.path.isabs(value):
                return os.path.normpath(value)
            if workdir and os.path.isabs(workdir):
                return os.path.normpath(os.path.join(workdir, value))
    return ""


NOTHING_WATCHED = ("sync.watch: empty, so nothing would ever reach sync.target; list the folders the "
                   "training writes checkpoints to (its output_dir), e.g. watch = [\"/workspace/out\"], "
                   "or set training.workdir (then it is watched)")


def nothing_watched(cfg: Config) -> list[str]:
    """What the daemon and check-config refuse (not the loader: a config read for one part, such
    as a target's tests, may leave watch out): a target that nothing is ever synced to."""
    s = cfg.sync
    return [NOTHING_WATCHED] if s.target and not s.watch and not cfg.stop.final_sync else []


def default_watch(cfg: Config, problems: list[str]) -> None:
    """A target with nothing watched would sync nothing and call it "in sync" while checkpoints
    pile up on the machine: watch the Trainer's output_dir when the command names one, else the
    training's workdir (with neither, `nothing_watched` refuses it where a daemon would run)."""
    s = cfg.sync
    if not s.target or s.watch or cfg.stop.final_sync:
        return
    t = cfg.training
    out = command_output_dir(t.command, t.workdir)
    if out:
        s.watch = [out]
        s.watch_default = "the --output_dir of training.command"
    elif t.workdir and os.path.isabs(t.workdir):
        s.watch = [os.path.normpath(t.workdir)]
        s.watch_default = "training.workdir"


def cross_checks(cfg: Config, problems: list[str]) -> None:
    default_watch(cfg, problems)
    t = cfg.training
    if t.autostart and not t.command:
        problems.append("training.autostart: needs training.command")
    # tmux silently turns '.' and ':' into '_', so such a name would never be found again to re-adopt.
    if t.session and not re.fullmatch(r"[A-Za-z0-9_-]+", t.session):
        problems.append(f"training.session: only letters, digits, '_' and '-' allowed, got {show_value(t.session)}")
    if not t.session:
        problems.append("training.session: must not be empty")
    for k in t.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            problems.append(f"training.env.{keyname(k)}: not a valid environment variable name")
    if cfg.stop.action == "command" and not cfg.stop.command.strip():
        problems.append('stop.command: required when stop.action = "command"')
    if cfg.max_idle_cost is not None and cfg.price_per_hour is None:
        problems.append("max_idle_cost: needs price_per_hour")
    if cfg.progress.budget is not None and cfg.price_per_hour is None:
        problems.append("progress.budget: needs price_per_hour")
    if not cfg.sync.hf_private and not cfg.sync.hf_allow_public and cfg.sync.target.startswith("hf://"):
        problems.append("sync.hf_private: false makes a public repo; set sync.hf_allow_public = true "
                        "if checkpoints are meant to be public")
    if cfg.sync.target:
        try:
            parse_target(cfg.sync.target)
        except ValueError as e:
            problems.append(f"sync.target: {e}")
    # a branch name git accepts (no spaces, '..', '~^:?*[\\', leading '-' or trailing '/' or '.lock')
    rev = cfg.sync.hf_revision
    if not rev or not re.fullmatch(r"[A-Za-z0-9._/-]+", rev) or ".." in rev or rev.startswith(("-", "/")) \
            or rev.endswith(("/", ".lock", ".")) or "//" in rev:
        problems.append(f"sync.hf_revision: not a valid branch name: {show_value(rev)}")
    if cfg.sync.watch and not cfg.sync.target:
        problems.append("sync.target: required when sync.watch lists folders")
    for i, p in enumerate(cfg.sync.watch):
        if not os.path.isabs(p):
            problems.append(f"sync.watch[{i}]: expected an absolute path, got {show_value(p)}")
    for i, p in enumerate(cfg.stop.final_sync):
        if not os.path.isabs(p):
            problems.append(f"stop.final_sync[{i}]: expected an absolute path, got {show_value(p)}")
    if cfg.resume.from_target and not (cfg.sync.target and cfg.sync.watch):
        problems.append("resume.from_target: needs sync.target and sync.watch (where to restore from and into)")
    if cfg.stop.final_sync and not cfg.sync.target:
        problems.append("sync.target: required when stop.final_sync lists folders")
    cluster_checks(cfg, problems)
    for i, src in enumerate(cfg.progress.sources):
        if src not in PROGRESS_SOURCES:
            problems.append(f"progress.sources[{i}]: {show_value(src)} is not a source; "
                            f"expected {', '.join(PROGRESS_SOURCES)}")
    if cfg.disk.prune == "synced" and not (cfg.sync.target and cfg.sync.watch):
        problems.append('disk.prune: "synced" needs sync.target and sync.watch (only what the target '
                        'verifiably holds is ever deleted)')
    if cfg.email is not None:
        e = cfg.email
        if not e.to:
            problems.append("email.to: at least one address is required in [email]")
        for i, a in enumerate(e.to):
            if not _ADDR.fullmatch(a):
                problems.append(f"email.to[{i}]: not an email address: {show_value(a)}")
        if not e.smtp_host:
            problems.append("email.smtp_host: required in [email]")
        if e.from_ and not _ADDR.fullmatch(e.from_):
            problems.append(f"email.from: not an email address: {show_value(e.from_)}")
        if e.username and e.security == "none" and e.smtp_host not in ("localhost", "127.0.0.1", "::1"):
            problems.append('email.security: "none" would send the password for email.username in clear '
                            'over the network; use "starttls" or "ssl"')
        if e.username and not e.password_file and not os.environ.get("TRAIN_SUPERVISOR_SMTP_PASSWORD"):
            problems.append("email.password_file: required with email.username "
                            "(or set TRAIN_SUPERVISOR_SMTP_PASSWORD)")
    _notify_checks(cfg, problems)
    _metrics_checks(cfg, problems)
    _preemption_checks(cfg, problems)
    _budget_checks(cfg, problems)
    if not os.path.isabs(cfg.state_dir):
        problems.append(f"state_dir: expected an absolute path, got {show_value(cfg.state_dir)}")
    if not os.path.isabs(cfg.socket):
        problems.append(f"socket: expected an absolute path, got {show_value(cfg.socket)}")
    if len(cfg.socket.encode()) > 100:
        problems.append("socket: path longer than 100 bytes (unix sockets are limited to 108)")
    if not re.fullmatch(r"[A-Z]{3}", cfg.currency):
        problems.append(f"currency: expected a 3-letter code like EUR, got {show_value(cfg.currency)}")


_ADDR = re.compile(r"[^@\s<>,;\"]+@[^@\s<>,;\"]+")
_SCHEME_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


def _notify_checks(cfg: Config, problems: list[str]) -> None:
    n = cfg.notify
    for i, u in enumerate(n.urls):
        if not _SCHEME_URL.fullmatch(u):
            # The value may hold a token: name the position, never echo it.
            problems.append(f"notify.urls[{i}]: expected an Apprise URL like \"ntfys://ntfy.sh/topic\" "
                            "(scheme://...), without spaces")
    if n.webhook_url and not n.webhook_secret_file:
        problems.append("notify.webhook_secret_file: required with notify.webhook_url (a file holding a "
                        "\"whsec_...\" secret; the receiver checks each request's signature with it)")
    if n.webhook_secret_file and not n.webhook_url:
        problems.append("notify.webhook_url: required with notify.webhook_secret_file")


def _budget_checks(cfg: Config, problems: list[str]) -> None:
    b = cfg.budget
    if b.max_cost is not None and cfg.price_per_hour is None:
        problems.append("budget.max_cost: needs price_per_hour (the money since boot is counted at it)")
    if b.deadline:
        try:
            parse_moment(b.deadline)
        except ValueError as e:
            problems.append(f"budget.deadline: {e}")
    for i, h in enumerate(cfg.hooks):
        if not h.run.strip():
            problems.append(f"hooks[{i}].run: required (the command to run)")
        if not h.events:
            problems.append(f"hooks[{i}].events: at least one of {', '.join(HOOK_EVENTS)}")
        for e in h.events:
            if e not in HOOK_EVENTS:
                problems.append(f"hooks[{i}].events: unknown event {show_value(e)}; expected any of "
                                f"{', '.join(HOOK_EVENTS)}")
        if h.required and "stop" not in h.events:
            problems.append(f"hooks[{i}].required: only a hook on \"stop\" can hold anything up; "
                            "add \"stop\" to its events or drop required")


def _metrics_checks(cfg: Config, problems: list[str]) -> None:
    m = cfg.metrics
    if m.textfile and not m.textfile.endswith(".prom"):
        problems.append(f"metrics.textfile: must end in .prom (node_exporter's textfile collector reads "
                        f"only *.prom files), got {show_value(m.textfile)}")
    if m.listen:
        try:
            host, _port = parse_listen(m.listen)
        except ValueError as e:
            problems.append(f"metrics.listen: {e}")
            return
        if not _is_loopback(host) and not m.allow_remote:
            problems.append(f"metrics.listen: {host} is reachable from other machines; use 127.0.0.1, or set "
                            "metrics.allow_remote = true if you mean it (anyone who can connect sees the "
                            "training's state and cost)")


def _preemption_checks(cfg: Config, problems: list[str]) -> None:
    p = cfg.preemption
    for i, w in enumerate(p.watch):
        if w not in (*PREEMPTION_PROVIDERS, "none"):
            problems.append(f"preemption.watch[{i}]: expected ec2, gcp, azure (or \"none\" to watch no metadata "
                            f"service), got {show_value(w)}")
    if "none" in p.watch and len(p.watch) > 1:
        problems.append('preemption.watch: "none" cannot be combined with a provider')
    sig = p.training_signal
    if sig and sig not in TRAINING_SIGNALS:
        hint = f" (did you mean \"SIG{sig.upper()}\"?)" if f"SIG{sig.upper()}" in TRAINING_SIGNALS else ""
        problems.append(f"preemption.training_signal: expected one of {', '.join(TRAINING_SIGNALS)} or \"\" for "
                        f"none, got {show_value(sig)}{hint}")
    for k, v in p.metadata_urls.items():
        if k not in PREEMPTION_PROVIDERS:
            problems.append(f"preemption.metadata_urls.{keyname(k)}: expected a key ec2, gcp or azure")
        elif not re.match(r"^https?://[^\s/]+", v):
            problems.append(f"preemption.metadata_urls.{k}: expected an http:// URL, got {show_value(v)}")


def parse_listen(value: str) -> tuple[str, int]:
    """"127.0.0.1:9839", "[::1]:9839", "localhost:9839" or a bare port "9839" (loopback)."""
    v = value.strip()
    if re.fullmatch(r"\d+", v):
        host, port_s = "127.0.0.1", v
    elif m := re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)", v):
        host, port_s = m.group(1), m.group(2)
    elif m := re.fullmatch(r"([A-Za-z0-9.-]+):(\d+)", v):
        host, port_s = m.group(1), m.group(2)
    else:
        raise ValueError(f'expected "HOST:PORT" like "127.0.0.1:9839", got {show_value(value)}')
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be 1-65535, got {port}")
    return host, port


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cluster_checks(cfg: Config, problems: list[str]) -> None:
    """[cluster] as this machine's environment completes it (NODE_RANK, SKYPILOT_NUM_NODES, ...)."""
    from supervisor.config.cluster import identity

    c = cfg.cluster
    try:
        ident = identity(c.nodes, c.rank, c.run_id, [dict(os.environ), dict(cfg.training.env or {})], "")
    except ValueError as e:
        problems.append(str(e))
        return
    if not ident.clustered:
        return
    if cfg.sync.target.startswith("hf://"):
        problems.append(f"cluster.nodes: a run of {ident.nodes} nodes needs a target every node can write at once "
                        "(s3://, user@host:path or a shared folder); an hf:// repo takes one commit at a time")
    elif not cfg.sync.target:
        problems.append(f"cluster.nodes: a run of {ident.nodes} nodes meets through sync.target; set one")
    if c.silent_after < 2 * c.heartbeat:
        problems.append(f"cluster.silent_after: at least two heartbeats ({2 * c.heartbeat:g}s), "
                        f"got {c.silent_after:g}s")
