"""kvpool.daemon.gpu.VramMeter against a fake NVML (module pynvml replaced), so that it runs where no GPU is:
without a library, a driver or a device it reports nothing and never raises; with devices it sums the VRAM
of the processes asked for over every device; a reading NVML refuses is None; NVML, once initialised, is
shut down exactly once, by close() or by a start that found no device."""

from __future__ import annotations

import os
import sys
import types

import pytest

from kvpool.daemon.gpu import VramMeter

pytestmark = pytest.mark.unit
GiB = 1024**3


class FakeNvmlError(Exception):
    """pynvml.NVMLError: every NVML failure (NVMLError_LibraryNotFound, _DriverNotLoaded, ...) is one."""


class FakeNvml(types.ModuleType):
    """The calls VramMeter makes, over `devices`: one list of (pid, usedGpuMemory) per device."""

    NVMLError = FakeNvmlError

    def __init__(self, devices: list[list[tuple[int, int | None]]], *, init_fails: bool = False, count_fails: bool = False) -> None:
        super().__init__("pynvml")
        self.devices = devices
        self.init_fails = init_fails
        self.count_fails = count_fails
        self.refused: set[int] = set()  # devices whose process list NVML refuses (an old driver, a lost GPU)
        self.driver_gone = False  # nvmlShutdown fails (the driver unloaded under the daemon)
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise FakeNvmlError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        if self.driver_gone or self.shutdowns >= self.inits:
            raise FakeNvmlError("Uninitialized")
        self.shutdowns += 1

    def _check_initialised(self) -> None:
        if self.shutdowns >= self.inits:
            raise FakeNvmlError("Uninitialized")

    def nvmlDeviceGetCount(self) -> int:
        self._check_initialised()
        if self.count_fails:
            raise FakeNvmlError("Driver Not Loaded")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check_initialised()
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[types.SimpleNamespace]:
        self._check_initialised()
        if handle in self.refused:
            raise FakeNvmlError("Function Not Found")
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.devices[handle]]


@pytest.fixture
def nvml(monkeypatch):
    """install(fake): the module `import pynvml` gives VramMeter (None: the import fails)."""

    def install(fake: FakeNvml | None) -> FakeNvml | None:
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


def _assert_reports_nothing(meter: VramMeter) -> None:
    assert not meter.available
    assert meter.used_by({os.getpid()}) is None and meter.used_by(set()) is None
    meter.close()
    meter.close()
    assert meter.used_by({os.getpid()}) is None


def test_without_the_library_the_meter_reports_nothing(nvml) -> None:
    nvml(None)  # nvidia-ml-py not installed: `import pynvml` raises ImportError
    _assert_reports_nothing(VramMeter())


def test_without_a_driver_the_meter_reports_nothing_and_never_shuts_down_what_it_never_initialised(nvml) -> None:
    fake = nvml(FakeNvml([[(1, GiB)]], init_fails=True))  # no GPU: nvmlInit raises NVMLError_LibraryNotFound
    _assert_reports_nothing(VramMeter())
    assert fake.inits == fake.shutdowns == 0


def test_a_start_that_finds_no_device_shuts_nvml_down_at_once(nvml) -> None:
    for fake in (FakeNvml([], count_fails=True), FakeNvml([])):  # the count refused; no device at all
        nvml(fake)
        meter = VramMeter()
        assert fake.inits == fake.shutdowns == 1  # nothing to read: NVML is not held until close()
        _assert_reports_nothing(meter)
        assert fake.shutdowns == 1  # initialised once, shut down once, however often close() ran


def test_readings_sum_the_processes_asked_for_over_every_device(nvml) -> None:
    fake = nvml(FakeNvml([
        [(101, 3 * GiB), (102, GiB), (999, 40 * GiB)],  # 999: a process of someone else
        [(101, 512 * 1024**2), (103, None)],  # None: NVML cannot tell this process's use (WDDM)
    ]))
    meter = VramMeter()
    assert meter.available and fake.inits == 1
    assert meter.used_by({101}) == 3 * GiB + 512 * 1024**2  # one worker on both devices
    assert meter.used_by({101, 102}) == 4 * GiB + 512 * 1024**2
    assert meter.used_by({103}) == 0  # on a device, its use unknown: counted as none, the sum still measured
    assert meter.used_by({104}) == 0 and meter.used_by(set()) == 0  # measured: no VRAM of theirs
    fake.devices[0].append((104, 2 * GiB))  # a worker that started since: read afresh each time
    assert meter.used_by({104}) == 2 * GiB
    meter.close()
    meter.close()
    assert fake.shutdowns == 1 and not meter.available and meter.used_by({101}) is None


def test_a_reading_nvml_refuses_is_none_and_the_next_one_measures_again(nvml) -> None:
    fake = nvml(FakeNvml([[(101, GiB)], [(101, GiB)]]))
    meter = VramMeter()
    fake.refused.add(1)  # e.g. NVMLError_FunctionNotFound on a driver without the v3 call, or a GPU lost
    assert meter.used_by({101}) is None  # not a partial sum, and no exception into the stats reply
    fake.refused.clear()
    assert meter.used_by({101}) == 2 * GiB
    meter.close()
    assert fake.shutdowns == 1


def test_the_real_module_here_never_raises() -> None:
    """Whatever this machine has (nvidia-ml-py is a dependency; a GPU usually not): a reading of this
    process is None without a device, else a byte count."""
    meter = VramMeter()
    try:
        reading = meter.used_by({os.getpid()})
        assert reading is None if not meter.available else reading >= 0
    finally:
        meter.close()
        meter.close()
    assert meter.used_by({os.getpid()}) is None


def test_close_never_raises_when_the_driver_went_first(nvml) -> None:
    fake = nvml(FakeNvml([[(101, GiB)]]))
    meter = VramMeter()
    assert meter.used_by({101}) == GiB
    fake.driver_gone = True
    meter.close()  # the daemon's teardown goes on
    meter.close()
    assert not meter.available and meter.used_by({101}) is None
