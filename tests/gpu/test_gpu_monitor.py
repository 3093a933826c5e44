"""GpuMonitor over the real probe and the fake libnvidia-ml: rolling window, status, alerts."""

from __future__ import annotations

import json
import os

import pytest

from supervisor.cli.render import gpu_line, gpu_lines, render_status
from supervisor.gpu.monitor import GpuMonitor, gpu_dict
from supervisor.gpu.nvml import GpuSample, NvmlProbe
from tests.fixtures.nvml import GIB, gpu, make_ctx


class Training:
    """A TrainingView: the job's process tree, as supervisor.training.job reports it."""

    def __init__(self, pids: set[int]):
        self._pids = pids
        self.calls = 0

    def info(self):  # pragma: no cover - not used by the monitor
        raise NotImplementedError

    def pids(self) -> set[int]:
        self.calls += 1
        return set(self._pids)


@pytest.fixture
def make(fake_nvml, tmp_path, clock):
    made = []

    def _make(config: dict | None = None, training=None, lib: str | None = None) -> GpuMonitor:
        cfg = {"gpu": {"poll_interval": "5s", "nvml_library": lib or fake_nvml.lib_path, **(config or {})}}
        ctx = make_ctx(tmp_path, clock, cfg)
        m = GpuMonitor(ctx, ctx.config.gpu, training=training)
        made.append(m)
        return m

    yield _make
    for m in made:
        m.close()


def render_lines(m: GpuMonitor) -> list[str]:
    """The GPU lines as `supervisorctl status` builds them, from the status --json block alone."""
    return gpu_lines(m.status())


def render_gpu(g: GpuSample, train_of: dict[int, bool] | None = None) -> str:
    return gpu_line(gpu_dict(g, train_of or {}))


def keys(m: GpuMonitor) -> set[str]:
    return {a["key"] for a in m.ctx.alerts.active()}


def events(m: GpuMonitor, prefix: str) -> list[dict]:
    return [r for r in m.ctx.alerts.recent() if r["key"].startswith(prefix) and r["what"] in ("event", "raised")]


def test_zero_gpus_status(fake_nvml, make):
    fake_nvml.write(0)
    m = make()
    m.poll()
    assert m.status()["gpus"] == [] and m.status()["gpu_error"] == "NVML reports no GPUs"
    assert render_lines(m) == [] and m.utilization(60) is None
    assert keys(m) == set()


def test_no_driver_is_status_not_alert(tmp_path, make, clock):
    m = make(lib=str(tmp_path / "missing" / "libnvidia-ml.so.1"))
    for _ in range(3):
        m.poll()
        clock.advance(5)
    st = m.status()
    assert st["gpus"] == [] and "cannot load the NVML library" in st["gpu_error"]
    assert keys(m) == set() and m.ctx.alerts.recent() == []
    assert m.utilization(10) is None  # unknown, never "idle"


def test_before_first_poll(make):
    m = make()
    assert m.status() == {"gpus": [], "gpu_error": "GPUs not polled yet", "gpu_driver": None}
    assert render_lines(m) == [] and m.peak_mem_bytes() is None


def test_one_gpu_status_contract_and_line(fake_nvml, make):
    me = os.getpid()
    fake_nvml.write([gpu(util=97, total=80 * GIB, used=int(71.2 * GIB),
                         procs=[(me, int(70.1 * GIB)), (999999, GIB)])])
    m = make(training=Training({me, me + 1}))
    m.poll()
    st = m.status()
    json.dumps(st)  # plain data
    (g,) = st["gpus"]
    for k in ("index", "name", "util_pct", "mem_used_bytes", "mem_total_bytes", "processes"):
        assert k in g
    assert g["processes"] == [{"pid": me, "mem_bytes": int(70.1 * GIB), "training": True},
                              {"pid": 999999, "mem_bytes": GIB, "training": False}]
    assert render_lines(m) == [
        f"GPU0 NVIDIA H100 80GB HBM3  util  97%  mem 71.2/80.0 GiB  train pid {me} 70.1 GiB  other pid 999999 1.0 GiB"]
    assert st["gpu_error"] is None and st["gpu_driver"] == "550.54.15"


def test_eight_gpus_shown_in_status_screen(fake_nvml, make):
    fake_nvml.write([gpu(util=90 + i, used=(60 + i) * GIB, total=80 * GIB) for i in range(8)])
    m = make()
    m.poll()
    lines = render_lines(m)
    assert len(lines) == 8 and lines[7].startswith("GPU7 NVIDIA H100 80GB HBM3  util  97%  mem 67.0/80.0 GiB")
    screen = render_status({"now": 0, "training": {"state": "RUNNING"}, "gpus": m.status()["gpus"],
                            "gpu_error": None, "lines": {"gpus": lines}})
    assert all(line in screen for line in lines)


def test_status_screen_without_driver(tmp_path, make):
    m = make(lib=str(tmp_path / "none.so"))
    m.poll()
    st = m.status()
    screen = render_status({"now": 0, "training": {"state": "STOPPED"}, **st, "lines": {"gpus": render_lines(m)}})
    assert "gpus      none (cannot load the NVML library" in screen


def test_render_unknowns():
    g = GpuSample(3, None, None, None, None, None, mig=True)
    assert render_gpu(g) == "GPU3 unknown GPU  util   ?% (MIG)  mem ?/? GiB"
    lost = GpuSample(1, "NVIDIA A10G", "GPU-x", None, None, None, error="GPU is lost (fell off the bus?)")
    assert render_gpu(lost) == "GPU1 NVIDIA A10G  FAILED: GPU is lost (fell off the bus?)"


# --- the rolling window --------------------------------------------------------------------------

def run(m: GpuMonitor, fake_nvml, clock, utils: list[list[int]], step: float = 5.0, **g) -> None:
    """Poll once per entry, each giving every GPU's utilization, `step` seconds apart."""
    for u in utils:
        fake_nvml.write([gpu(util=x, **g) for x in u])
        m.poll()
        clock.advance(step)


def test_utilization_needs_half_the_window(fake_nvml, make, clock):
    m = make()
    run(m, fake_nvml, clock, [[80]] * 29)   # 145 s of samples
    assert m.utilization(300) is None       # a fresh daemon does not know the last 5 minutes
    run(m, fake_nvml, clock, [[80]] * 2)
    assert m.utilization(300) == pytest.approx(80)


def test_utilization_is_the_mean_over_the_window(fake_nvml, make, clock):
    m = make()
    run(m, fake_nvml, clock, [[100]] * 60 + [[0]] * 60)   # 5 min busy, then 5 min idle
    assert m.utilization(300) == pytest.approx(0)
    assert m.utilization(600) == pytest.approx(50, abs=1)
    run(m, fake_nvml, clock, [[60]])
    assert 0 < m.utilization(300) < 2  # one busy sample does not make 5 minutes busy


def test_utilization_is_the_busiest_gpu(fake_nvml, make, clock):
    m = make()
    run(m, fake_nvml, clock, [[0, 0, 0, 0, 0, 0, 0, 40]] * 70)
    assert m.utilization(300) == pytest.approx(40)


def test_utilization_unknown_when_not_supported(fake_nvml, make, clock):
    m = make()
    run(m, fake_nvml, clock, [[50]] * 70, util_rc=3)
    assert m.utilization(300) is None
    run(m, fake_nvml, clock, [[50]] * 70, mig=1)
    assert m.utilization(300) is None


def test_stalled_polls_do_not_count_as_coverage(fake_nvml, make, clock):
    """Two samples 4 minutes apart do not vouch for the 4 minutes between them."""
    m = make()
    run(m, fake_nvml, clock, [[0]] * 2, step=240)
    assert m.utilization(300) is None


def test_window_is_bounded(fake_nvml, make, clock):
    m = make({"window": "10m"})
    run(m, fake_nvml, clock, [[1]] * 1000)
    assert len(m._window) <= 600 / 5 + 3


def test_peak_memory(fake_nvml, make):
    m = make()
    for used in (10, 70, 30):
        fake_nvml.write([gpu(used=used * GIB), gpu(used=5 * GIB)])
        m.poll()
    assert m.peak_mem_bytes() == 70 * GIB
    m.reset_peak()
    assert m.peak_mem_bytes() is None


# --- alerts ---------------------------------------------------------------------------------------

def test_memory_limit_alert_after_n_samples_then_resolved(fake_nvml, make, clock):
    m = make({"mem_limit_fraction": 0.95, "mem_limit_samples": 3})
    full, ok = int(0.97 * 80 * GIB), 40 * GIB

    def poll(used: int) -> None:
        fake_nvml.write([gpu(total=80 * GIB, used=ok), gpu(total=80 * GIB, used=used)])
        m.poll()
        clock.advance(5)

    poll(full)
    poll(full)
    assert "gpu:mem_limit" not in keys(m)        # two samples are a blip
    poll(ok)
    poll(full)
    poll(full)
    assert "gpu:mem_limit" not in keys(m)        # not three in a row
    poll(full)
    assert "gpu:mem_limit" in keys(m)
    (a,) = [a for a in m.ctx.alerts.active() if a["key"] == "gpu:mem_limit"]
    assert "GPU1 77.6/80.0 GiB" in a["subject"] and a["severity"] == "warning"
    body = events(m, "gpu:mem_limit")[0]["body"]
    assert "batch" in body and "gradient checkpointing" in body and "8-bit" in body
    poll(int(0.94 * 80 * GIB))                   # below the limit but within the margin: holds
    poll(ok)
    poll(ok)
    assert "gpu:mem_limit" in keys(m)
    poll(ok)
    assert "gpu:mem_limit" not in keys(m)


def test_gpu_lost_raises_critical_alert_and_xid_event(fake_nvml, make, clock):
    m = make()
    fake_nvml.write([gpu(util=90), gpu(util=90)])
    m.poll()
    assert keys(m) == set()
    fake_nvml.write([gpu(util=90), gpu(lost=1, xid=79, xid_seq=1)])
    m.poll()
    (a,) = m.ctx.alerts.active()
    assert a["key"] == "gpu:failed" and a["severity"] == "critical"
    assert "GPU1" in a["subject"] and "lost" in a["subject"]
    xid = events(m, "gpu:xid:")
    assert len(xid) == 1 and "Xid 79" in xid[0]["subject"] and "fallen off the bus" in xid[0]["subject"]
    assert xid[0]["severity"] == "critical"
    m.poll()
    assert len(events(m, "gpu:xid:")) == 1
    st = m.status()
    assert st["gpus"][1]["error"] and st["gpus"][0]["util_pct"] == 90.0
    assert render_lines(m)[1].startswith("GPU1 NVIDIA H100 80GB HBM3  FAILED: GPU is lost")


def test_application_xid_is_a_warning(fake_nvml, make):
    m = make()
    fake_nvml.write([gpu(xid=31, xid_seq=1)])
    m.poll()
    (r,) = events(m, "gpu:xid:")
    assert r["severity"] == "warning" and "program" in r["body"]


def test_nvml_stops_answering_after_gpus_were_seen(fake_nvml, make, clock):
    m = make()
    fake_nvml.write(2)
    m.poll()

    class Broken:
        def sample(self):
            raise RuntimeError("driver crashed")

        def close(self):
            pass

    real = m.probe
    m.probe = Broken()
    m.poll()  # must not raise
    assert "gpu:failed" in keys(m)
    assert "driver crashed" in m.status()["gpu_error"]
    m.probe = real
    m.poll()
    assert "gpu:failed" not in keys(m)


def test_training_pids_read_rarely(fake_nvml, make, clock):
    me = os.getpid()
    t = Training({me})
    m = make(training=t)
    fake_nvml.write([gpu(procs=[(me, GIB)])])
    for _ in range(20):  # 20 polls over 20 s
        m.poll()
        clock.advance(1)
    assert t.calls == 1
    fake_nvml.write([gpu(procs=[(me, GIB), (me + 7, GIB)])])  # a process we do not know
    m.poll()
    assert t.calls == 2
    for _ in range(4):
        m.poll()
        clock.advance(1)
    assert t.calls == 2  # still a stranger, but asked again only after a few seconds


def test_unmatched_pids_are_other(fake_nvml, make):
    """In a container NVML's host PIDs match nothing of ours: shown as other, never as training."""
    fake_nvml.write([gpu(procs=[(4000001, GIB)])])
    m = make(training=Training({os.getpid()}))
    m.poll()
    assert m.status()["gpus"][0]["processes"][0]["training"] is False


def test_direct_probe_injection(fake_nvml, tmp_path, clock):
    fake_nvml.write(3)
    ctx = make_ctx(tmp_path, clock)
    m = GpuMonitor(ctx, ctx.config.gpu, probe=NvmlProbe(fake_nvml.lib_path))
    m.poll()
    assert len(m.status()["gpus"]) == 3
    m.close()


def test_crowded_gpu_line_is_summarised():
    from supervisor.gpu.nvml import GpuProcess

    g = GpuSample(0, "NVIDIA L4", "u", 50.0, 10 * GIB, 24 * GIB,
                  tuple(GpuProcess(100 + i, i * GIB) for i in range(6)))
    line = render_gpu(g, {100: True})
    assert line == ("GPU0 NVIDIA L4  util  50%  mem 10.0/24.0 GiB  train pid 100 0.0 GiB  "
                    "other pid 105 5.0 GiB  other pid 104 4.0 GiB  +3 more")
