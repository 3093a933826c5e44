"""The NVML probe: the only module that imports pynvml.

Every NVML call goes through `_query`, which turns any NVMLError into an explicit `Unknown` carrying
the reason (nvitop's pattern), so a field a GPU does not support, a lost GPU or a missing entry point
never reaches the caller as an exception. Newer entry points fall back to older ones (memory info
v2 -> v1, compute processes v3 -> v2 -> v1) and the choice is remembered, so a poll on an old
driver does not retry the missing symbol every time.

NVML is initialised once. If that fails (no driver, no library, driver not loaded yet at boot) the
probe says why in `.error` and tries again every RETRY_INIT_S seconds.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pynvml
import structlog

from supervisor.gpu.health import GpuHealth, HealthFacts

log = structlog.get_logger("nvml")

RETRY_INIT_S = 60.0
MAX_EVENTS_PER_SAMPLE = 16

# A device error that means the GPU itself is gone, as opposed to a field it cannot report.
_DEVICE_FATAL = {
    pynvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost (fell off the bus?)",
    pynvml.NVML_ERROR_RESET_REQUIRED: "GPU requires a reset",
}


class Unknown:
    """A value NVML could not give: falsy, with the reason and the NVML error code."""

    __slots__ = ("code", "reason")

    def __init__(self, code: int, reason: str):
        self.code = code
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Unknown({self.reason!r})"


def _query(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except pynvml.NVMLError as e:
        code = getattr(e, "value", pynvml.NVML_ERROR_UNKNOWN)
        try:
            reason = str(e)
        except Exception:  # noqa: BLE001 - str() of an NVMLError calls into the library again
            reason = f"NVML error {code}"
        return Unknown(code, reason)


class GpuProcess(NamedTuple):
    pid: int
    mem_bytes: int | None


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str | None
    uuid: str | None
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    processes: tuple[GpuProcess, ...] = ()
    mem_util_pct: float | None = None
    mig: bool | None = None
    error: str | None = None     # the GPU itself failed (lost, needs reset); values are unknown


@dataclass(frozen=True)
class XidEvent:
    index: int | None
    uuid: str | None
    xid: int


@dataclass(frozen=True)
class GpuSnapshot:
    gpus: tuple[GpuSample, ...] = ()
    error: str | None = None     # NVML as a whole is unavailable (no driver, no library)
    events: tuple[XidEvent, ...] = ()
    driver_version: str | None = None


def describe_init_error(e: BaseException, library_path: str = "") -> str:
    code = getattr(e, "value", None)
    if isinstance(e, OSError):
        return f"cannot load the NVML library {library_path}: {e}"
    if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        where = library_path or "libnvidia-ml.so.1"
        return f"NVML library {where} not found (no NVIDIA driver on this machine?)"
    if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVIDIA driver not loaded (nvidia kernel module missing or not yet up)"
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return "no permission to use NVML (/dev/nvidia* not accessible)"
    if code == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return "NVML library and kernel driver versions differ (driver upgraded without a reboot?)"
    if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
        return "the NVML library lacks an entry point this probe needs (very old driver?)"
    try:
        return f"NVML initialisation failed: {e}"
    except Exception:  # noqa: BLE001
        return f"NVML initialisation failed (error {code})"


class _ProcessInfoV1(ctypes.Structure):
    # nvmlProcessInfo_v1_t; the binding no longer wraps the unversioned call (drivers < R470)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _processes_v1(handle: Any) -> list[GpuProcess]:
    # the unversioned entry point, straight from the library pynvml loaded (its public `nvmlLib`)
    fn = getattr(pynvml.nvmlLib, "nvmlDeviceGetComputeRunningProcesses", None)
    if fn is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == pynvml.NVML_SUCCESS:
        return []
    if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(ret)
    count.value = count.value * 2 + 5
    arr = (_ProcessInfoV1 * count.value)()
    ret = fn(handle, ctypes.byref(count), arr)
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)
    return [GpuProcess(int(p.pid), _mem(p.usedGpuMemory)) for p in arr[: count.value]]


def _mem(v: Any) -> int | None:
    if v is None or v == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        return None
    return int(v)


@dataclass
class _Device:
    index: int
    handle: Any
    addr: int | None
    name: str | None = None
    uuid: str | None = None
    mig: bool | None = None
    error: str | None = None      # handle could not be obtained
    nvlink: bool = True           # False once no link answered: a GPU without NVLink is not asked again


@dataclass
class _State:
    devices: list[_Device] = field(default_factory=list)
    event_set: Any = None
    driver: str | None = None


class NvmlProbe:
    """`sample()` returns a GpuSnapshot and never raises. Not meant to be shared by threads;
    GpuMonitor calls it from one duty. `library_path` loads that file instead of the system's
    libnvidia-ml.so.1 (the config key gpu.nvml_library; tests point it at a fake)."""

    def __init__(self, library_path: str = "", monotonic: Callable[[], float] = time.monotonic,
                 retry_init_s: float = RETRY_INIT_S):
        self.library_path = library_path
        self._monotonic = monotonic
        self._retry_s = retry_init_s
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._state: _State | None = None
        self._error: str | None = "NVML not initialised yet"
        self._next_try = float("-inf")
        self._mem_v2 = True
        self._procs_fn: str = "v3"
        self._clk_fn = "event"      # nvmlDeviceGetCurrentClocksEventReasons, else the older Throttle name
        self._temp_v = True         # nvmlDeviceGetTemperatureV, else the deprecated nvmlDeviceGetTemperature

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def initialized(self) -> bool:
        return self._state is not None

    # --- init / shutdown ----------------------------------------------------------------------
    def _install_lib(self) -> None:
        """Put our library into the binding's global slot (pynvml loads one library per process);
        its cache of function pointers belongs to the old library and is dropped with it."""
        if not self.library_path:
            return
        if self._lib is None:
            self._lib = ctypes.CDLL(self.library_path)
        if pynvml.nvmlLib is not self._lib:
            with pynvml.libLoadLock:
                pynvml.nvmlLib = self._lib
                pynvml._nvmlGetFunctionPointer_cache.clear()

    def _init(self) -> bool:
        now = self._monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + self._retry_s
        try:
            self._install_lib()
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as e:
            msg = describe_init_error(e, self.library_path)
            if msg != self._error:
                log.info("nvml_unavailable", reason=msg)
            self._error = msg
            return False
        st = _State()
        drv = _query(pynvml.nvmlSystemGetDriverVersion)
        st.driver = drv if isinstance(drv, str) else None
        count = _query(pynvml.nvmlDeviceGetCount)
        if isinstance(count, Unknown):
            self._error = f"NVML cannot count the GPUs: {count.reason}"
            _query(pynvml.nvmlShutdown)
            return False
        for i in range(int(count)):
            h = _query(pynvml.nvmlDeviceGetHandleByIndex, i)
            if isinstance(h, Unknown):
                st.devices.append(_Device(i, None, None, error=_DEVICE_FATAL.get(h.code, h.reason)))
                continue
            d = _Device(i, h, ctypes.cast(h, ctypes.c_void_p).value)
            self._static_info(d)
            st.devices.append(d)
        st.event_set = self._register_events(st.devices)
        self._state = st
        self._error = None if st.devices else "NVML reports no GPUs"
        log.info("nvml_ready", gpus=len(st.devices), driver=st.driver,
                 xid_events=st.event_set is not None)
        return True

    @staticmethod
    def _static_info(d: _Device) -> None:
        if d.name is None:
            v = _query(pynvml.nvmlDeviceGetName, d.handle)
            d.name = v if isinstance(v, str) else None
        if d.uuid is None:
            v = _query(pynvml.nvmlDeviceGetUUID, d.handle)
            d.uuid = v if isinstance(v, str) else None
        if d.mig is None:
            v = _query(pynvml.nvmlDeviceGetMigMode, d.handle)
            if not isinstance(v, Unknown):
                d.mig = bool(v[0])
            elif v.code == pynvml.NVML_ERROR_NOT_SUPPORTED:
                d.mig = False

    @staticmethod
    def _register_events(devices: list[_Device]) -> Any:
        es = _query(pynvml.nvmlEventSetCreate)
        if isinstance(es, Unknown):
            return None
        registered = 0
        for d in devices:
            if d.handle is None:
                continue
            sup = _query(pynvml.nvmlDeviceGetSupportedEventTypes, d.handle)
            if isinstance(sup, Unknown) or not sup & pynvml.nvmlEventTypeXidCriticalError:
                continue
            r = _query(pynvml.nvmlDeviceRegisterEvents, d.handle, pynvml.nvmlEventTypeXidCriticalError, es)
            if not isinstance(r, Unknown):
                registered += 1
        if not registered:
            _query(pynvml.nvmlEventSetFree, es)
            return None
        return es

    def close(self) -> None:
        with self._lock:
            st, self._state = self._state, None
            if st is None:
                return
            if self.library_path:
                self._install_lib()
            if st.event_set is not None:
                _query(pynvml.nvmlEventSetFree, st.event_set)
            _query(pynvml.nvmlShutdown)
            self._error = "NVML closed"

    # --- sampling -----------------------------------------------------------------------------
    def sample(self) -> GpuSnapshot:
        with self._lock:
            try:
                if self._state is None and not self._init():
                    return GpuSnapshot(error=self._error)
                if self.library_path and pynvml.nvmlLib is not self._lib:
                    self._install_lib()
                st = self._state
                assert st is not None
                gpus = tuple(self._sample_device(d) for d in st.devices)
                events = self._drain_events(st)
                return GpuSnapshot(gpus=gpus, error=self._error, events=events, driver_version=st.driver)
            except Exception as e:  # noqa: BLE001 - a probe bug must read as "unknown", not kill the poll
                log.exception("nvml_sample_failed")
                return GpuSnapshot(error=f"NVML probe failed: {type(e).__name__}: {e}")

    def _sample_device(self, d: _Device) -> GpuSample:
        if d.handle is None:
            return GpuSample(d.index, d.name, d.uuid, None, None, None, error=d.error)
        if d.name is None or d.uuid is None or d.mig is None:
            self._static_info(d)
        fatal: str | None = None
        unknown_errors = 0

        def check(v: Any) -> Any:
            nonlocal fatal, unknown_errors
            if isinstance(v, Unknown):
                if v.code in _DEVICE_FATAL and fatal is None:
                    fatal = _DEVICE_FATAL[v.code]
                unknown_errors += v.code == pynvml.NVML_ERROR_UNKNOWN
                return None
            return v

        u = check(_query(pynvml.nvmlDeviceGetUtilizationRates, d.handle))
        util = float(u.gpu) if u is not None else None
        mem_util = float(u.memory) if u is not None else None
        mem = check(self._memory(d.handle))
        used = int(mem.used) if mem is not None else None
        total = int(mem.total) if mem is not None else None
        procs = check(self._processes(d.handle))
        if fatal is None and unknown_errors == 3:
            fatal = "GPU answers every query with an unknown error"
        if fatal:
            return GpuSample(d.index, d.name, d.uuid, None, None, None, mig=d.mig, error=fatal)
        return GpuSample(d.index, d.name, d.uuid, util, used, total, tuple(procs or ()),
                         mem_util_pct=mem_util, mig=d.mig)

    def _memory(self, handle: Any) -> Any:
        # v1 counts driver-reserved memory as used; v2 does not. Prefer v2 while the driver has it.
        if self._mem_v2:
            v = _query(pynvml.nvmlDeviceGetMemoryInfo, handle, version=pynvml.nvmlMemory_v2)
            if not isinstance(v, Unknown):
                return v
            if v.code == pynvml.NVML_ERROR_NOT_SUPPORTED:
                return _query(pynvml.nvmlDeviceGetMemoryInfo, handle)  # this GPU only (vGPU...)
            if v.code not in (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                              pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                return v
            log.info("nvml_fallback", call="nvmlDeviceGetMemoryInfo", to="v1", reason=v.reason)
            self._mem_v2 = False
        return _query(pynvml.nvmlDeviceGetMemoryInfo, handle)

    def _processes(self, handle: Any) -> Any:
        order = ("v3", "v2", "v1")
        for name in order[order.index(self._procs_fn):]:
            if name == "v3":
                v = _query(pynvml.nvmlDeviceGetComputeRunningProcesses_v3, handle)
            elif name == "v2":
                v = _query(pynvml.nvmlDeviceGetComputeRunningProcesses_v2, handle)
            else:
                return _query(_processes_v1, handle)
            if isinstance(v, Unknown):
                if v.code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    self._procs_fn = order[order.index(name) + 1]
                    log.info("nvml_fallback", call="nvmlDeviceGetComputeRunningProcesses", to=self._procs_fn)
                    continue
                return v
            return [GpuProcess(int(p.pid), _mem(p.usedGpuMemory)) for p in v]
        return Unknown(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "no process-list entry point")

    # --- health (supervisor.gpu.health judges what this reads) --------------------------------------
    def health(self) -> HealthFacts:
        """Every health field of every GPU, each through `_query`: a field this GPU or driver does
        not give reads None (unknown), a lost GPU reads as its error. Never raises."""
        with self._lock:
            try:
                if self._state is None and not self._init():
                    return HealthFacts(error=self._error)
                if self.library_path and pynvml.nvmlLib is not self._lib:
                    self._install_lib()
                st = self._state
                assert st is not None
                cuda = _known(_query(pynvml.nvmlSystemGetCudaDriverVersion))
                cuda_s = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) and cuda > 0 else None
                return HealthFacts(tuple(self._device_health(d) for d in st.devices), len(st.devices), None,
                                   st.driver, cuda_s)
            except Exception as e:  # noqa: BLE001 - a probe bug reads as "unknown"
                log.exception("nvml_health_failed")
                return HealthFacts(error=f"NVML probe failed: {type(e).__name__}: {e}")

    def _device_health(self, d: _Device) -> GpuHealth:
        if d.handle is None:
            return GpuHealth(d.index, d.name, d.uuid, error=d.error or "no handle")
        h = d.handle
        fatal: list[str] = []

        def check(v: Any) -> Any:
            if isinstance(v, Unknown):
                if v.code in _DEVICE_FATAL:
                    fatal.append(_DEVICE_FATAL[v.code])
                return None
            return v

        def q(fn: Callable[..., Any], *args: Any) -> Any:
            return check(_query(fn, h, *args))

        ecc = q(pynvml.nvmlDeviceGetEccMode)
        unc = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        rows = q(pynvml.nvmlDeviceGetRemappedRows)  # (corrected, uncorrected, pending, failed)
        power = q(pynvml.nvmlDeviceGetPowerUsage)
        util = q(pynvml.nvmlDeviceGetUtilizationRates)
        up, down = self._nvlinks(h, fatal) if d.nvlink else (None, None)
        d.nvlink = d.nvlink and (up is not None or bool(fatal))
        g = GpuHealth(
            d.index, d.name, d.uuid,
            ecc_mode=bool(ecc[0]) if ecc is not None else None,
            ecc_uncorrected_volatile=_int(q(pynvml.nvmlDeviceGetTotalEccErrors, unc, pynvml.NVML_VOLATILE_ECC)),
            ecc_uncorrected_aggregate=_int(q(pynvml.nvmlDeviceGetTotalEccErrors, unc, pynvml.NVML_AGGREGATE_ECC)),
            retired_pending=_bool(q(pynvml.nvmlDeviceGetRetiredPagesPendingStatus)),
            remap_pending=bool(rows[2]) if rows is not None else None,
            remap_failed=bool(rows[3]) if rows is not None else None,
            pcie_gen=_int(q(pynvml.nvmlDeviceGetCurrPcieLinkGeneration)),
            pcie_gen_max=_int(q(pynvml.nvmlDeviceGetMaxPcieLinkGeneration)),
            pcie_width=_int(q(pynvml.nvmlDeviceGetCurrPcieLinkWidth)),
            pcie_width_max=_int(q(pynvml.nvmlDeviceGetMaxPcieLinkWidth)),
            throttle=_int(check(self._clock_reasons(h))),
            temp_c=_int(check(self._temperature(h))),
            power_w=power / 1000.0 if isinstance(power, int) else None,
            persistence=_bool(q(pynvml.nvmlDeviceGetPersistenceMode)),
            nvlink_up=up, nvlink_down=down,
            util_pct=float(util.gpu) if util is not None else None,
        )
        if fatal:
            return GpuHealth(d.index, d.name, d.uuid, error=fatal[0])
        return g

    def _clock_reasons(self, h: Any) -> Any:
        """ClocksEventReasons (drivers >= 535), else the older ClocksThrottleReasons; remembered."""
        if self._clk_fn == "event":
            v = _query(pynvml.nvmlDeviceGetCurrentClocksEventReasons, h)
            if not (isinstance(v, Unknown) and v.code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return v
            log.info("nvml_fallback", call="nvmlDeviceGetCurrentClocksEventReasons", to="ClocksThrottleReasons")
            self._clk_fn = "throttle"
        return _query(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)

    def _temperature(self, h: Any) -> Any:
        """TemperatureV (the deprecated nvmlDeviceGetTemperature goes with CUDA 14), else the old call."""
        if self._temp_v:
            v = _query(pynvml.nvmlDeviceGetTemperatureV, h, pynvml.NVML_TEMPERATURE_GPU)
            if not (isinstance(v, Unknown) and v.code in (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                                                          pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)):
                return v
            log.info("nvml_fallback", call="nvmlDeviceGetTemperatureV", to="nvmlDeviceGetTemperature")
            self._temp_v = False
        return _query(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)

    @staticmethod
    def _nvlinks(handle: Any, fatal: list[str]) -> tuple[int | None, int | None]:
        """Links that answer, active and inactive; (None, None) when no link answers (no NVLink)."""
        up = down = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            v = _query(pynvml.nvmlDeviceGetNvLinkState, handle, link)
            if isinstance(v, Unknown):
                if v.code in _DEVICE_FATAL:
                    fatal.append(_DEVICE_FATAL[v.code])
                    break
                if v.code == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                    break  # past the device's last link
                continue
            if v:
                up += 1
            else:
                down += 1
        return (up, down) if up or down else (None, None)

    def _drain_events(self, st: _State) -> tuple[XidEvent, ...]:
        if st.event_set is None:
            return ()
        out: list[XidEvent] = []
        by_addr = {d.addr: d for d in st.devices if d.addr is not None}
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            ev = _query(pynvml.nvmlEventSetWait, st.event_set, 0)
            if isinstance(ev, Unknown):
                break  # Timeout: nothing pending (or the set itself failed; it is retried next poll)
            if not ev.eventType & pynvml.nvmlEventTypeXidCriticalError:
                continue
            d = by_addr.get(ctypes.cast(ev.device, ctypes.c_void_p).value)
            out.append(XidEvent(d.index if d else None, d.uuid if d else None, int(ev.eventData)))
        if out:
            log.warning("nvml_xid", events=[(e.index, e.xid) for e in out])
        return tuple(out)


def _known(v: Any) -> Any:
    return None if isinstance(v, Unknown) else v


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _bool(v: Any) -> bool | None:
    return bool(v) if isinstance(v, int) else None
