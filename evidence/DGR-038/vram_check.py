"""What kvpool's VRAM meter (kvpool.gpu.VramMeter, through nvidia-ml-py) reads for a process holding GPU
memory: the figure a VRAM budget would be checked against. Needs an NVIDIA GPU, its driver and PyTorch
(for the child that allocates); prints "no GPU" and exits 0 without one.

    python evidence/DGR-038/vram_check.py
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from kvpool.gpu import VramMeter  # noqa: E402

MiB = 1024**2
CHILD = r"""
import sys, torch
def stage(name):
    torch.cuda.synchronize(); print(name, flush=True); sys.stdin.readline()
torch.empty(0, device="cuda"); stage("CUDA context only")
a = torch.empty(1024**3, dtype=torch.uint8, device="cuda"); stage("+ 1 GiB tensor")
b = torch.empty(4 * 1024**3, dtype=torch.uint8, device="cuda"); stage("+ 4 GiB tensor")
del a, b; stage("tensors deleted (PyTorch keeps its cache)")
torch.cuda.empty_cache(); stage("after torch.cuda.empty_cache()")
"""


def main() -> int:
    meter = VramMeter()
    if not meter.available:
        print("no GPU: VramMeter.available is False, every VRAM reading is None")
        return 0
    pynvml = meter._pynvml
    handle = meter._handles[0]
    print(f"device {pynvml.nvmlDeviceGetName(handle)}, driver {pynvml.nvmlSystemGetDriverVersion()}, nvml {pynvml.nvmlSystemGetNVMLVersion()}")
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    print(f"child pid {child.pid}")
    print(f"{'STAGE':<44} {'VramMeter.used_by({child})':>26}  processes NVML lists (pid: MiB)")
    try:
        while (line := child.stdout.readline().strip()):
            time.sleep(0.5)
            used = meter.used_by({child.pid})
            listed = [(p.pid, (p.usedGpuMemory or 0) // MiB) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            shown = "None" if used is None else f"{used // MiB} MiB"
            print(f"{line:<44} {shown:>26}  {listed}")
            child.stdin.write("\n")
            child.stdin.flush()
    finally:
        child.wait(60)
        meter.close()
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
