"""Is an outer orchestrator (SkyPilot, dstack) in charge of this machine too?

Both can stop a machine on their own (SkyPilot's autostop, dstack's idle/max duration). With this
daemon's idle stop as well, two stoppers are configured; status says so, and the README says how
to run under each. Evidence: their variables in the daemon's, PID 1's or the training's environment,
or their agent running (SkyPilot's skylet, dstack's shim or runner). `detect` is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import structlog

from supervisor.interfaces import Duty
from supervisor.status import Block
from supervisor.status.misc import OrchestratorBlock

log = structlog.get_logger("idle")

SKYPILOT_ENV = ("SKYPILOT_TASK_ID", "SKYPILOT_CLUSTER_INFO", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES",
                "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE")
DSTACK_ENV = ("DSTACK_RUN_NAME", "DSTACK_RUN_ID", "DSTACK_REPO_ID", "DSTACK_NODE_RANK", "DSTACK_NODES_NUM",
              "DSTACK_GPUS_NUM", "DSTACK_MASTER_NODE_IP", "DSTACK_NODES_IPS", "DSTACK_GPUS_PER_NODE")
_PROCESS_MARKS = {"skypilot": ("sky.skylet.skylet", "sky/skylet/skylet.py"),
                  "dstack": ("dstack-shim", "dstack-runner")}
NAMES = {"skypilot": "SkyPilot", "dstack": "dstack"}
NOTE = ("{name} manages this machine and can stop it by itself (its autostop / idle duration), besides "
        "this daemon's idle stop: two stoppers are configured. Keep one in charge (see docs/fleet.md, "
        "\"Under SkyPilot or dstack\"); `supervisorctl idle-check` gives this daemon's verdict to the other.")


def detect(envs: Iterable[Mapping[str, str]], cmdlines: Iterable[str]) -> dict | None:
    """{"name", "evidence", "note"} for the first orchestrator seen, or None."""
    envs = list(envs)
    for key, names in (("skypilot", SKYPILOT_ENV), ("dstack", DSTACK_ENV)):
        for env in envs:
            hit = next((n for n in names if env.get(n)), None)
            if hit:
                return _found(key, f"{hit} in the environment")
    lines = list(cmdlines)
    for key, marks in _PROCESS_MARKS.items():
        for line in lines:
            mark = next((m for m in marks if m in line), None)
            if mark:
                return _found(key, f"process {mark} running")
    return None


def _found(key: str, evidence: str) -> dict:
    return {"name": key, "evidence": evidence, "note": NOTE.format(name=NAMES[key])}


def scan(extra_env: Mapping[str, str] | None = None) -> dict | None:
    """The shell: this process's and PID 1's environment, the training's env, and the process list."""
    import os

    import psutil

    envs: list[Mapping[str, str]] = [os.environ, extra_env or {}]
    try:
        with open("/proc/1/environ", "rb") as f:
            raw = f.read(1 << 20)
        envs.append(dict(kv.split("=", 1) for kv in raw.decode("utf-8", "replace").split("\0") if "=" in kv))
    except OSError:
        pass
    cmdlines = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdlines.append(" ".join(p.info.get("cmdline") or []))
        except (psutil.Error, TypeError):
            continue
    return detect(envs, cmdlines)


class OrchestratorWatch:
    """Looks every ten minutes (an agent started after boot is seen too); logs once per new finding."""

    def __init__(self, job_env: Mapping[str, str] | None = None):
        self.job_env = dict(job_env or {})
        self.found: dict | None = None

    def poll(self) -> None:
        found = scan(self.job_env)
        if found and found != self.found:
            log.warning("two_stoppers", orchestrator=found["name"], evidence=found["evidence"])
        self.found = found

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("orchestrator", 600.0, self.poll),)

    def status_blocks(self) -> tuple[Block, ...]:
        return (OrchestratorBlock.of(self.found),)
