"""The configuration file: schema, defaults, and validation that reports every problem at once.

Every key is declared once (schema.py) with its kind and default; the loader (load.py) walks the
declarations, so a key cannot be read without being validated, and an unknown key (a typo such as
`warn_afer`) is an error instead of silently leaving idle protection at its default. Checks across
keys are checks.py. Everything else imports from here, never from the three parts.
"""

from supervisor.config.checks import nothing_watched, parse_listen
from supervisor.config.load import (
    from_dict,
    load,
    parse,
    redact_url,
    redacted,
    resolve_path,
)
from supervisor.config.schema import (
    DEFAULT_PATH,
    ENV_VAR,
    FINAL_MODEL_FILES,
    HOOK_EVENTS,
    PREEMPTION_PROVIDERS,
    SECTIONS,
    TRAINING_SIGNALS,
    AlertsConfig,
    BudgetConfig,
    ClusterConfig,
    Config,
    ConfigError,
    DiskConfig,
    EmailConfig,
    GpuConfig,
    HealthConfig,
    HookConfig,
    IdleConfig,
    MetricsConfig,
    NotifyConfig,
    PreemptionConfig,
    ProgressConfig,
    ResumeConfig,
    StopConfig,
    SyncConfig,
    TrainingConfig,
)

__all__ = [
    "SECTIONS",
    "AlertsConfig",
    "BudgetConfig",
    "ClusterConfig",
    "HOOK_EVENTS",
    "HookConfig",
    "Config",
    "ConfigError",
    "DEFAULT_PATH",
    "ENV_VAR",
    "EmailConfig",
    "FINAL_MODEL_FILES",
    "GpuConfig",
    "HealthConfig",
    "IdleConfig",
    "MetricsConfig",
    "NotifyConfig",
    "PREEMPTION_PROVIDERS",
    "DiskConfig",
    "PreemptionConfig",
    "ResumeConfig",
    "ProgressConfig",
    "StopConfig",
    "SyncConfig",
    "TRAINING_SIGNALS",
    "TrainingConfig",
    "from_dict",
    "load",
    "parse",
    "parse_listen",
    "nothing_watched",
    "redact_url",
    "redacted",
    "resolve_path",
]
