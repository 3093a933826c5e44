"""The `health` block (gpu/healthwatch.py): the GPU health verdict, its findings and every field per GPU."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.status import Block, Metric, Record, View, enum, gauge


@dataclass
class HealthGpu(Record):
    """gpu/health.py GpuHealth: None = unknown."""

    index: int | None = None
    name: str | None = None
    uuid: str | None = None
    error: str | None = None
    ecc_mode: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    throttle: int | None = None
    temp_c: int | None = None
    power_w: float | None = None
    persistence: bool | None = None
    nvlink_up: int | None = None
    nvlink_down: int | None = None
    util_pct: float | None = None


@dataclass
class Finding(Record):
    gpu: int | None = None
    level: str | None = None
    check: str | None = None
    what: str | None = None
    advice: str | None = None


@dataclass
class LiveFault(Record):
    key: str | None = None
    gpu: int | None = None
    what: str | None = None
    advice: str | None = None


@dataclass
class HealthBlock(Block):
    KEY = "health"
    verdict: str | None = None
    checked_at: float | None = None
    at_rest: bool | None = None
    on_bad: str | None = None
    expect_gpus: int | None = None
    expect_source: str | None = None
    burn_in: object = None      # {state, note, tflops: {gpu: TFLOP/s}}
    refused: str | None = None
    live: list[LiveFault] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    count: int | None = None
    notes: list[str] = field(default_factory=list)
    advice: str | None = None
    preflight: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    nvml_error: str | None = None
    gpus: list[HealthGpu] = field(default_factory=list)

    def lines(self, view: View) -> list[str]:
        """One line, and the advice when it is not OK."""
        v = self.verdict
        if not v:
            return []
        if v == "OK":
            unknown = len(self.unknown)
            return [f"health    OK ({self.count} GPU(s)" + (f", {unknown} field(s) unknown" if unknown else "") + ")"]
        out = [f"health    {v}" + (f": {self.advice.splitlines()[0]}" if self.advice else "")]
        out += [f"          {ln}" for ln in (self.advice or "").splitlines()[1:4]]
        for f in self.live[:3]:
            out.append(f"          during the run: {'GPU ' + str(f.gpu) + ': ' if f.gpu is not None else ''}{f.what}")
        if self.refused:
            out.append("          no training starts (health.on_bad)")
        return out

    def metrics(self, view: View) -> list[Metric]:
        if not self.verdict:
            return []
        out = enum("gpu_health", "GPU health verdict (supervisorctl health): 1 for the current one.", self.verdict,
                   ["OK", "DEGRADED", "BAD", "UNKNOWN"])
        out += [gauge("gpu_health_problem", "1 per health finding, by GPU, check and level.", 1,
                      {"gpu": "" if fd.gpu is None else fd.gpu, "check": fd.check or "", "level": fd.level or ""})
                for fd in self.findings]
        out += [gauge("gpu_health_live_fault", "1 per GPU fault seen during the run.", 1, {"key": lf.key or ""})
                for lf in self.live]
        for g in self.gpus:
            lab = {"gpu": g.index}
            out += [gauge("gpu_temperature_celsius", "GPU temperature.", g.temp_c, lab),
                    gauge("gpu_power_watts", "GPU power draw.", g.power_w, lab),
                    gauge("gpu_ecc_uncorrected_volatile", "Uncorrectable ECC errors since the driver loaded.",
                          g.ecc_uncorrected_volatile, lab),
                    gauge("gpu_pcie_link_width", "Current PCIe link width.", g.pcie_width, lab),
                    gauge("gpu_clock_event_reasons", "NVML clock-event (throttle) reasons bitmask.", g.throttle, lab)]
        return out
