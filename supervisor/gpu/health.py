"""Is this machine healthy? The verdict on what NVML says about the GPUs: pure, no I/O, no clock.

`judge` turns one HealthFacts (what the NVML probe read: supervisor.gpu.nvml.NvmlProbe.health) into
a Verdict: OK, DEGRADED (it works, but slower or riskier: each reason named) or BAD (it will fail or
corrupt the run: the owner should get another machine), with the advice the alert and status show.
UNKNOWN only when there is nothing to judge (no NVIDIA driver and no GPU expected). A field NVML
does not give on this GPU or driver is None: it is listed as unknown and never counts against the
machine.

`live` is the same idea during a run, over successive facts: new uncorrectable ECC errors, a
sustained thermal or hardware slowdown while the utilisation drops, and "training slower than at its
start by more than 30 % while the GPU throttles" (the rates come from the progress tracker).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

OK, DEGRADED, BAD, UNKNOWN = "OK", "DEGRADED", "BAD", "UNKNOWN"
VERDICTS = (OK, DEGRADED, BAD, UNKNOWN)
LEVEL_VALUE = {UNKNOWN: -1, OK: 0, DEGRADED: 1, BAD: 2}  # the metric's value

# NVML clock-event reasons (nvmlClocksEventReason*) that mean the GPU is held down by its hardware,
# its temperature or its power delivery; idle (0x1), application clocks (0x2), the software power cap
# (0x4, normal under full load) and sync boost (0x10) are not faults.
SLOWDOWN_BITS = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
                 0x80: "HW power brake"}
SLOWDOWN_MASK = sum(SLOWDOWN_BITS)
HOT_AT_REST_C = 75           # an idle data-centre GPU sits at 25-45 C; this hot with no load means poor cooling
BURN_IN_SLOWER = 0.15        # a GPU this much below the others' median matmul throughput is "slow"
RUN_SLOWER = 0.30            # training this much slower than at its start, while throttling
SUSTAIN_S = 120.0            # a slowdown must hold this long during a run before it is an alert
UTIL_DROP_PCT = 10.0         # ... and the utilisation fall this many points below where it was

REPLACE = "ask the provider for another machine; this one is billing"


@dataclass(frozen=True)
class GpuHealth:
    """One GPU as NVML reported it; None = unknown (NotSupported, no permission, old driver)."""

    index: int
    name: str | None = None
    uuid: str | None = None
    error: str | None = None                    # the GPU itself is gone (lost, needs a reset)
    ecc_mode: bool | None = None
    ecc_uncorrected_volatile: int | None = None   # since the driver loaded
    ecc_uncorrected_aggregate: int | None = None  # over the GPU's life
    retired_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    throttle: int | None = None                 # clock-event reasons bitmask
    temp_c: int | None = None
    power_w: float | None = None
    persistence: bool | None = None
    nvlink_up: int | None = None
    nvlink_down: int | None = None
    util_pct: float | None = None


@dataclass(frozen=True)
class HealthFacts:
    gpus: tuple[GpuHealth, ...] = ()
    count: int | None = None                    # NVML's device count; None when NVML is unavailable
    error: str | None = None                    # why NVML is unavailable
    driver_version: str | None = None
    cuda_version: str | None = None


@dataclass(frozen=True)
class Finding:
    gpu: int | None
    level: str          # DEGRADED | BAD
    check: str          # gpu_count, lost, ecc, ecc_aggregate, retired_pending, remap_pending, remap_failed,
                        # nvlink, pcie_width, throttle_at_rest, hot_at_rest, persistence, ecc_off, burn_in
    what: str
    advice: str


@dataclass(frozen=True)
class Verdict:
    verdict: str
    findings: tuple[Finding, ...] = ()
    unknown: tuple[str, ...] = ()
    expect_gpus: int | None = None
    count: int | None = None
    notes: tuple[str, ...] = ()

    def reasons(self) -> list[str]:
        return [(f"GPU {f.gpu}: " if f.gpu is not None else "") + f.what for f in self.findings]

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "reasons": self.reasons(),
                "findings": [{"gpu": f.gpu, "level": f.level, "check": f.check, "what": f.what,
                              "advice": f.advice} for f in self.findings],
                "unknown": list(self.unknown), "expect_gpus": self.expect_gpus, "count": self.count,
                "notes": list(self.notes), "advice": advice(self)}


# --- the preflight -----------------------------------------------------------------------------------

def slowdowns(mask: int | None) -> list[str]:
    if not mask:
        return []
    return [name for bit, name in SLOWDOWN_BITS.items() if mask & bit]


def _gpu_findings(g: GpuHealth, at_rest: bool, peers_up: int) -> list[Finding]:
    out: list[Finding] = []

    def bad(check: str, what: str, adv: str = REPLACE) -> None:
        out.append(Finding(g.index, BAD, check, what, adv))

    def degraded(check: str, what: str, adv: str) -> None:
        out.append(Finding(g.index, DEGRADED, check, what, adv))

    if g.error:
        bad("lost", f"{g.error}", REPLACE)
        return out
    if g.ecc_uncorrected_volatile:
        bad("ecc", f"{g.ecc_uncorrected_volatile} uncorrectable ECC error"
                   f"{'s' if g.ecc_uncorrected_volatile != 1 else ''}")
    elif g.ecc_uncorrected_aggregate:
        degraded("ecc_aggregate", f"{g.ecc_uncorrected_aggregate} uncorrectable ECC error"
                                  f"{'s' if g.ecc_uncorrected_aggregate != 1 else ''} in its lifetime (none since "
                                  "the driver loaded)",
                 "memory has failed before; watch for new errors (an alert follows if one comes)")
    if g.remap_failed:
        bad("remap_failed", "row remapping failed")
    if g.remap_pending:
        bad("remap_pending", "row remapping pending (needs a GPU reset)")
    if g.retired_pending:
        bad("retired_pending", "retired memory pages pending (needs a GPU reset)")
    if g.nvlink_up is not None and g.nvlink_up < peers_up:
        n = peers_up - g.nvlink_up
        bad("nvlink", f"{n} NVLink link{'s' if n != 1 else ''} down ({g.nvlink_up} up where another GPU has "
                      f"{peers_up})")
    if g.pcie_width is not None and g.pcie_width_max and g.pcie_width < g.pcie_width_max:
        degraded("pcie_width", f"PCIe link x{g.pcie_width} (max x{g.pcie_width_max})",
                 "host-to-GPU copies (data loading, offload, multi-GPU over PCIe) run slower; "
                 "ask the provider to reseat the card or for another machine if it matters")
    if at_rest:
        slow = slowdowns(g.throttle)
        if slow:
            degraded("throttle_at_rest", f"clocks held down at rest ({', '.join(slow)})",
                     "poor cooling or power delivery: expect a slow run; ask the provider to check the machine")
        if g.temp_c is not None and g.temp_c >= HOT_AT_REST_C:
            degraded("hot_at_rest", f"{g.temp_c} C at rest", "poor cooling: it will throttle under load")
    if g.ecc_mode is False:
        degraded("ecc_off", "ECC off: memory errors go undetected",
                 "enable it with `nvidia-smi -e 1` and a reboot (on a rental: ask the provider)")
    if g.persistence is False:
        degraded("persistence", "persistence mode off",
                 "each CUDA start re-initialises the GPU (seconds, and lost settings): "
                 "`sudo nvidia-smi -pm 1` or enable nvidia-persistenced")
    return out


_FIELDS = ("ecc_mode", "ecc_uncorrected_volatile", "retired_pending", "remap_failed", "pcie_width",
           "pcie_width_max", "throttle", "temp_c", "power_w", "persistence", "nvlink_down")


def judge(facts: HealthFacts, expect_gpus: int | None, *, at_rest: bool = True,
          burn_in: Mapping[int, float] | None = None) -> Verdict:
    """The verdict on one reading. `expect_gpus`: how many GPUs the machine should have (config, or
    the count at first boot; None = no expectation). `at_rest`: no training runs (throttling and heat
    are judged only then). `burn_in`: matmul throughput (TFLOP/s) per GPU index, when one ran."""
    findings: list[Finding] = []
    notes: list[str] = []
    seen = len(facts.gpus) if facts.count is not None else 0
    if expect_gpus and seen < expect_gpus:
        what = (f"{seen} of {expect_gpus} GPUs present" if facts.count is not None
                else f"no GPU answers ({facts.error or 'NVML unavailable'}); {expect_gpus} expected")
        findings.append(Finding(None, BAD, "gpu_count", what, REPLACE))
    elif expect_gpus and seen > expect_gpus:
        notes.append(f"{seen} GPUs present, {expect_gpus} expected (health.expect_gpus)")
    # NVLink is judged against the peers: a GPU with fewer links up than the best-connected GPU lost
    # some. Links inactive alike on every GPU are how the machine is built (PCIe cards without a
    # bridge, or fewer bridges than links), not a fault.
    peers_up = max((g.nvlink_up for g in facts.gpus if g.nvlink_up is not None and not g.error), default=0)
    if any(g.nvlink_down for g in facts.gpus) and all(
            (g.nvlink_up or 0) >= peers_up for g in facts.gpus if g.nvlink_up is not None and not g.error):
        notes.append("NVLink links inactive alike on every GPU (no bridge, or fewer bridges than links)")
    for g in facts.gpus:
        findings += _gpu_findings(g, at_rest, peers_up)
    findings += _burn_in_findings(burn_in or {})
    unknown = [f"GPU {g.index}: {k}" for g in facts.gpus if not g.error for k in _FIELDS
               if getattr(g, k) is None]
    if any(g.pcie_gen is not None and g.pcie_gen_max and g.pcie_gen < g.pcie_gen_max for g in facts.gpus):
        notes.append("PCIe generation below its maximum: normal at rest (the link slows down to save power)")
    if facts.count is None and not expect_gpus:
        return Verdict(UNKNOWN, tuple(findings), tuple(unknown), expect_gpus, facts.count,
                       (*notes, facts.error or "NVML unavailable"))
    level = BAD if any(f.level == BAD for f in findings) else DEGRADED if findings else OK
    return Verdict(level, tuple(findings), tuple(unknown), expect_gpus, facts.count, tuple(notes))


def _burn_in_findings(tflops: Mapping[int, float]) -> list[Finding]:
    """Each GPU against the median of the others: more than BURN_IN_SLOWER below is slow."""
    if len(tflops) < 2:
        return []
    out = []
    for i, v in sorted(tflops.items()):
        others = sorted(x for j, x in tflops.items() if j != i)
        mid = len(others) // 2
        median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
        if median > 0 and v < median * (1 - BURN_IN_SLOWER):
            out.append(Finding(i, DEGRADED, "burn_in",
                               f"slow in burn-in: {v:.0f} TFLOP/s, {100 * (1 - v / median):.0f} % below the others "
                               f"({median:.0f})",
                               "a multi-GPU run goes at the pace of its slowest GPU; ask the provider to check it"))
    return out


def advice(v: Verdict) -> str:
    """One line per GPU (and one for the machine), the facts then what to do:
    "GPU 3: 2 uncorrectable ECC errors, row remapping failed — ask the provider for another machine;
    this one is billing"."""
    by: dict[int | None, list[Finding]] = {}
    for f in v.findings:
        by.setdefault(f.gpu, []).append(f)
    lines = []
    for gpu in sorted(by, key=lambda x: -1 if x is None else x):
        fs = by[gpu]
        what = ", ".join(f.what for f in fs)
        bad = [f for f in fs if f.level == BAD]
        todo = bad[0].advice if bad else "; ".join(dict.fromkeys(f.advice for f in fs))
        lines.append(f"{'GPU ' + str(gpu) + ': ' if gpu is not None else ''}{what} — {todo}")
    return "\n".join(lines)


# --- during the run ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LiveState:
    ecc_base: dict[int, int] = field(default_factory=dict)       # volatile count when the run was first seen
    slow_since: dict[int, float] = field(default_factory=dict)   # monotonic start of the slowdown stretch
    util_before: dict[int, float] = field(default_factory=dict)  # utilisation when it began


@dataclass(frozen=True)
class LiveFinding:
    key: str            # ecc_new:N | slowdown:N | slower
    gpu: int | None
    what: str
    advice: str


def live(state: LiveState, facts: HealthFacts, now: float, *, rate_start: float | None = None,
         rate_now: float | None = None) -> tuple[LiveState, list[LiveFinding]]:
    """One poll during a run. Returns the new state and what holds now: new uncorrectable ECC errors
    (against the count when the run began), a thermal/hardware slowdown held SUSTAIN_S with the
    utilisation UTIL_DROP_PCT points below where it was, and the run RUN_SLOWER slower than at its
    start while any GPU throttles. Unknown fields decide nothing."""
    base, since, before = dict(state.ecc_base), dict(state.slow_since), dict(state.util_before)
    out: list[LiveFinding] = []
    throttling: list[int] = []
    for g in facts.gpus:
        if g.error:
            continue
        v = g.ecc_uncorrected_volatile
        if v is not None:
            b = base.setdefault(g.index, v)
            if v > b:
                out.append(LiveFinding(f"ecc_new:{g.index}", g.index,
                                       f"{v - b} new uncorrectable ECC error{'s' if v - b != 1 else ''} during the run",
                                       "results computed since may be corrupt: stop, resume from the last synced "
                                       f"checkpoint on another machine; {REPLACE}"))
        slow = slowdowns(g.throttle)
        if not slow:
            since.pop(g.index, None)
            before.pop(g.index, None)
            continue
        throttling.append(g.index)
        if g.index not in since:
            since[g.index] = now
            if g.util_pct is not None:
                before[g.index] = g.util_pct
        held = now - since[g.index]
        u0 = before.get(g.index)
        if held >= SUSTAIN_S and u0 is not None and g.util_pct is not None and g.util_pct <= u0 - UTIL_DROP_PCT:
            out.append(LiveFinding(f"slowdown:{g.index}", g.index,
                                   f"{', '.join(slow)} for {held / 60:.0f} min, utilisation {u0:.0f}% -> "
                                   f"{g.util_pct:.0f}%" + (f", {g.temp_c} C" if g.temp_c is not None else ""),
                                   "cooling or power delivery is failing: the run goes slower; "
                                   "ask the provider to check the machine"))
    if throttling and rate_start and rate_now is not None and rate_now < rate_start * (1 - RUN_SLOWER):
        pct = 100 * (1 - rate_now / rate_start)
        gpus = ", ".join(str(i) for i in throttling)
        out.append(LiveFinding("slower", None,
                               f"training {pct:.0f} % slower than at its start while GPU {gpus} throttle"
                               f"{'s' if len(throttling) == 1 else ''}",
                               "the slowdown is the hardware's, not the code's; "
                               f"if it lasts, resume on another machine; {REPLACE}"))
    return replace(state, ecc_base=base, slow_since=since, util_before=before), out
