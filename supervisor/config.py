"""The configuration file: schema, defaults, and validation that reports every problem at once.

Every key is declared once below with its kind and default; the loader walks the declarations,
so a key cannot be read without being validated, and an unknown key (a typo such as
`warn_afer`) is an error instead of silently leaving idle protection at its default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .durations import format_bytes, format_duration, parse_duration, parse_size
from .syncurl import parse_target

DEFAULT_PATH = "/etc/train-supervisor/config.toml"
ENV_VAR = "TRAIN_SUPERVISOR_CONFIG"


class ConfigError(Exception):
    """Raised with every problem found; each line names the key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def _k(kind: str, default: Any, *, choices: tuple[str, ...] = (), min: float | None = None,
       max: float | None = None) -> Any:
    meta = {"kind": kind, "choices": choices, "min": min, "max": max}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


# Kinds: str, path, int, float, bool, duration (-> seconds float), size (-> bytes int),
# choice, strlist, strdict, optfloat (None when unset), optduration (None when unset or ""), url.


@dataclass
class TrainingConfig:
    command: str = _k("str", "")
    workdir: str = _k("path", "")
    session: str = _k("str", "train")
    log: str = _k("path", "")
    env: dict[str, str] = _k("strdict", {})
    user: str = _k("str", "")
    shell: str = _k("path", "/bin/bash")
    restart: str = _k("choice", "never", choices=("never", "on-failure"))
    max_restarts: int = _k("int", 3, min=0)
    restart_backoff: float = _k("duration", 30.0)
    on_finish: str = _k("choice", "stop", choices=("stop", "idle", "none"))
    finish_grace: float = _k("duration", 600.0)
    autostart: bool = _k("bool", False)
    stop_grace: float = _k("duration", 30.0)


@dataclass
class GpuConfig:
    poll_interval: float = _k("duration", 5.0, min=0.1)
    window: float = _k("duration", 600.0)
    nvml_library: str = _k("path", "")
    mem_limit_fraction: float = _k("float", 0.98, min=0.5, max=1.0)
    mem_limit_samples: int = _k("int", 3, min=1)


# What trainer.save_model(output_dir) leaves in the watched folder itself: the final model.
FINAL_MODEL_FILES = ["*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "**/adapter_model.bin",
                     "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                     "vocab.*", "merges.txt", "*.tiktoken", "training_args.bin", "trainer_state.json",
                     "*results.json"]


@dataclass
class SyncConfig:
    target: str = _k("str", "")
    endpoint_url: str = _k("url", "")
    region: str = _k("str", "")
    credentials_file: str = _k("path", "")
    request_checksum_calculation: str = _k("choice", "when_supported",
                                           choices=("when_supported", "when_required"))
    watch: list[str] = _k("strlist", [])
    include: list[str] = _k("strlist", ["checkpoint-*/**", "**/adapter_model.safetensors",
                                        "**/adapter_config.json", *FINAL_MODEL_FILES])
    exclude: list[str] = _k("strlist", [])
    quiet_period: float = _k("duration", 30.0)
    complete_marker: str = _k("str", "trainer_state.json")
    rescan_interval: float = _k("duration", 60.0, min=0.1)
    concurrency: int = _k("int", 16, min=1, max=64)
    part_size: int = _k("size", 8 * 1024 * 1024, min=5 * 1024 * 1024)
    multipart_threshold: int = _k("size", 64 * 1024 * 1024, min=5 * 1024 * 1024, max=5 * 1024 ** 3)
    bandwidth_limit: int = _k("size", 0)
    keep_last: int = _k("int", 0, min=0)
    ssh_key: str = _k("path", "")
    ssh_port: int = _k("int", 22, min=1, max=65535)
    host_key_policy: str = _k("choice", "accept-new", choices=("accept-new", "yes", "no"))
    known_hosts_file: str = _k("path", "")
    hf_token_file: str = _k("path", "")
    hf_private: bool = _k("bool", True)
    hf_revision: str = _k("str", "main")
    fail_alert_after: float = _k("duration", 300.0)
    retry_max_backoff: float = _k("duration", 300.0)


@dataclass
class IdleConfig:
    warn_after: float = _k("duration", 7200.0)
    stop_after_warning: float = _k("duration", 3600.0)
    gpu_util_threshold: float = _k("float", 5.0, min=0, max=100)
    gpu_window: float = _k("duration", 300.0)
    poll_interval: float = _k("duration", 30.0, min=0.1)
    count_ssh: bool = _k("bool", True)
    count_ssh_tunnels: bool = _k("bool", False)
    count_tmux_clients: bool = _k("bool", True)
    count_training_cpu: bool = _k("bool", True)
    training_cpu_threshold: float = _k("float", 50.0, min=0)
    count_training_output: bool = _k("bool", True)
    activity_window: float = _k("duration", 600.0)
    jupyter_url: str = _k("url", "")
    jupyter_token_file: str = _k("path", "")


@dataclass
class StopConfig:
    action: str = _k("choice", "poweroff", choices=("poweroff", "command", "ec2", "dry-run"))
    command: str = _k("str", "")
    final_sync: list[str] = _k("strlist", [])
    stop_even_if_sync_fails: bool = _k("bool", False)
    final_sync_timeout: float = _k("duration", 1800.0)
    retry_interval: float = _k("duration", 120.0)
    ec2_region: str = _k("str", "")
    ec2_endpoint_url: str = _k("url", "")
    imds_url: str = _k("url", "http://169.254.169.254")


@dataclass
class EmailConfig:
    to: list[str] = _k("strlist", [])
    from_: str = _k("str", "")
    smtp_host: str = _k("str", "")
    smtp_port: int = _k("int", 587, min=1, max=65535)
    security: str = _k("choice", "starttls", choices=("starttls", "ssl", "none"))
    username: str = _k("str", "")
    password_file: str = _k("path", "")
    timeout: float = _k("duration", 20.0, min=1)
    subject_prefix: str = _k("str", "[train-supervisor]")
    ca_file: str = _k("path", "")


@dataclass
class AlertsConfig:
    first_delay: float = _k("duration", 10.0)
    repeat_interval: float = _k("duration", 3600.0)
    max_per_hour: int = _k("int", 6, min=1)
    retry_interval: float = _k("duration", 60.0, min=1)
    disk_free_min_pct: float = _k("float", 5.0, min=0, max=100)
    host_mem_min_pct: float = _k("float", 5.0, min=0, max=100)
    disk_paths: list[str] = _k("strlist", [])


@dataclass
class NotifyConfig:
    urls: list[str] = _k("strlist", [])
    urls_file: str = _k("path", "")
    webhook_url: str = _k("url", "")
    webhook_secret_file: str = _k("path", "")
    timeout: float = _k("duration", 10.0, min=1, max=120)
    chat_max_chars: int = _k("int", 700, min=100, max=4000)


@dataclass
class MetricsConfig:
    textfile: str = _k("path", "")
    listen: str = _k("str", "")
    allow_remote: bool = _k("bool", False)


@dataclass
class ProgressConfig:
    estimate_after: float = _k("duration", 900.0)
    estimate_email: bool = _k("bool", False)
    window: float = _k("duration", 300.0)
    budget: float | None = _k("optfloat", None, min=0)
    log_interval: float = _k("duration", 300.0)
    # None: the larger of 30m and 10 x the median step time (supervisor.stall.threshold)
    stall_after: float | None = _k("optduration", None, min=60)
    stalled_action: str = _k("choice", "alert", choices=("alert", "stop"))


# What a training may be asked to save with; the runner ignores each of these (it must outlive the job).
TRAINING_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGTERM", "SIGHUP")
PREEMPTION_PROVIDERS = ("ec2", "gcp", "azure")


@dataclass
class PreemptionConfig:
    watch: list[str] = _k("strlist", [])
    poll_interval: float = _k("duration", 5.0, min=0.2, max=60)
    timeout: float = _k("duration", 1.0, min=0.1, max=10)
    training_signal: str = _k("str", "")
    sigterm: str = _k("choice", "auto", choices=("auto", "notice", "exit"))
    sigterm_grace: float = _k("duration", 30.0, min=1, max=3600)
    metadata_urls: dict[str, str] = _k("strdict", {})


@dataclass
class Config:
    state_dir: str = _k("path", "/var/lib/train-supervisor")
    socket: str = _k("path", "/run/train-supervisor/control.sock")
    socket_group: str = _k("str", "")
    price_per_hour: float | None = _k("optfloat", None, min=0)
    currency: str = _k("str", "USD")
    max_idle_cost: float | None = _k("optfloat", None, min=0)
    hostname: str = _k("str", "")
    log_level: str = _k("choice", "info", choices=("debug", "info", "warning", "error"))
    training: TrainingConfig = field(default_factory=TrainingConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    idle: IdleConfig = field(default_factory=IdleConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    email: EmailConfig | None = None
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)

    source: str = field(default="<defaults>", metadata={"internal": True})


SECTIONS: dict[str, type] = {
    "training": TrainingConfig, "gpu": GpuConfig, "sync": SyncConfig, "idle": IdleConfig,
    "stop": StopConfig, "email": EmailConfig, "alerts": AlertsConfig, "progress": ProgressConfig,
    "notify": NotifyConfig, "metrics": MetricsConfig, "preemption": PreemptionConfig,
}


def _toml_name(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")  # `from` is a keyword


def _show(v: Any, limit: int = 80) -> str:
    """A value as it would read in TOML, escaped so a problem stays on one line."""
    if isinstance(v, bool):
        return "true" if v else "false"
    try:
        s = json.dumps(v, ensure_ascii=False, default=str)
    except ValueError:  # nan/inf inside a container
        s = repr(v)
    s = _CTRL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", s)
    return s if len(s) <= limit else s[: limit - 3] + "..."


_CTRL_CHARS = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def _keyname(name: str) -> str:
    """A key from the file, quoted when TOML would need quotes (or it could break the line)."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _show(name)


def _limit(meta: dict, which: str) -> str:
    v = meta[which]
    if meta["kind"] == "size":
        return format_bytes(v)
    if meta["kind"] not in ("duration", "optduration"):
        return f"{v:g}"
    return f"{v * 1000:g}ms" if v < 1 else format_duration(v)


def _convert(key: str, meta: dict, value: Any, problems: list[str]) -> Any:
    kind = meta["kind"]
    bad = _BAD
    out: Any = bad
    if kind in ("str", "path", "choice", "url"):
        if not isinstance(value, str):
            problems.append(f"{key}: expected a string, got {_show(value)}")
            return bad
        if kind == "choice" and value not in meta["choices"]:
            problems.append(f"{key}: expected one of {', '.join(meta['choices'])}, got {_show(value)}")
            return bad
        if kind == "url" and value and not re.match(r"^https?://[^\s/]+", value):
            problems.append(f"{key}: expected an http:// or https:// URL, got {_show(value)}")
            return bad
        if "\x00" in value:
            problems.append(f"{key}: contains a NUL byte")
            return bad
        # Relative paths would resolve against the daemon's cwd, which under systemd is "/".
        if kind == "path" and value and not os.path.isabs(value):
            problems.append(f"{key}: expected an absolute path, got {_show(value)}")
            return bad
        out = value
    elif kind == "bool":
        if not isinstance(value, bool):
            problems.append(f"{key}: expected true or false, got {_show(value)}")
            return bad
        out = value
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key}: expected a whole number, got {_show(value)}")
            return bad
        out = value
    elif kind in ("float", "optfloat"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{key}: expected a number, got {_show(value)}")
            return bad
        out = float(value)
        if not math.isfinite(out):
            problems.append(f"{key}: expected a finite number, got {value!r}")
            return bad
    elif kind == "optduration" and value == "":
        return None  # written out as unset: the built-in rule applies
    elif kind in ("duration", "optduration"):
        if not isinstance(value, str):
            problems.append(f'{key}: expected a duration like "2h", got {_show(value)}')
            return bad
        try:
            out = parse_duration(value)
        except ValueError:
            problems.append(f'{key}: expected a duration like "2h", got {_show(value)}')
            return bad
    elif kind == "size":
        try:
            if not isinstance(value, (str, int)):
                raise TypeError
            out = parse_size(value)
        except (ValueError, TypeError):
            problems.append(f'{key}: expected a size like "64M", got {_show(value)}')
            return bad
    elif kind == "strlist":
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            problems.append(f"{key}: expected a list of strings, got {_show(value)}")
            return bad
        out = list(value)
    elif kind == "strdict":
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a table of strings, got {_show(value)}")
            return bad
        wrong = [k for k, v in value.items() if not isinstance(v, str)]
        for k in wrong:
            problems.append(f"{key}.{_keyname(k)}: expected a string, got {_show(value[k])}")
        if wrong:
            return bad
        out = dict(value)
    if meta.get("min") is not None and isinstance(out, (int, float)) and out < meta["min"]:
        problems.append(f"{key}: must be at least {_limit(meta, 'min')}, got {_show(value)}")
        return bad
    if meta.get("max") is not None and isinstance(out, (int, float)) and out > meta["max"]:
        problems.append(f"{key}: must be at most {_limit(meta, 'max')}, got {_show(value)}")
        return bad
    return out


def _fill(obj: Any, prefix: str, table: dict, problems: list[str]) -> None:
    fields = {_toml_name(f): f for f in dataclasses.fields(obj) if not f.metadata.get("internal")}
    for name, value in table.items():
        key = f"{prefix}{_keyname(name)}"
        f = fields.get(name)
        if f is None:
            hint = _close_match(name, fields)
            problems.append(f"{key}: unknown key" + (f" (did you mean {prefix}{hint}?)" if hint else ""))
            continue
        if name in SECTIONS and not prefix:
            if not isinstance(value, dict):
                problems.append(f"{key}: expected a [{name}] table, got {_show(value)}")
                continue
            sub = SECTIONS[name]()
            _fill(sub, f"{name}.", value, problems)
            setattr(obj, f.name, sub)
            continue
        converted = _convert(key, f.metadata, value, problems)
        if converted is not _BAD:
            setattr(obj, f.name, converted)


_BAD = object()  # what _convert returns for a value it already reported


def _close_match(name: str, fields: dict) -> str | None:
    import difflib

    m = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.75)
    return m[0] if m else None


def _cross_checks(cfg: Config, problems: list[str]) -> None:
    t = cfg.training
    if t.autostart and not t.command:
        problems.append("training.autostart: needs training.command")
    # tmux silently turns '.' and ':' into '_', so such a name would never be found again to re-adopt.
    if t.session and not re.fullmatch(r"[A-Za-z0-9_-]+", t.session):
        problems.append(f"training.session: only letters, digits, '_' and '-' allowed, got {_show(t.session)}")
    if not t.session:
        problems.append("training.session: must not be empty")
    for k in t.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            problems.append(f"training.env.{_keyname(k)}: not a valid environment variable name")
    if cfg.stop.action == "command" and not cfg.stop.command.strip():
        problems.append('stop.command: required when stop.action = "command"')
    if cfg.max_idle_cost is not None and cfg.price_per_hour is None:
        problems.append("max_idle_cost: needs price_per_hour")
    if cfg.progress.budget is not None and cfg.price_per_hour is None:
        problems.append("progress.budget: needs price_per_hour")
    if cfg.sync.target:
        try:
            parse_target(cfg.sync.target)
        except ValueError as e:
            problems.append(f"sync.target: {e}")
    # a branch name git accepts (no spaces, '..', '~^:?*[\\', leading '-' or trailing '/' or '.lock')
    rev = cfg.sync.hf_revision
    if not rev or not re.fullmatch(r"[A-Za-z0-9._/-]+", rev) or ".." in rev or rev.startswith(("-", "/")) \
            or rev.endswith(("/", ".lock", ".")) or "//" in rev:
        problems.append(f"sync.hf_revision: not a valid branch name: {_show(rev)}")
    if cfg.sync.watch and not cfg.sync.target:
        problems.append("sync.target: required when sync.watch lists folders")
    for i, p in enumerate(cfg.sync.watch):
        if not os.path.isabs(p):
            problems.append(f"sync.watch[{i}]: expected an absolute path, got {_show(p)}")
    for i, p in enumerate(cfg.stop.final_sync):
        if not os.path.isabs(p):
            problems.append(f"stop.final_sync[{i}]: expected an absolute path, got {_show(p)}")
    if cfg.stop.final_sync and not cfg.sync.target:
        problems.append("sync.target: required when stop.final_sync lists folders")
    if cfg.email is not None:
        e = cfg.email
        if not e.to:
            problems.append("email.to: at least one address is required in [email]")
        for i, a in enumerate(e.to):
            if not _ADDR.fullmatch(a):
                problems.append(f"email.to[{i}]: not an email address: {_show(a)}")
        if not e.smtp_host:
            problems.append("email.smtp_host: required in [email]")
        if e.from_ and not _ADDR.fullmatch(e.from_):
            problems.append(f"email.from: not an email address: {_show(e.from_)}")
        if e.username and e.security == "none" and e.smtp_host not in ("localhost", "127.0.0.1", "::1"):
            problems.append('email.security: "none" would send the password for email.username in clear '
                            'over the network; use "starttls" or "ssl"')
        if e.username and not e.password_file and not os.environ.get("TRAIN_SUPERVISOR_SMTP_PASSWORD"):
            problems.append("email.password_file: required with email.username "
                            "(or set TRAIN_SUPERVISOR_SMTP_PASSWORD)")
    _notify_checks(cfg, problems)
    _metrics_checks(cfg, problems)
    _preemption_checks(cfg, problems)
    if not os.path.isabs(cfg.state_dir):
        problems.append(f"state_dir: expected an absolute path, got {_show(cfg.state_dir)}")
    if not os.path.isabs(cfg.socket):
        problems.append(f"socket: expected an absolute path, got {_show(cfg.socket)}")
    if len(cfg.socket.encode()) > 100:
        problems.append("socket: path longer than 100 bytes (unix sockets are limited to 108)")
    if not re.fullmatch(r"[A-Z]{3}", cfg.currency):
        problems.append(f"currency: expected a 3-letter code like EUR, got {_show(cfg.currency)}")


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


def _metrics_checks(cfg: Config, problems: list[str]) -> None:
    m = cfg.metrics
    if m.textfile and not m.textfile.endswith(".prom"):
        problems.append(f"metrics.textfile: must end in .prom (node_exporter's textfile collector reads "
                        f"only *.prom files), got {_show(m.textfile)}")
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
                            f"service), got {_show(w)}")
    if "none" in p.watch and len(p.watch) > 1:
        problems.append('preemption.watch: "none" cannot be combined with a provider')
    sig = p.training_signal
    if sig and sig not in TRAINING_SIGNALS:
        hint = f" (did you mean \"SIG{sig.upper()}\"?)" if f"SIG{sig.upper()}" in TRAINING_SIGNALS else ""
        problems.append(f"preemption.training_signal: expected one of {', '.join(TRAINING_SIGNALS)} or \"\" for "
                        f"none, got {_show(sig)}{hint}")
    for k, v in p.metadata_urls.items():
        if k not in PREEMPTION_PROVIDERS:
            problems.append(f"preemption.metadata_urls.{_keyname(k)}: expected a key ec2, gcp or azure")
        elif not re.match(r"^https?://[^\s/]+", v):
            problems.append(f"preemption.metadata_urls.{k}: expected an http:// URL, got {_show(v)}")


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
        raise ValueError(f'expected "HOST:PORT" like "127.0.0.1:9839", got {_show(value)}')
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


def parse(text: str, source: str = "<string>") -> Config:
    """Config from TOML text; ConfigError listing every problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{source}: not valid TOML: {e}"]) from None
    return from_dict(data, source)


def from_dict(data: dict, source: str = "<dict>") -> Config:
    problems: list[str] = []
    cfg = Config()
    _fill(cfg, "", data, problems)
    cfg.source = source
    _cross_checks(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def resolve_path(explicit: str | None = None) -> str:
    return explicit or os.environ.get(ENV_VAR) or DEFAULT_PATH


def load(path: str | None = None) -> Config:
    """Load the config file. A missing default file means the embedded defaults (a fresh install
    without a config still reports status); a missing explicit file is an error."""
    p = resolve_path(path)
    explicit = bool(path or os.environ.get(ENV_VAR))
    try:
        text = Path(p).read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise ConfigError([f"{p}: config file not found"]) from None
        return Config()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{p}: cannot read config file: {e}"]) from None
    return parse(text, p)


def redacted(cfg: Config) -> dict:
    """The config as plain data for status. Passwords and secrets live in files, so only their paths
    appear; URLs that may carry a token (Apprise URLs, the webhook URL) are shown redacted."""
    d = dataclasses.asdict(cfg)
    n = d.get("notify") or {}
    n["urls"] = [redact_url(u) for u in n.get("urls", [])]
    if n.get("webhook_url"):
        n["webhook_url"] = redact_url(n["webhook_url"])
    return d


def redact_url(url: str) -> str:
    """A URL safe to show: for Slack, Discord or Telegram even the "host" part is a token, so only
    the scheme is kept; for schemes whose host is a real server, the host too. User, password, path
    and query are always hidden (the daemon shows Apprise's own redaction where it can)."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://(?:[^@/?#]*@)?([^/?#]*)(.*)$", url)
    if not m:
        return "***"
    scheme, host, rest = m.groups()
    if scheme.lower() not in _HOST_SCHEMES:
        return f"{scheme}://***"
    return f"{scheme}://{host}" + ("/***" if rest.strip("/") else "")


# Schemes whose host part names a server rather than holding a credential.
_HOST_SCHEMES = frozenset({"http", "https", "json", "jsons", "xml", "xmls", "form", "forms",
                           "gotify", "gotifys", "mailto", "mailtos", "matrix", "matrixs", "mqtt", "mqtts"})
