"""Words about a hung run: the "training stalled" alert, and the reason a stalled run no longer
counts as work (status, the idle warning)."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.durations import format_bytes, format_duration
from supervisor.notify.mails import Mail
from supervisor.timefmt import hm, when

LOG_LINES = 20
SOURCE_WORDS = {"tsup": "the TSUP lines in the log", "tqdm": "the progress bar in the log", "log": "the log",
                "trainer_state": "trainer_state.json", "tensorboard": "the TensorBoard event files",
                "mlflow": "the MLflow file store", "trackio": "Trackio's database", "wandb": "the W&B offline run",
                "lightning": "Lightning's metrics.csv"}


@dataclass(frozen=True)
class GpuFigure:
    index: int
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None


@dataclass(frozen=True)
class Stalled:
    run_id: int
    step: int
    since: float                     # when that step was seen (wall)
    for_s: float
    threshold_s: float
    configured: bool                 # progress.stall_after was set (else the built-in rule)
    action: str = "alert"            # progress.stalled_action
    max_steps: int | None = None
    pids: tuple[int, ...] = ()
    cpu: str = ""                    # "CPU 98%" of the process tree since the last look; "" unknown
    gpus: tuple[GpuFigure, ...] = ()
    gpu_error: str | None = None
    log_path: str = ""
    log_tail: tuple[str, ...] = ()
    stacks: str = ""
    source: str = ""                 # where the step was last read (a progress source: SOURCE_WORDS)


def reason(step: int, since: float, for_s: float) -> str:
    """Why a stalled run's signs of life no longer count (appended to each probe's note)."""
    return f"training stalled: step {step} unchanged since {hm(since)}, {format_duration(for_s)}"


def _step(f: Stalled) -> str:
    return f"{f.step}/{f.max_steps}" if f.max_steps else f"{f.step}"


def _gpu(g: GpuFigure) -> str:
    util = "util unknown" if g.util_pct is None else f"util {g.util_pct:.0f}%"
    if g.mem_used_bytes is None:
        mem = "memory unknown"
    elif g.mem_total_bytes:
        mem = f"memory {format_bytes(g.mem_used_bytes)} of {format_bytes(g.mem_total_bytes)}"
    else:
        mem = f"memory {format_bytes(g.mem_used_bytes)}"
    return f"  GPU {g.index}: {util}, {mem}"


def stalled(f: Stalled) -> Mail:
    rule = "progress.stall_after" if f.configured else "the larger of 30m and 10 x the median step time"
    lines = [
        f"Training run {f.run_id} is running, but its step has not advanced for {format_duration(f.for_s)}.",
        "",
        f"Last step: {_step(f)}, seen at {when(f.since)}" + (f" (from {SOURCE_WORDS.get(f.source, f.source)};"
                                                              " no source has a newer one)." if f.source else "."),
        f"Stalled after: {format_duration(f.threshold_s)} without a new step ({rule}).",
        "",
        "GPUs:" if f.gpus else f"GPUs: {f.gpu_error or 'none seen'}",
        *[_gpu(g) for g in f.gpus],
        f"Processes of the training: {', '.join(map(str, f.pids)) or 'none found'}"
        + (f" ({f.cpu} of one core in all)" if f.cpu else ""),
        "",
        "A run hung in a collective (NCCL) or a deadlocked data loader often keeps the GPU busy and a CPU",
        "core spinning while no step advances. The stacks below show where each Python process is.",
    ]
    if f.action == "stop":
        lines += ["", "progress.stalled_action = \"stop\": this run now counts as idle. Unless it steps again or",
                  "someone is active, the idle warning follows after idle.warn_after, then the interrupt,",
                  "the final sync and the stop. `supervisorctl keepalive 2h` postpones it."]
    else:
        lines += ["", "Nothing is stopped (progress.stalled_action = \"alert\"). To end it: `supervisorctl stop`;",
                  "to look at it: `supervisorctl attach`."]
    lines += ["", f"Last lines of {f.log_path or 'the log'}:"]
    lines += [f"  {x}" for x in f.log_tail[-LOG_LINES:]] or ["  (none)"]
    lines += ["", "Python stacks (py-spy dump):", f.stacks or "(none)"]
    return Mail(f"training stalled: no step for {format_duration(f.for_s)} (step {_step(f)})", "\n".join(lines))
