"""Every config key, declared once with its kind, default and limits: one dataclass per [section].

The loader (load.py) walks these declarations, so a key cannot be read without being validated;
the checks across keys are checks.py. Add a key here and in default-config.toml (docs/configuration.md's
reference is generated from both: configdoc.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from supervisor.errors import DEFAULT_PATH, DEFAULT_SOCKET, ENV_VAR  # noqa: F401 - the one-shot commands read them too
from supervisor.errors import (
    ConfigError as ConfigError,  # defined without imports: the one-shot commands catch it
)


def _k(kind: str, default: Any, *, choices: tuple[str, ...] = (), min: float | None = None,
       max: float | None = None) -> Any:
    meta = {"kind": kind, "choices": choices, "min": min, "max": max}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


# Kinds: str, path, int, float, bool, duration (-> seconds float), size (-> bytes int),
# choice, strlist, strdict, optfloat and optint (None when unset), optduration (None when unset or ""), url.


@dataclass
class TrainingConfig:
    command: str = _k("str", "")
    workdir: str = _k("path", "")
    session: str = _k("str", "train")
    log: str = _k("path", "")
    env: dict[str, str] = _k("strdict", {})
    pass_env: list[str] = _k("strlist", [])
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
    waste_after: float = _k("duration", 1800.0, min=1)
    on_waste: str = _k("choice", "alert", choices=("alert", "stop"))


# What trainer.save_model(output_dir) leaves in the watched folder itself: the final model.
FINAL_MODEL_FILES = ["*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "**/adapter_model.bin",
                     "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                     "vocab.*", "merges.txt", "*.tiktoken", "training_args.bin", "trainer_state.json",
                     "*results.json"]

# What the other trainers save (saves/formats.py judges each): Megatron's iter_NNNNNNN/ and its
# tracker, DeepSpeed's global_stepN/ and `latest` outside the HF Trainer, torch.distributed.checkpoint
# shards (their folder goes up whole, .metadata included), Lightning's and NeMo's .ckpt.
TRAINER_LAYOUTS = ["iter_[0-9]*/**", "**/latest_checkpointed_iteration.txt", "global_step[0-9]*/**",
                   "**/latest", "**/*.distcp", "**/*.ckpt", "*.ckpt/**",
                   # Accelerate's save_state (checkpoints/checkpoint_N/), torchtune's epoch_N/, and the
                   # single torch.save files of nanoGPT-style loops and Composer (ckpt.pt, ep1-ba300-rank0.pt)
                   "**/checkpoint_[0-9]*/**", "**/epoch_[0-9]*/**", "**/*.pt", "**/*.pth"]


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
                                        "**/adapter_config.json", *FINAL_MODEL_FILES, *TRAINER_LAYOUTS])
    exclude: list[str] = _k("strlist", [])
    quiet_period: float = _k("duration", 30.0)
    complete_marker: str = _k("str", "trainer_state.json")
    world_size: int = _k("int", 0, min=0, max=1_000_000)
    upload_sparse: bool = _k("bool", False)
    rescan_interval: float = _k("duration", 60.0, min=0.1)
    concurrency: int = _k("int", 16, min=1, max=64)
    part_size: int = _k("size", 8 * 1024 * 1024, min=5 * 1024 * 1024)
    multipart_threshold: int = _k("size", 64 * 1024 * 1024, min=5 * 1024 * 1024, max=5 * 1024 ** 3)
    bandwidth_limit: int = _k("size", 0)
    keep_last: int = _k("int", 0, min=0)
    follow_deletions: bool = _k("bool", False)
    ssh_key: str = _k("path", "")
    ssh_port: int = _k("int", 22, min=1, max=65535)
    host_key_policy: str = _k("choice", "accept-new", choices=("accept-new", "yes", "no"))
    known_hosts_file: str = _k("path", "")
    hf_token_file: str = _k("path", "")
    hf_private: bool = _k("bool", True)
    hf_allow_public: bool = _k("bool", False)
    hf_revision: str = _k("str", "main")
    fail_alert_after: float = _k("duration", 300.0)
    retry_max_backoff: float = _k("duration", 300.0)
    # not a key: where sync.watch came from when the config left it empty ("" when it was given)
    watch_default: str = field(default="", compare=False, metadata={"internal": True})


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


# stop.provider: "auto" finds it (env, then DMI); "none" never calls one (supervisor.stop.providers)
STOP_PROVIDERS = ("auto", "aws", "gcp", "azure", "lambda", "runpod", "vast", "oci", "nebius", "digitalocean",
                  "hetzner", "none")


@dataclass
class StopConfig:
    action: str = _k("choice", "auto", choices=("auto", "provider", "poweroff", "command", "ec2", "dry-run"))
    command: str = _k("str", "")
    final_sync: list[str] = _k("strlist", [])
    stop_even_if_sync_fails: bool = _k("bool", False)
    final_sync_timeout: float = _k("duration", 1800.0)
    retry_interval: float = _k("duration", 120.0)
    ec2_region: str = _k("str", "")
    ec2_endpoint_url: str = _k("url", "")
    imds_url: str = _k("url", "http://169.254.169.254")
    # the provider's own stop (supervisor.stop.providers; docs/providers.md)
    provider: str = _k("choice", "auto", choices=STOP_PROVIDERS)
    mode: str = _k("choice", "stop", choices=("stop", "terminate"))
    instance_id: str = _k("str", "")
    api_url: str = _k("url", "")
    metadata_url: str = _k("url", "")
    api_key_file: str = _k("path", "")
    confirm_within: float = _k("duration", 600.0, min=1)


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
    # None: the larger of 30m and 10 x the median step time (supervisor.progress.stall.threshold)
    stall_after: float | None = _k("optduration", None, min=60)
    stalled_action: str = _k("choice", "alert", choices=("alert", "stop"))
    sources: list[str] = _k("strlist", ["auto"])


# What a training may be asked to save with; the runner ignores each of these (it must outlive the job).
TRAINING_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGTERM", "SIGHUP")
PREEMPTION_PROVIDERS = ("ec2", "gcp", "azure")
# Where progress is read (supervisor.progress): "auto" is every one found.
PROGRESS_SOURCES = ("auto", "log", "trainer_state", "tensorboard", "mlflow", "trackio", "wandb", "lightning")


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
class HealthConfig:
    # 0: the GPU count NVML reported the first time this state_dir saw it (health.json)
    expect_gpus: int = _k("int", 0, min=0, max=64)
    burn_in: float = _k("duration", 0.0, max=600)
    on_bad: str = _k("choice", "alert", choices=("alert", "refuse", "stop"))


@dataclass
class BudgetConfig:
    max_cost: float | None = _k("optfloat", None, min=0)
    deadline: str = _k("str", "")
    max_runtime: float | None = _k("optduration", None, min=60)
    warn_at: float = _k("float", 0.8, min=0.05, max=1.0)
    margin: float = _k("duration", 300.0)
    scope: str = _k("choice", "machine", choices=("machine", "run"))


HOOK_EVENTS = ("finish", "idle_warning", "stop", "preemption", "final_sync_done", "alert")


@dataclass
class HookConfig:
    """One [[hooks]] entry (an array of tables: the loader reads it apart from the sections)."""

    run: str = _k("str", "")
    events: list[str] = _k("strlist", [])
    timeout: float = _k("duration", 600.0, min=1)
    required: bool = _k("bool", False)


@dataclass
class DiskConfig:
    alert_before: float | None = _k("optduration", None, min=0)
    prune: str = _k("choice", "off", choices=("off", "synced"))
    keep_local: int = _k("int", 2, min=1)


@dataclass
class ResumeConfig:
    from_target: bool = _k("bool", False)
    if_unreachable: str = _k("choice", "wait", choices=("wait", "start_fresh"))


@dataclass
class ClusterConfig:
    """One run on several machines (cluster/): each "" or 0 is taken from the engines' environment."""

    nodes: int = _k("int", 0, min=0, max=4096)           # 0: NNODES, PET_NNODES, SKYPILOT_NUM_NODES, ...; else 1
    rank: int | None = _k("optint", None, min=0, max=4095)  # unset: NODE_RANK, GROUP_RANK, SKYPILOT_NODE_RANK, ...
    run_id: str = _k("str", "")
    heartbeat: float = _k("duration", 15.0, min=0.2, max=600)
    silent_after: float = _k("duration", 60.0, min=1, max=86400)
    on_node_lost: str = _k("choice", "save_and_stop", choices=("save_and_stop", "alert"))
    key_file: str = _k("path", "")  # a secret every node shares: heartbeats and records carry its HMAC


@dataclass
class Config:
    state_dir: str = _k("path", "/var/lib/train-supervisor")
    socket: str = _k("path", DEFAULT_SOCKET)
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
    health: HealthConfig = field(default_factory=HealthConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    hooks: list[HookConfig] = field(default_factory=list, metadata={"internal": True})  # [[hooks]]: load.py
    disk: DiskConfig = field(default_factory=DiskConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    source: str = field(default="<defaults>", metadata={"internal": True})

    @property
    def save_dirs(self) -> list[str]:
        """Where checkpoints land: sync.watch, then training.workdir, each once (the progress tracker,
        the money and disk wings look there)."""
        return [d for d in dict.fromkeys([*self.sync.watch, self.training.workdir]) if d]


SECTIONS: dict[str, type] = {
    "training": TrainingConfig, "gpu": GpuConfig, "sync": SyncConfig, "idle": IdleConfig,
    "stop": StopConfig, "email": EmailConfig, "alerts": AlertsConfig, "progress": ProgressConfig,
    "notify": NotifyConfig, "metrics": MetricsConfig, "preemption": PreemptionConfig,
    "health": HealthConfig, "budget": BudgetConfig, "disk": DiskConfig, "resume": ResumeConfig,
    "cluster": ClusterConfig,
}


# How a problem line shows a key and a value (the loader and the checks alike).
def show_value(v: Any, limit: int = 80) -> str:
    """A value as it would read in TOML, escaped so a problem stays on one line."""
    if isinstance(v, bool):
        return "true" if v else "false"
    try:
        s = json.dumps(v, ensure_ascii=False, default=str)
    except ValueError:  # nan/inf inside a container
        s = repr(v)
    s = CTRL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", s)
    return s if len(s) <= limit else s[: limit - 3] + "..."


CTRL_CHARS = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def keyname(name: str) -> str:
    """A key from the file, quoted when TOML would need quotes (or it could break the line)."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else show_value(name)
