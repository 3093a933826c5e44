"""What check-config warns about that is allowed but will not do what the owner expects here.

Pure functions of the config, the environment and what the machine is (a container or not); the
CLI and `status` read the machine and print the words. What the provider's own stop leaves
billing is worded by supervisor.stop (the resolved plan's warning) and passed in. Two traps found by trying it as a new user
would (issue 37): `poweroff` inside a container does nothing to the machine that bills, and the
trainer's checkpoint rotation deletes checkpoints that never left the machine while the target is
slower than the saves.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from supervisor.config.schema import Config


@dataclass(frozen=True)
class Provider:
    name: str
    stop_command: str  # what stop.command should say there


# The variables each container host sets in its containers, and its own CLI's stop. vast.ai sets
# CONTAINER_ID (the instance id its CLI takes) and VAST_CONTAINERLABEL.
PROVIDERS: tuple[tuple[str, Provider], ...] = (
    ("RUNPOD_POD_ID", Provider("RunPod", "runpodctl stop pod $RUNPOD_POD_ID")),
    ("VAST_CONTAINERLABEL", Provider("vast.ai", "vastai stop instance $CONTAINER_ID")),
    ("CONTAINER_ID", Provider("vast.ai", "vastai stop instance $CONTAINER_ID")),
)
GENERIC = Provider("", "your provider's CLI, e.g. runpodctl stop pod $RUNPOD_POD_ID or "
                       "vastai stop instance $CONTAINER_ID")

ROTATION = re.compile(r"--save[_-]total[_-]limit[= ]+(\d+)")


def provider(env: dict[str, str]) -> Provider | None:
    return next((p for var, p in PROVIDERS if env.get(var)), None)


def in_container(root: str = "/") -> bool:
    """No systemd as PID 1 (the daemon then runs under train-supervisor-start), which is what
    decides whether `poweroff` and `systemctl` mean anything here."""
    return not os.path.isdir(os.path.join(root, "run/systemd/system"))


# a provider's own key in its container: stop.action = "auto" then calls its API (supervisor.stop)
PROVIDER_KEYS = (("RUNPOD_POD_ID", "RUNPOD_API_KEY"), ("CONTAINER_ID", "CONTAINER_API_KEY"))


def stop_warning(cfg: Config, env: dict[str, str], container: bool) -> str:
    """poweroff in a container: set, or the "auto" stop's fallback where no provider key is at hand."""
    action = cfg.stop.action
    if action not in ("poweroff", "auto") or not container:
        return ""
    if action == "auto" and (cfg.stop.provider != "auto" or any(env.get(i) and env.get(k) for i, k in PROVIDER_KEYS)):
        return ""  # the provider's own stop (stop/resolve.py words what it lacks, if anything)
    p = provider(env) or GENERIC
    where = f"this is a {p.name} container" if p.name else "no systemd runs here (a container?)"
    cmd = f'"{p.stop_command}"' if p.name else p.stop_command
    lead = 'stop.action = "poweroff"' if action == "poweroff" else \
        'stop.action = "auto" finds no provider key here and falls back to poweroff'
    return (f'{lead}: {where}, and poweroff inside a container does not stop the machine '
            f'that bills; set stop.action = "command" and stop.command = {cmd}')


def provider_warning(plan: object | None) -> str:
    """What the resolved stop (supervisor.stop.choose.Plan) warns about: a stop that leaves the
    machine billing, named with what keeps billing and the setting that fixes it."""
    return str(getattr(plan, "warning", "") or "")


def rotation_warning(cfg: Config) -> str:
    """The training command keeps only N checkpoints: the trainer deletes the oldest at each save
    whether it went up or not, so a target slower than N saves loses work."""
    m = ROTATION.search(cfg.training.command or "")
    if not m or not cfg.sync.target:
        return ""
    n = int(m.group(1))
    return (f"training.command: --save_total_limit {n} deletes the oldest checkpoint at each save, uploaded or "
            f"not; if {cfg.sync.target} falls {n} saves behind (down, slow, refusing the keys) checkpoints are "
            f"lost (the daemon alerts when one is). Leave rotation to disk.prune = \"synced\" (it deletes only "
            f"what the target verifiably holds), or raise the limit")


def daemon_hint(container: bool) -> str:
    """How to start the daemon, for a client that cannot reach it."""
    return "start it with train-supervisor-start" if container else "systemctl status train-supervisor"


def warnings(cfg: Config, env: dict[str, str], container: bool, plan: object | None = None) -> list[str]:
    """`plan`: the resolved stop; its warning (it knows the provider) stands in for the container hint."""
    stop = provider_warning(plan) or stop_warning(cfg, env, container)
    return [w for w in (stop, rotation_warning(cfg)) if w]
