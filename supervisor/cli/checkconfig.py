"""check-config's look at the machine beside the config: what the daemon would refuse among the
notification channels, and the warnings (config/hints.py words them; the Hub is asked whether a
repo is public). The CLI prints them."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.config import Config


def stop_plan(cfg: Config):  # noqa: ANN201 - supervisor.stop.choose.Plan, imported where it is needed
    """What the stop does on this machine (the provider found, its credential, what still bills):
    the same resolution the daemon makes at start (supervisor.stop.resolve)."""
    from supervisor.stop.resolve import choose

    return choose(cfg.stop, quiet=True)


def stop_settings(cfg: Config) -> str:
    """Where each stop setting lives, with its value: per reason (the rule table's order), then what
    every stop's sequence reads (supervisor.stop.rules.SETTINGS)."""
    import dataclasses

    from supervisor.durations import format_duration
    from supervisor.stop.rules import SEQUENCE_SETTINGS, SETTINGS

    def value(key: str) -> str:
        x: object = cfg
        kind = ""
        for part in key.split("."):
            f = next((f for f in dataclasses.fields(x) if f.name == part), None) if dataclasses.is_dataclass(x) else None
            kind = f.metadata.get("kind", "") if f is not None else ""
            x = getattr(x, part, None)
        if x in (None, "", []):
            return "unset"
        return format_duration(float(x)) if "duration" in kind and isinstance(x, int | float) else str(x)

    def keys(ks: tuple[str, ...]) -> str:
        return ", ".join(f"{k} = {value(k)}" for k in ks)

    out = ["stop settings (supervisor/stop/rules.py: what each reason does):"]
    out += [f"  {words:<22} {keys(ks) or 'supervisorctl stop-machine (root)'}" for words, ks in SETTINGS.items()]
    return "\n".join([*out, f"  {'every stop':<22} {keys(SEQUENCE_SETTINGS)}"]) + "\n"


def warnings(cfg: Config, plan: object | None = None) -> list[str]:
    """What is allowed but unsafe: a log folder others can write (training.user), a public Hub repo,
    a stop that leaves the machine billing (poweroff in a container, on Azure, Lambda without
    terminate...), a checkpoint rotation that can outrun the target."""
    from supervisor.config import hints
    from supervisor.training.safeopen import open_folder_warning

    out = hints.warnings(cfg, dict(os.environ), hints.in_container(), plan)
    if cfg.training.user:
        w = open_folder_warning(cfg.training.log or str(Path(cfg.state_dir) / "train.log"), cfg.training.user)
        out += [w] if w else []
    if cfg.sync.target.startswith("hf://") and not cfg.sync.hf_allow_public:
        out += [w for w in [hub_public_warning(cfg)] if w]
    return out


def hub_public_warning(cfg: Config) -> str:
    """Asks the Hub (when it can be reached) whether the hf:// repo is public: the daemon would refuse it."""
    import tempfile

    from supervisor.config.target import parse_target
    from supervisor.store.hf_repo import HubRepo

    try:
        url = parse_target(cfg.sync.target)
    except ValueError:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        if HubRepo(url, cfg.sync, tmp, dict(os.environ)).is_public():
            return (f"sync.target {cfg.sync.target}: {url.repo} is a public repo; the daemon refuses to upload "
                    "there unless sync.hf_allow_public = true")
    return ""


def channel_problems(cfg: Config) -> list[str]:
    """What the daemon would refuse among the notification channels: Apprise URLs it cannot use,
    an unreadable urls_file (Apprise is imported only when URLs are configured)."""
    if not (cfg.notify.urls or cfg.notify.urls_file):
        return []
    from supervisor.daemon.channels import build_channels

    _, problems = build_channels(cfg)
    return problems
