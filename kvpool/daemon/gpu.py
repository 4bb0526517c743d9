"""VRAM measurement through nvidia-ml-py (module pynvml), when a GPU and its driver are present."""

from __future__ import annotations

import contextlib


class VramMeter:
    """Per-process VRAM use, summed over every device NVML sees. Without a GPU (no library, no driver, no
    device) `available` is False and every reading is None; a reading NVML refuses (a driver without the
    call, a GPU fallen off the bus) is None too: the meter never raises. NVML stays initialised from a
    successful nvmlInit while there is a device to read, until close() (idempotent)."""

    def __init__(self) -> None:
        self._pynvml = None
        self._handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no library or no driver: VRAM is simply not measured
            return
        self._pynvml = pynvml  # initialised: from here on close() owes NVML its shutdown
        try:
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError:
            self._handles = []
        if not self._handles:  # no device NVML can open: nothing to measure, nothing to hold
            self.close()

    @property
    def available(self) -> bool:
        return self._pynvml is not None and bool(self._handles)

    def used_by(self, pids: set[int]) -> int | None:
        """The bytes of VRAM the processes `pids` use; None when not measured."""
        if not self.available:
            return None
        total = 0
        try:
            for handle in self._handles:
                for process in self._pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if process.pid in pids and process.usedGpuMemory:  # None: NVML cannot tell (WDDM)
                        total += process.usedGpuMemory
        except self._pynvml.NVMLError:
            return None
        return total

    def close(self) -> None:
        pynvml, self._pynvml, self._handles = self._pynvml, None, []
        if pynvml is not None:
            with contextlib.suppress(pynvml.NVMLError):  # the driver went first: nothing left to shut down
                pynvml.nvmlShutdown()
