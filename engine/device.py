"""The one place that knows about accelerators: npu (torch_npu), cuda or cpu.

It picks the device type, binds this process to its device by LOCAL_RANK, and hands the device and
the collective backend (npu -> hccl, cuda -> nccl, cpu -> gloo) to ParallelState. torch_npu is
imported lazily and only when it is installed; nothing else in the project calls torch.cuda.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass

import torch

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)
    return bool(torch.npu.is_available())


def detect_device_type(requested: str = "auto") -> str:
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"--device must be auto, npu, cuda or cpu, got {requested!r}")
        if requested == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA device: "
                             f"use --device auto (or cpu), or install a CUDA build of torch on a GPU node")
        if requested == "npu" and not _npu_available():
            raise ValueError("--device npu, but torch_npu is not installed or sees no NPU; install "
                             "CANN and torch_npu (pip install -e .[npu]) or use --device auto")
        return requested
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass
class DeviceInfo:
    type: str
    device: torch.device
    backend: str
    name: str

    @property
    def autocast_device_type(self) -> str:
        return self.type

    def synchronize(self) -> None:
        if self.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.type == "npu":
            torch.npu.synchronize(self.device)

    def get_rng_state(self) -> torch.Tensor | None:
        """The device generator's state (None on cpu, whose generator is torch's default one)."""
        return None if self.type == "cpu" else torch.get_device_module(self.type).get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.type != "cpu":
            torch.get_device_module(self.type).set_rng_state(state, self.device)

    def reset_peak_memory(self) -> None:
        if self.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.type == "npu":
            torch.npu.reset_peak_memory_stats(self.device)

    def peak_memory_bytes(self) -> int:
        if self.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.type == "npu":
            return int(torch.npu.max_memory_allocated(self.device))
        return _cpu_max_rss_bytes()

    def memory_stats(self) -> dict[str, int]:
        if self.type == "cuda":
            return {"allocated": torch.cuda.memory_allocated(self.device),
                    "reserved": torch.cuda.memory_reserved(self.device),
                    "peak": self.peak_memory_bytes()}
        if self.type == "npu":
            return {"allocated": torch.npu.memory_allocated(self.device),
                    "reserved": torch.npu.memory_reserved(self.device),
                    "peak": self.peak_memory_bytes()}
        return {"peak": self.peak_memory_bytes()}


def device_count(kind: str) -> int:
    """Devices of this type visible to the process (0 for cpu)."""
    if kind == "npu":
        return torch.npu.device_count() if _npu_available() else 0
    if kind == "cuda":
        return torch.cuda.device_count()
    return 0


def _cpu_max_rss_bytes() -> int:
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def setup_device(requested: str = "auto", local_rank: int = 0) -> DeviceInfo:
    """Detect the device type and bind this process to device LOCAL_RANK (not RANK)."""
    kind = detect_device_type(requested)
    if kind == "npu":
        torch.npu.set_device(local_rank)
        device = torch.device("npu", local_rank)
        name = torch.npu.get_device_name(local_rank)
    elif kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        name = torch.cuda.get_device_name(local_rank)
    else:
        device, name = torch.device("cpu"), "cpu"
    return DeviceInfo(kind, device, BACKENDS[kind], name)


def measure_cpu_peak_tflops(size: int = 1024, repeats: int = 5) -> float:
    """A one-time matmul measurement, used as the CPU 'peak' for MFU when none is given."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best / 1e12
