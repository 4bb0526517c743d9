"""VRAM measurement through nvidia-ml-py (module pynvml), when a GPU and its driver are present."""

from __future__ import annotations


class VramMeter:
    """Per-process VRAM use; `available` is False without a GPU, and every reading is then None."""

    def __init__(self) -> None:
        self._pynvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._pynvml = pynvml
        except Exception:  # noqa: BLE001 - no driver, no device, or no library: VRAM is simply not measured
            self._handles = []

    @property
    def available(self) -> bool:
        return self._pynvml is not None and bool(self._handles)

    def used_by(self, pids: set[int]) -> int | None:
        if not self.available:
            return None
        total = 0
        for handle in self._handles:
            for process in self._pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid in pids and process.usedGpuMemory:
                    total += process.usedGpuMemory
        return total

    def close(self) -> None:
        if self._pynvml is not None:
            self._pynvml.nvmlShutdown()
            self._pynvml = None
