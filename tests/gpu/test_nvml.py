"""The NVML probe against the real pynvml binding and a fake libnvidia-ml.so.1 compiled by the tests."""

from __future__ import annotations

import pynvml
import pytest

from supervisor.gpu.nvml import GpuProcess, NvmlProbe, Unknown, describe_init_error
from tests.fixtures.nvml import GIB, H100_TOTAL, gpu


class Mono:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def probe(fake_nvml):
    p = NvmlProbe(fake_nvml.lib_path)
    yield p
    p.close()


def test_zero_gpus(fake_nvml, probe):
    fake_nvml.write(0)
    s = probe.sample()
    assert s.gpus == ()
    assert s.error == "NVML reports no GPUs"
    assert s.driver_version == "550.54.15"


def test_one_gpu_every_field(fake_nvml, probe):
    fake_nvml.write([gpu(name="NVIDIA A100-SXM4-80GB", uuid="GPU-1234", util=97, mem_util=41,
                         total=80 * GIB, used=70 * GIB, reserved=512 * 1024**2,
                         procs=[(4242, 69 * GIB), (4343, None)])], driver="535.104.05")
    s = probe.sample()
    assert s.error is None and s.driver_version == "535.104.05"
    (g,) = s.gpus
    assert (g.index, g.name, g.uuid) == (0, "NVIDIA A100-SXM4-80GB", "GPU-1234")
    assert g.util_pct == 97.0 and g.mem_util_pct == 41.0
    # v2 memory: "used" without the driver-reserved part (v1 would add it)
    assert g.mem_used_bytes == 70 * GIB and g.mem_total_bytes == 80 * GIB
    assert g.processes == (GpuProcess(4242, 69 * GIB), GpuProcess(4343, None))
    assert g.mig is False and g.error is None


def test_eight_gpus(fake_nvml, probe):
    fake_nvml.write([gpu(util=10 * i, used=i * GIB, procs=[(1000 + i, i * GIB)]) for i in range(8)])
    s = probe.sample()
    assert [g.index for g in s.gpus] == list(range(8))
    assert [g.util_pct for g in s.gpus] == [10.0 * i for i in range(8)]
    assert [g.processes[0].pid for g in s.gpus] == [1000 + i for i in range(8)]
    assert len({g.uuid for g in s.gpus}) == 8
    assert all(g.mem_total_bytes == H100_TOTAL for g in s.gpus)


def test_init_once_not_per_poll(fake_nvml, probe):
    fake_nvml.write(2)
    for _ in range(5):
        probe.sample()
    assert fake_nvml.count("nvmlInitWithFlags") == 1
    assert fake_nvml.count("nvmlDeviceGetName") == 2       # static facts read once
    assert fake_nvml.count("nvmlDeviceGetUtilizationRates") == 10
    probe.close()
    assert fake_nvml.count("nvmlShutdown") == 1
    assert fake_nvml.initialized() == 0


def test_values_change_between_polls(fake_nvml, probe):
    fake_nvml.write([gpu(util=5)])
    assert probe.sample().gpus[0].util_pct == 5.0
    fake_nvml.write([gpu(util=88, procs=[(7, GIB)])])
    g = probe.sample().gpus[0]
    assert g.util_pct == 88.0 and g.processes == (GpuProcess(7, GIB),)


def test_utilization_not_supported_is_unknown(fake_nvml, probe):
    fake_nvml.write([gpu(util_rc=pynvml.NVML_ERROR_NOT_SUPPORTED, used=GIB)])
    g = probe.sample().gpus[0]
    assert g.util_pct is None and g.error is None
    assert g.mem_used_bytes == GIB  # the rest of the GPU still reads


def test_every_field_not_supported(fake_nvml, probe):
    ns = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake_nvml.write([gpu(util_rc=ns, mem_rc=ns, procs_rc=ns, name_rc=ns, uuid_rc=ns, mig_rc=ns, events_rc=ns)])
    g = probe.sample().gpus[0]
    assert (g.name, g.uuid, g.util_pct, g.mem_used_bytes, g.mem_total_bytes, g.processes) == \
        (None, None, None, None, None, ())
    assert g.error is None and g.mig is False  # MIG NotSupported = a GPU without MIG


def test_no_permission_on_processes(fake_nvml, probe):
    fake_nvml.write([gpu(util=50, procs_rc=pynvml.NVML_ERROR_NO_PERMISSION)])
    g = probe.sample().gpus[0]
    assert g.util_pct == 50.0 and g.processes == () and g.error is None


def test_mig_gpu(fake_nvml, probe):
    fake_nvml.write([gpu(mig=1, used=10 * GIB, procs=[(55, 9 * GIB)]), gpu(util=30)])
    a, b = probe.sample().gpus
    assert a.mig is True and a.util_pct is None and a.mem_used_bytes == 10 * GIB and a.error is None
    assert a.processes == (GpuProcess(55, 9 * GIB),)
    assert b.mig is False and b.util_pct == 30.0


def test_gpu_lost_mid_run(fake_nvml, probe):
    fake_nvml.write([gpu(util=90, used=GIB), gpu(util=80)])
    assert probe.sample().gpus[1].util_pct == 80.0
    fake_nvml.write([gpu(util=90, used=GIB), gpu(util=80, lost=1, xid=79, xid_seq=1)])
    s = probe.sample()
    ok, lost = s.gpus
    assert ok.util_pct == 90.0 and ok.error is None
    assert lost.error and "lost" in lost.error
    assert (lost.util_pct, lost.mem_used_bytes, lost.processes) == (None, None, ())
    assert lost.name == "NVIDIA H100 80GB HBM3"  # what we knew of it stays for the report
    assert [(e.index, e.xid) for e in s.events] == [(1, 79)]
    assert probe.sample().events == ()  # one event, reported once


def test_gpu_lost_before_init_handle_fails(fake_nvml, probe):
    fake_nvml.write([gpu(util=1), gpu(handle_rc=pynvml.NVML_ERROR_GPU_IS_LOST)])
    a, b = probe.sample().gpus
    assert a.error is None
    assert b.error and "lost" in b.error and b.util_pct is None


def test_xid_events(fake_nvml, probe):
    fake_nvml.write(2)
    assert probe.sample().events == ()
    fake_nvml.write([gpu(), gpu(xid=48, xid_seq=1)])
    assert [(e.index, e.xid, e.uuid) for e in probe.sample().events] == \
        [(1, 48, "GPU-fa4e0000-0000-0000-0000-000000000001")]
    assert probe.sample().events == ()
    fake_nvml.write([gpu(xid=13, xid_seq=1), gpu(xid=48, xid_seq=2)])
    assert sorted((e.index, e.xid) for e in probe.sample().events) == [(0, 13), (1, 48)]


def test_events_unsupported_still_samples(fake_nvml, probe):
    fake_nvml.write([gpu(events=0, util=3, xid=79, xid_seq=1)])
    s = probe.sample()
    assert s.gpus[0].util_pct == 3.0 and s.events == ()
    assert fake_nvml.count("nvmlEventSetWait_v2") == 0  # no set registered: nothing to wait on


def test_old_driver_falls_back_and_remembers(fake_nvml):
    """No nvmlDeviceGetMemoryInfo_v2, no process list v2/v3: v1 memory (which counts the reserved
    memory as used) and the unversioned process call, looked up once, not on every poll."""
    fake_nvml.write([gpu(used=GIB, reserved=GIB // 2, procs=[(9, 3 * GIB), (10, None)])])
    p = NvmlProbe(fake_nvml.old_lib_path)
    try:
        for _ in range(3):
            g = p.sample().gpus[0]
            assert g.mem_used_bytes == GIB + GIB // 2
            assert g.processes == (GpuProcess(9, 3 * GIB), GpuProcess(10, None))
        old = fake_nvml.old_lib_path
        assert fake_nvml.count("nvmlDeviceGetMemoryInfo", old) == 3
        assert fake_nvml.count("nvmlDeviceGetComputeRunningProcesses", old) == 6  # two calls per poll
    finally:
        p.close()


def test_memory_v2_version_mismatch_falls_back(fake_nvml, probe):
    fake_nvml.write([gpu(used=GIB, reserved=GIB, mem_v2_rc=pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)])
    assert probe.sample().gpus[0].mem_used_bytes == 2 * GIB
    probe.sample()
    assert fake_nvml.count("nvmlDeviceGetMemoryInfo_v2") == 1


def test_library_missing(tmp_path, fake_nvml):
    p = NvmlProbe(str(tmp_path / "nope" / "libnvidia-ml.so.1"))
    s = p.sample()
    assert s.gpus == () and "cannot load the NVML library" in s.error
    assert p.error == s.error
    p.close()


def test_system_library_missing():
    """Without a configured path the binding dlopens libnvidia-ml.so.1; this box has no driver. In a
    fresh process: once any library with that soname is loaded (our fake), dlopen finds it by name."""
    import ctypes.util
    import subprocess
    import sys

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a real libnvidia-ml")
    code = ("from supervisor.gpu.nvml import NvmlProbe; s = NvmlProbe('').sample(); "
            "print(len(s.gpus)); print(s.error)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    n, err = r.stdout.strip().splitlines()[-2:]
    assert n == "0" and "libnvidia-ml.so.1 not found" in err and "NVIDIA driver" in err


@pytest.mark.parametrize("rc,words", [
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver not loaded"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "versions differ"),
    (pynvml.NVML_ERROR_UNKNOWN, "initialisation failed"),
])
def test_init_errors_named(fake_nvml, rc, words):
    fake_nvml.write(1, init=rc)
    p = NvmlProbe(fake_nvml.lib_path)
    s = p.sample()
    assert s.gpus == () and words in s.error.lower()
    p.close()


def test_init_retried_later_when_driver_comes_up(fake_nvml):
    mono = Mono()
    fake_nvml.write(1, init=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    p = NvmlProbe(fake_nvml.lib_path, monotonic=mono, retry_init_s=60)
    assert "driver not loaded" in p.sample().error.lower()
    fake_nvml.write([gpu(util=12)])
    mono.t += 30
    assert p.sample().gpus == ()                      # not retried yet: init is not per poll
    assert fake_nvml.count("nvmlInitWithFlags") == 1
    mono.t += 31
    s = p.sample()
    assert s.error is None and s.gpus[0].util_pct == 12.0
    assert fake_nvml.count("nvmlInitWithFlags") == 2
    p.close()


def test_count_fails(fake_nvml):
    fake_nvml.write(1, count_rc=pynvml.NVML_ERROR_UNKNOWN)
    p = NvmlProbe(fake_nvml.lib_path)
    s = p.sample()
    assert s.gpus == () and "cannot count" in s.error
    assert fake_nvml.initialized() == 0  # shut down again, to be retried cleanly
    p.close()


def test_all_fields_unknown_error_marks_gpu_failed(fake_nvml, probe):
    u = pynvml.NVML_ERROR_UNKNOWN
    fake_nvml.write([gpu(util_rc=u, mem_rc=u, procs_rc=u)])
    assert probe.sample().gpus[0].error
    fake_nvml.write([gpu(util_rc=u, used=GIB)])  # one odd field is not a failed GPU
    g = probe.sample().gpus[0]
    assert g.error is None and g.mem_used_bytes == GIB


def test_two_probes_two_libraries(fake_nvml):
    """pynvml holds one library per process; each probe puts its own back before it samples."""
    fake_nvml.write([gpu(used=GIB, reserved=GIB)])
    a, b = NvmlProbe(fake_nvml.lib_path), NvmlProbe(fake_nvml.old_lib_path)
    try:
        assert a.sample().gpus[0].mem_used_bytes == GIB
        assert b.sample().gpus[0].mem_used_bytes == 2 * GIB
        assert a.sample().gpus[0].mem_used_bytes == GIB
    finally:
        a.close()
        b.close()


def test_unknown_is_falsy_with_reason():
    u = Unknown(3, "Not Supported")
    assert not u and "Not Supported" in repr(u)
    assert "not found" in describe_init_error(pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))


def test_memory_v2_not_supported_on_one_gpu_uses_v1_there(fake_nvml, probe):
    fake_nvml.write([gpu(used=GIB, reserved=GIB, mem_v2_rc=pynvml.NVML_ERROR_NOT_SUPPORTED),
                     gpu(used=GIB, reserved=GIB)])
    a, b = probe.sample().gpus
    assert a.mem_used_bytes == 2 * GIB and b.mem_used_bytes == GIB  # the other keeps v2
