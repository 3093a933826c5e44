"""The `gpus` / `gpu_error` block (gpu/monitor.py) and the `gpu_waste` block (gpu/wastewatch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.durations import format_duration
from supervisor.status import Block, Metric, Record, View, gauge

MAX_PROCS_SHOWN = 3
_GIB = 1024**3


def gib(b: float | None) -> str:
    return "?" if b is None else f"{b / _GIB:.1f}"


@dataclass
class GpuProcess(Record):
    pid: int | None = None
    mem_bytes: int | None = None
    training: bool | None = None


@dataclass
class Gpu(Record):
    index: int | None = None
    name: str | None = None
    uuid: str | None = None
    util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    processes: list[GpuProcess] | None = None
    mig: bool | None = None
    error: str | None = None

    def line(self) -> str:
        """`GPU0 NVIDIA H100 80GB HBM3  util  97%  mem 71.2/80.0 GiB  train pid 1234 70.1 GiB`"""
        head = f"GPU{self.index} {self.name or 'unknown GPU'}"
        if self.error:
            return f"{head}  FAILED: {self.error}"
        u = self.util_pct
        util = "  ?%" if u is None else f"{u:3.0f}%"
        if u is None and self.mig:
            util += " (MIG)"
        parts = [head, f"util {util}", f"mem {gib(self.mem_used_bytes)}/{gib(self.mem_total_bytes)} GiB"]
        # the training's processes first; a crowded GPU is summarised instead of wrapping the screen
        procs = sorted(self.processes or [], key=lambda p: (not p.training, -(p.mem_bytes or 0)))
        for p in procs[:MAX_PROCS_SHOWN]:
            parts.append(f"{'train' if p.training else 'other'} pid {p.pid} {gib(p.mem_bytes)} GiB")
        if len(procs) > MAX_PROCS_SHOWN:
            parts.append(f"+{len(procs) - MAX_PROCS_SHOWN} more")
        return "  ".join(parts)


@dataclass
class GpusBlock(Block):
    """Top-level `gpus` (one per GPU; empty with `gpu_error` when there is no NVIDIA driver)."""

    gpus: list[Gpu] = field(default_factory=list)
    gpu_error: str | None = None

    def lines(self, view: View) -> list[str]:
        out = [g.line() for g in self.gpus]
        if not out and self.gpu_error:
            out.append(f"gpus      none ({self.gpu_error})")
        return out

    def metrics(self, view: View) -> list[Metric]:
        out = [gauge("gpus", "GPUs the daemon sees.", len(self.gpus)),
               gauge("gpu_error", "1 when the GPUs cannot be read (no driver, NVML error).", bool(self.gpu_error))]
        for g in self.gpus:
            lab = {"gpu": g.index if g.index is not None else "", "uuid": g.uuid or "", "model": g.name or ""}
            out += [gauge("gpu_utilization_ratio", "GPU utilization (0-1), as NVML reports it.",
                          g.util_pct / 100.0 if g.util_pct is not None else None, lab),
                    gauge("gpu_memory_used_bytes", "GPU memory in use.", g.mem_used_bytes, lab),
                    gauge("gpu_memory_total_bytes", "GPU memory in all.", g.mem_total_bytes, lab),
                    gauge("gpu_processes", "Processes using the GPU.",
                          len(g.processes) if g.processes is not None else None, lab)]
        return out


@dataclass
class Waste(Record):
    gpu: int | None = None
    pid: int | None = None
    mem_bytes: int | None = None
    kind: str | None = None
    for_s: float | None = None
    user: str | None = None
    command: str | None = None
    free_with: str | None = None


@dataclass
class WasteBlock(Block):
    """Top-level `gpu_waste`: GPU memory held for nothing (a process outside the training, a dead PID)."""

    gpu_waste: list[Waste] = field(default_factory=list)

    def lines(self, view: View) -> list[str]:
        out = []
        for x in self.gpu_waste[:4]:
            who = f" ({x.user}: {(x.command or '')[:40]})" if x.user else ""
            out.append(f"  waste   GPU {x.gpu}: {gib(x.mem_bytes)} GiB held by PID {x.pid}{who}, {x.kind}, "
                       f"for {format_duration(x.for_s)}")
        return out
