"""The health fields of the NVML probe, through the real pynvml and the fake libnvidia-ml: each
script key reaches its field through ctypes; an unset key is NotSupported and reads None (unknown);
an old driver's missing entry points fall back; a lost GPU reads as its error."""

from __future__ import annotations

import pytest

from supervisor.gpu.health import GpuHealth
from supervisor.gpu.nvml import NvmlProbe
from tests.fixtures.nvml import gpu

# script key -> (field, script value, value read)
KEYS = {
    "ecc_mode": ("ecc_mode", 1, True),
    "ecc_uncorrected_volatile": ("ecc_uncorrected_volatile", 2, 2),
    "ecc_uncorrected_aggregate": ("ecc_uncorrected_aggregate", 7, 7),
    "retired_pending": ("retired_pending", 1, True),
    "remap_pending": ("remap_pending", 1, True),
    "remap_failed": ("remap_failed", 1, True),
    "pcie_gen": ("pcie_gen", 4, 4),
    "pcie_gen_max": ("pcie_gen_max", 5, 5),
    "pcie_width": ("pcie_width", 4, 4),
    "pcie_width_max": ("pcie_width_max", 16, 16),
    "throttle": ("throttle", 0x48, 0x48),
    "temp": ("temp_c", 81, 81),
    "power_mw": ("power_w", 312500, 312.5),
    "persistence": ("persistence", 0, False),
    "nvlink_down": ("nvlink_down", 2, 2),
}


@pytest.fixture
def probe(fake_nvml):
    p = NvmlProbe(fake_nvml.lib_path)
    yield p
    p.close()


@pytest.mark.parametrize("key", sorted(KEYS))
def test_each_key_reaches_its_field_and_nothing_else(fake_nvml, probe, key):
    field, script, read = KEYS[key]
    fake_nvml.write([gpu(**{key: script})])
    (g,) = probe.health().gpus
    assert getattr(g, field) == read
    others = {f for f, _, _ in KEYS.values()} - {field}
    if key in ("remap_pending", "remap_failed"):
        others -= {"remap_pending", "remap_failed"}  # one call answers both
    assert all(getattr(g, f) is None for f in others), {f: getattr(g, f) for f in others}


def test_unset_keys_are_unknown_not_failures(fake_nvml, probe):
    fake_nvml.write([gpu(util=3)])
    h = probe.health()
    (g,) = h.gpus
    assert g == GpuHealth(0, g.name, g.uuid, util_pct=3.0)
    assert h.count == 1 and h.error is None and h.driver_version == "550.54.15" and h.cuda_version == "12.4"


def test_nvlink_counts_links_up_and_down(fake_nvml, probe):
    fake_nvml.write([gpu(nvlink_down=0), gpu(nvlink_down=18), gpu()])
    a, b, c = probe.health().gpus
    assert (a.nvlink_up, a.nvlink_down) == (18, 0)
    assert (b.nvlink_up, b.nvlink_down) == (0, 18)
    assert (c.nvlink_up, c.nvlink_down) == (None, None)


def test_old_driver_falls_back_to_the_throttle_and_plain_temperature_calls(fake_nvml):
    fake_nvml.write([gpu(throttle=0x8, temp=50)], cuda=11080)
    p = NvmlProbe(fake_nvml.old_lib_path)
    try:
        for _ in range(2):
            h = p.health()
            assert h.gpus[0].throttle == 0x8 and h.gpus[0].temp_c == 50 and h.cuda_version == "11.8"
        # the fallback is remembered: the missing symbol is not asked for again
        assert fake_nvml.count("nvmlDeviceGetCurrentClocksThrottleReasons", fake_nvml.old_lib_path) == 2
    finally:
        p.close()
    assert p._clk_fn == "throttle" and p._temp_v is False


def test_current_driver_uses_clock_event_reasons(fake_nvml, probe):
    fake_nvml.write([gpu(throttle=0x40)])
    assert probe.health().gpus[0].throttle == 0x40
    assert fake_nvml.count("nvmlDeviceGetCurrentClocksEventReasons") == 1
    assert fake_nvml.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 0


def test_lost_gpu_reads_as_its_error(fake_nvml, probe):
    fake_nvml.write([gpu(ecc_mode=1), gpu(ecc_mode=1, lost=1)])
    a, b = probe.health().gpus
    assert a.error is None and a.ecc_mode is True
    assert b.error == "GPU is lost (fell off the bus?)" and b.ecc_mode is None


def test_no_driver(fake_nvml, probe):
    fake_nvml.write(1, init=9)
    h = probe.health()
    assert h.count is None and h.gpus == () and "driver not loaded" in h.error


def test_a_gpu_without_nvlink_is_not_asked_again(fake_nvml, probe):
    fake_nvml.write([gpu(), gpu(nvlink_down=1)])
    probe.health()
    first = fake_nvml.count("nvmlDeviceGetNvLinkState")
    assert first == 2 * 36  # every link index of both GPUs, once
    h = probe.health()
    assert fake_nvml.count("nvmlDeviceGetNvLinkState") - first == 36  # only the GPU that has NVLink
    assert (h.gpus[0].nvlink_down, h.gpus[1].nvlink_down) == (None, 1)
