"""Out-of-memory detection: what the training log and the kernel say when memory ran out.

`classify(line)` is pure: it knows the signatures PyTorch (and the trainers built on it: HF
Trainer, TRL, Unsloth, Axolotl, Accelerate, DeepSpeed) print for CUDA OOM, the kernel's OOM-killer
messages, NCCL's watchdog timeout and the launchers' "child killed by SIGKILL" reports.

`OomDetector` is a LineListener for the log follower: the first match of each kind in a run raises
one alert with the evidence line and what to change; repeats in the same run (every rank prints
the same traceback) are counted, not mailed. `check_exit` judges a training that ended by SIGKILL:
it says "kernel OOM killer" only with evidence (a kernel log record or an oom_kill counter that
grew during the run); a SIGKILL alone proves nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from supervisor.context import Context
from supervisor.interfaces import TrainingInfo
from supervisor.notify.mails import gpu as words
from supervisor.states import TrainingState
from supervisor.training.runner import is_banner

log = structlog.get_logger("oom")

CUDA_OOM = "cuda_oom"
HOST_ALLOC = "host_alloc"        # the process got a MemoryError allocating host RAM (not killed)
HOST_OOM = "host_oom"            # the kernel OOM killer killed something
CHILD_SIGKILL = "child_sigkill"  # a launcher reports a worker killed by SIGKILL (maybe OOM)
NCCL_TIMEOUT = "nccl_timeout"

@dataclass(frozen=True)
class OomMatch:
    kind: str
    line: str
    gpu: int | None = None
    tried: str | None = None       # "2.00 GiB"
    total: str | None = None
    free: str | None = None
    reserved_unallocated: str | None = None
    pid: int | None = None         # killed process (kernel / launcher messages)


_SIZE = r"\d+(?:\.\d+)?\s*[KMGTP]?i?B"

# A cheap first pass over every line; the precise patterns run only on lines that pass it.
_PREFILTER = re.compile(
    r"out of memory|outofmemory|out_of_memory|alloc_failed|can't allocate memory|memoryerror|"
    r"collective operation timeout|killed by signal|sigkill|exitcode\s*:\s*-9|return code = -9|"
    r"oom-kill|oom_reaper|resource_exhausted|unable to allocate",
    re.IGNORECASE)

# Lines that are source code quoted in a traceback, not an error that happened.
_CODE = re.compile(r"^\s*(?:if|elif|except|assert|raise|return|#)\b|\bin str\(")

_SIGNATURES: list[tuple[str, re.Pattern[str]]] = [
    (HOST_OOM, re.compile(r"(?:Memory cgroup out of memory|Out of memory): Killed process (?P<pid>\d+)")),
    (HOST_OOM, re.compile(r"oom-kill:.*\bpid=(?P<pid>\d+)")),
    (HOST_OOM, re.compile(r"oom_reaper: reaped process (?P<pid>\d+)")),
    (CUDA_OOM, re.compile(r"CUDA out of memory|CUDA error: out of memory|HIP out of memory", re.IGNORECASE)),
    (CUDA_OOM, re.compile(r"\btorch\.(?:cuda\.)?OutOfMemoryError\b")),
    (CUDA_OOM, re.compile(r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDA_ERROR_OUT_OF_MEMORY|"
                          r"cudaErrorMemoryAllocation|Cuda failure 'out of memory'")),
    (CUDA_OOM, re.compile(r"RESOURCE_EXHAUSTED: Out of memory while trying to allocate")),
    (HOST_ALLOC, re.compile(r"DefaultCPUAllocator: can't allocate memory|_ArrayMemoryError|"
                            r"^\s*MemoryError\b|Unable to allocate " + _SIZE + r" for an array")),
    (CHILD_SIGKILL, re.compile(r"DataLoader worker \(pid\(?s?\)?\s*(?P<pid>\d+)[^)]*\) is killed by signal: Killed")),
    (CHILD_SIGKILL, re.compile(r"exitcode\s*:\s*-9\b(?:\s*\(pid:\s*(?P<pid>\d+)\))?")),
    (CHILD_SIGKILL, re.compile(r"Signal 9 \(SIGKILL\) received by PID (?P<pid>\d+)")),
    (CHILD_SIGKILL, re.compile(r"exits with return code = -9|terminated with signal SIGKILL")),
    (NCCL_TIMEOUT, re.compile(r"Watchdog caught collective operation timeout|collective operation timeout")),
]

_TRIED = re.compile(r"Tried to allocate (" + _SIZE + ")")
_NEW_CAP = re.compile(r"GPU (\d+) has a total capacity of (" + _SIZE + r") of which (" + _SIZE + r") is free")
_OLD_CAP = re.compile(r"\(GPU (\d+); (" + _SIZE + r") total capacity;.*?(" + _SIZE + r") free")
_RESERVED = re.compile(r"(" + _SIZE + r") is reserved by PyTorch but unallocated")


def classify(line: str) -> OomMatch | None:
    """The out-of-memory (or related) event a log or kernel line reports, if any."""
    if not _PREFILTER.search(line) or _CODE.search(line):
        return None
    for kind, rx in _SIGNATURES:
        m = rx.search(line)
        if not m:
            continue
        pid = m.groupdict().get("pid")
        out = OomMatch(kind, line.strip(), pid=int(pid) if pid else None)
        if kind == CUDA_OOM:
            gpu = total = free = None
            cap = _NEW_CAP.search(line) or _OLD_CAP.search(line)
            if cap:
                gpu, total, free = int(cap.group(1)), cap.group(2), cap.group(3)
            tried = _TRIED.search(line)
            res = _RESERVED.search(line)
            out = OomMatch(kind, line.strip(), gpu=gpu, tried=tried.group(1) if tried else None,
                           total=total, free=free, reserved_unallocated=res.group(1) if res else None)
        return out
    return None


def killed_by_sigkill(info: TrainingInfo) -> bool:
    # -9 when the job itself was killed; 137 when a shell around it reports the child's SIGKILL
    return info.signal == "SIGKILL" or info.exit_code in (-9, 137)


# --- kernel evidence ------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelLine:
    seq: int | None
    ts: float | None     # seconds since boot (the kernel's clock)
    text: str


@dataclass
class Baseline:
    kmsg_seq: int | None = None
    dmesg_ts: float | None = None
    counters: dict[str, int] = field(default_factory=dict)
    taken_mono: float = 0.0


_DMESG_LINE = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\]\s?(.*)$")
_OOM_KILL_COUNTER = re.compile(r"^oom_kill\s+(\d+)\s*$", re.MULTILINE)


class EvidenceSources:
    """Where the kernel tells of OOM kills. Every path is injectable so tests feed real files."""

    def __init__(self, kmsg: str | None = "/dev/kmsg", dmesg: Sequence[str] | None = ("dmesg",),
                 vmstat: str | None = "/proc/vmstat", memory_events: Sequence[str] | None = None,
                 max_bytes: int = 8 * 1024 * 1024):
        self.kmsg = kmsg
        self.dmesg = tuple(dmesg) if dmesg else None
        self.vmstat = vmstat
        self.memory_events = list(memory_events) if memory_events is not None else _discover_memory_events()
        self.max_bytes = max_bytes

    def kernel_lines(self) -> tuple[list[KernelLine], str]:
        """(lines, source). kmsg gives sequence numbers; dmesg output only timestamps."""
        if self.kmsg:
            got = _read_kmsg(self.kmsg, self.max_bytes)
            if got is not None:
                return got, self.kmsg
        if self.dmesg:
            try:
                r = subprocess.run(list(self.dmesg), capture_output=True, timeout=5, check=False)
            except (OSError, subprocess.SubprocessError):
                return [], ""
            if r.returncode == 0:
                out = []
                for raw in r.stdout[-self.max_bytes:].decode("utf-8", "replace").splitlines():
                    m = _DMESG_LINE.match(raw)
                    out.append(KernelLine(None, float(m.group(1)), m.group(2)) if m else KernelLine(None, None, raw))
                return out, " ".join(self.dmesg)
        return [], ""

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in ([self.vmstat] if self.vmstat else []) + self.memory_events:
            try:
                m = _OOM_KILL_COUNTER.search(Path(p).read_text(errors="replace"))
            except OSError:
                continue
            if m:
                out[p] = int(m.group(1))
        return out

    def baseline(self, now_mono: float) -> Baseline:
        lines, src = self.kernel_lines()
        b = Baseline(counters=self.counters(), taken_mono=now_mono)
        if lines and src == self.kmsg:
            b.kmsg_seq = max((x.seq for x in lines if x.seq is not None), default=-1)
        elif lines:
            b.dmesg_ts = max((x.ts for x in lines if x.ts is not None), default=0.0)
        return b

    def evidence(self, base: Baseline, since_boot_s: float | None) -> list[str]:
        """What shows an OOM kill since `base` was taken. `since_boot_s`: the run's start on the
        kernel clock, used when the baseline has no kernel log position."""
        found: list[str] = []
        lines, src = self.kernel_lines()
        for x in lines:
            if base.kmsg_seq is not None and x.seq is not None:
                new = x.seq > base.kmsg_seq
            elif base.dmesg_ts is not None and x.ts is not None:
                new = x.ts > base.dmesg_ts
            elif since_boot_s is not None and x.ts is not None:
                new = x.ts >= since_boot_s
            else:
                new = False  # no way to tell an old OOM from this run's: not evidence
            if new:
                m = classify(x.text)
                if m and m.kind == HOST_OOM:
                    found.append(f"kernel log ({src}): {x.text.strip()}")
        now = self.counters()
        for p, v in now.items():
            before = base.counters.get(p)
            if before is not None and v > before:
                what = "system-wide" if p == self.vmstat else "cgroup"
                found.append(f"{what} OOM-kill counter {p}: oom_kill {before} -> {v}")
        return found


def _read_kmsg(path: str, limit: int) -> list[KernelLine] | None:
    """All records /dev/kmsg holds (or a regular file in its format), without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    out: list[KernelLine] = []
    buf = b""
    total = 0
    skipped = 0
    try:
        while total < limit:
            try:
                chunk = os.read(fd, 16384)
            except BlockingIOError:
                break
            except BrokenPipeError:
                skipped += 1  # the record was overwritten while we read; the next read moves on
                if skipped > 10000:
                    break
                continue
            except OSError:
                if total == 0:
                    return None
                break
            if not chunk:
                break
            total += len(chunk)
            buf += chunk
            *recs, buf = buf.split(b"\n")
            out.extend(r for r in map(_kmsg_record, recs) if r is not None)
    finally:
        os.close(fd)
    tail = _kmsg_record(buf)
    if tail is not None:
        out.append(tail)
    return out


def _kmsg_record(raw: bytes) -> KernelLine | None:
    if not raw or raw[:1] == b" ":
        return None  # empty, or a continuation (KEY=value) line
    head, sep, text = raw.partition(b";")
    if not sep:
        return None
    try:
        f = head.split(b",")
        return KernelLine(int(f[1]), int(f[2]) / 1e6, text.decode("utf-8", "replace"))
    except (IndexError, ValueError):
        return None


def _discover_memory_events() -> list[str]:
    """Our cgroup and its ancestors, whose OOM-kill counters count their descendants too, also those
    already removed (such as the training's transient scope): cgroup v2 memory.events, cgroup v1
    memory.oom_control. Inside a container the namespace root is the container's own cgroup."""
    out: list[str] = []
    root = Path("/sys/fs/cgroup")
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, rel = parts
        if hid == "0" and not controllers:
            base, name = root, "memory.events"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.oom_control"
        else:
            continue
        p = base / rel.strip().lstrip("/")
        while True:
            f = p / name
            if f.exists() and str(f) not in out:
                out.append(str(f))
            if p == base or base not in p.parents:
                break
            p = p.parent
    return out


# --- the listener ---------------------------------------------------------------------------------

class OomDetector:
    CONTEXT_LINES = 12

    def __init__(self, ctx: Context, evidence: EvidenceSources | None = None, log_path: str | None = None):
        self.ctx = ctx
        self.log_path = log_path  # named in the mails; the follower feeds the lines
        self.sources = evidence if evidence is not None else EvidenceSources()
        self._lock = threading.Lock()
        self._recent: deque[str] = deque(maxlen=self.CONTEXT_LINES)
        self._alerted: set[str] = set()
        self._counts: dict[str, int] = {}
        self._child_kill: OomMatch | None = None
        self._start_wall = ctx.clock.time()
        self._tag = int(self._start_wall)
        self._baseline = self._take_baseline()

    def _take_baseline(self) -> Baseline:
        try:
            return self.sources.baseline(time.monotonic())
        except Exception:  # noqa: BLE001 - evidence is best effort; without it we never claim OOM
            log.exception("oom_baseline_failed")
            return Baseline(taken_mono=time.monotonic())

    # --- LineListener --------------------------------------------------------------------------
    def reset(self, now: float) -> None:
        with self._lock:
            self._recent.clear()
            self._alerted.clear()
            self._counts.clear()
            self._child_kill = None
            self._start_wall = now
            self._tag = max(int(now), self._tag + 1)
        b = self._take_baseline()
        with self._lock:
            self._baseline = b

    def resume_run(self, started_at: float) -> None:
        """A daemon restarted during (or after) a run it did not see start. Alerts keep the run's
        key, so a line read again from the log is not mailed twice; kernel evidence is judged from
        the run's start on the kernel's clock, as no baseline could be taken before it."""
        with self._lock:
            self._start_wall = started_at
            self._tag = int(started_at)
            self._baseline = Baseline(taken_mono=time.monotonic())

    def feed_line(self, line: str, now: float) -> None:
        # the runner's banner repeats the command, which may well mention out-of-memory
        m = None if is_banner(line) else classify(line)
        with self._lock:
            self._recent.append(line[:500])
            if m is None:
                return
            self._counts[m.kind] = self._counts.get(m.kind, 0) + 1
            seen = CHILD_SIGKILL + ":seen" if m.kind == CHILD_SIGKILL else m.kind
            first = seen not in self._alerted
            self._alerted.add(seen)
            context = list(self._recent)
            if m.kind == CHILD_SIGKILL and self._child_kill is None:
                self._child_kill = m
        if not first:
            return
        log.warning("oom_signature", kind=m.kind, line=m.line[:300])
        if m.kind == CUDA_OOM:
            self._alert_cuda(m, context)
        elif m.kind == HOST_ALLOC:
            self._alert_host_alloc(m, context)
        elif m.kind == NCCL_TIMEOUT:
            self._alert_nccl(m, context)
        elif m.kind == HOST_OOM:
            self._alert_host_oom([f"training log: {m.line}"], context)
        elif m.kind == CHILD_SIGKILL:
            ev = self._evidence()
            with self._lock:
                fresh = bool(ev) and HOST_OOM not in self._alerted
                if fresh:
                    self._alerted.add(HOST_OOM)
            if fresh:
                self._alert_host_oom(ev + [f"training log: {m.line}"], context)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    # --- the end of a run ----------------------------------------------------------------------
    def check_exit(self, info: TrainingInfo) -> str | None:
        """Call when the training ended (after reading the log's last lines). Returns what ended it
        when that is about memory, for the caller's own message; raises host_oom_kill with evidence."""
        if info.state == TrainingState.STOPPED:
            return None  # stopped on request: our own SIGKILL is not an OOM
        with self._lock:
            child = self._child_kill
            already = HOST_OOM in self._alerted
        sig = killed_by_sigkill(info)
        if not sig and child is None:
            return None
        ev = self._evidence(info)
        if ev:
            if not already:
                with self._lock:
                    self._alerted.add(HOST_OOM)
                    context = list(self._recent)
                extra = [f"training log: {child.line}"] if child else []
                self._alert_host_oom(ev + extra, context, info)
            return "killed by the kernel OOM killer"
        what = "killed by SIGKILL" if sig else "a worker was killed by SIGKILL"
        log.info("training_sigkill_no_oom_evidence", exit_code=info.exit_code, signal=info.signal,
                 child=child.line[:200] if child else None)
        return f"{what} (no OOM evidence)"

    def _evidence(self, info: TrainingInfo | None = None) -> list[str]:
        with self._lock:
            base = self._baseline
            start = self._start_wall
        if info is not None and info.started_at:
            start = info.started_at
        since_boot = time.monotonic() - max(self.ctx.clock.time() - start, 0.0) - 5.0
        try:
            return self.sources.evidence(base, since_boot)
        except Exception:  # noqa: BLE001
            log.exception("oom_evidence_failed")
            return []

    # --- alerts --------------------------------------------------------------------------------
    def _alert_cuda(self, m: OomMatch, context: list[str]) -> None:
        mail = words.cuda_oom(m.line, context, self.log_path, gpu=m.gpu, tried=m.tried, total=m.total, free=m.free,
                              reserved_unallocated=m.reserved_unallocated)
        self.ctx.alerts.event(f"oom:cuda:{self._tag}", "cuda_oom", "critical", mail.subject, mail.body)

    def _alert_host_alloc(self, m: OomMatch, context: list[str]) -> None:
        mail = words.host_alloc(m.line, context, self.log_path)
        self.ctx.alerts.event(f"oom:host_alloc:{self._tag}", "host_alloc_failed", "critical", mail.subject, mail.body)

    def _alert_nccl(self, m: OomMatch, context: list[str]) -> None:
        mail = words.nccl_timeout(m.line, context, self.log_path)
        self.ctx.alerts.event(f"nccl:timeout:{self._tag}", "nccl_timeout", "critical", mail.subject, mail.body)

    def _alert_host_oom(self, evidence: list[str], context: list[str], info: TrainingInfo | None = None) -> None:
        mail = words.host_oom(evidence, context, self.log_path, ended=info is not None,
                              exit_code=info.exit_code if info else None, signal=info.signal if info else None)
        self.ctx.alerts.event(f"oom:host:{self._tag}", "host_oom_kill", "critical", mail.subject, mail.body)
