"""GPU memory that bills for nothing: held by a PID that no longer exists, or by a process that is
not the training while its GPU sits at 0 %. Pure.

NVML names the holder by its PID in the host's PID namespace. Inside a container (its own PID
namespace) such a PID is not ours to see: it is "not visible in this container", never "dead", and
nothing is ever done about it here but saying so. Memory held this way is never activity for the
idle rule (which counts GPU utilization, not memory) and never delays a stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DEAD, IDLE, NOT_VISIBLE = "dead", "idle", "not visible in this container"
IDLE_UTIL_PCT = 0.5   # a GPU below this over the window does no work


@dataclass(frozen=True)
class Holder:
    """A process NVML lists on a GPU, with what this machine can see of it."""

    gpu: int
    pid: int
    mem_bytes: int | None
    training: bool          # one of the training's processes
    exists: bool            # the PID exists in our PID namespace (and is no zombie)
    user: str = ""
    command: str = ""


@dataclass(frozen=True)
class Waste:
    gpu: int
    pid: int
    mem_bytes: int
    kind: str               # DEAD | IDLE | NOT_VISIBLE
    for_s: float
    user: str = ""
    command: str = ""

    @property
    def key(self) -> str:
        return f"{self.gpu}:{self.pid}"

    @property
    def actionable(self) -> bool:
        """A stop may be asked for it (gpu.on_waste = "stop"): never for a PID we cannot see."""
        return self.kind != NOT_VISIBLE


def kind_of(h: Holder, util: float | None, host_pids: bool, training_alive: bool) -> str:
    """"" when the holder is not waste now, else its kind. `host_pids`: this daemon sees the host's
    PID namespace (NVML's PIDs are ours); `training_alive`: our training runs (in a container its
    own processes are among the PIDs we cannot see)."""
    if h.training or not h.mem_bytes:
        return ""
    idle_gpu = util is not None and util < IDLE_UTIL_PCT
    if not host_pids:  # a container: the PID is the host's, never looked up here (it may name another process)
        return NOT_VISIBLE if idle_gpu and not training_alive else ""
    if not h.exists:
        return DEAD
    return IDLE if idle_gpu else ""


def observe(since: Mapping[str, tuple[str, float]], holders: list[Holder], util: Mapping[int, float | None],
            host_pids: bool, training_alive: bool, now: float) -> dict[str, tuple[str, float]]:
    """key -> (kind, since): each holder that is waste now, since when (a kind change starts over)."""
    out: dict[str, tuple[str, float]] = {}
    for h in holders:
        k = kind_of(h, util.get(h.gpu), host_pids, training_alive)
        if not k:
            continue
        key = f"{h.gpu}:{h.pid}"
        old = since.get(key)
        out[key] = old if old is not None and old[0] == k else (k, now)
    return out


def judge(since: Mapping[str, tuple[str, float]], holders: list[Holder], now: float, waste_after: float) -> list[Waste]:
    """The holders that have been waste for at least waste_after, biggest first."""
    out = []
    for h in holders:
        s = since.get(f"{h.gpu}:{h.pid}")
        if s is not None and now - s[1] >= waste_after and h.mem_bytes:
            out.append(Waste(h.gpu, h.pid, h.mem_bytes, s[0], now - s[1], h.user, h.command))
    return sorted(out, key=lambda w: (-w.mem_bytes, w.gpu, w.pid))


def free_with(w: Waste) -> str:
    """The command that frees the memory, in words a person can paste."""
    if w.kind == IDLE:
        return f"kill {w.pid}   (or end it where it runs: a notebook kernel, a server left behind)"
    if w.kind == DEAD:
        return (f"the PID is gone but the driver still holds its memory: end what holds the device "
                f"(fuser -v /dev/nvidia{w.gpu}; a zombie's parent), or reset the GPU once nothing runs on it: "
                f"nvidia-smi --gpu-reset -i {w.gpu}")
    return ("NVML reports host PIDs, and this one is not in this container: whoever runs the host (or the "
            "container's restart) can free it; nothing is done about it here")
