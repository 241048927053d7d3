"""The one place that knows about accelerators: npu (torch_npu), cuda or cpu.

It picks the device type, binds this process to its device (``device_index``: LOCAL_RANK modulo
the visible devices, so a Slurm task that sees one device binds device 0), and hands the device
and the collective backend (npu -> hccl, cuda -> nccl, cpu -> gloo) to ParallelState. On an NPU it
reads the chip's name and chooses, from the chip table (engine/device/chips.py), which fused torch_npu ops
the kernels may use (``DeviceInfo.kernel_paths``, with one note per op that falls back) and how the
loss scaler detects an overflow (``overflow_check``: the float status register on saturation-mode
chips). ``set_matmul_precision`` is the one switch for TF32 (CUDA) / HF32 (NPU) matmuls.
torch_npu is imported lazily and only when it is installed; nothing else in the project calls
torch.cuda.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass

import torch

from engine.device.chips import npu_kernel_paths, overflow_mode
from kernels.dispatch import ALL_FUSED, KernelPaths, import_torch_npu

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)
    return bool(torch.npu.is_available())


# the engine's side streams (parallel/runtime/streams.py) enter a ``torch.Stream`` as a context
# manager (torch 2.7) and ask ``torch.accelerator`` for the current stream (2.6); torch_npu's
# generic streams and events (``torch.Stream(device="npu")``) come with its 2.6 releases
MIN_ACCELERATOR_TORCH = (2, 7)


def accelerator_torch_problem(kind: str, version: str | None = None) -> str | None:
    """One line when this torch is too old to run the engine on ``kind``'s device, else None.
    The CPU has no streams and runs on any torch the package installs with.

    >>> accelerator_torch_problem("cuda", "2.6.0+cu124")[:40], accelerator_torch_problem("npu", "2.7.1")
    ('--device cuda needs torch 2.7 or newer (', None)
    """
    version = torch.__version__ if version is None else version
    if kind == "cpu" or torch.torch_version.TorchVersion(version) >= MIN_ACCELERATOR_TORCH:
        return None
    extra = " and the torch_npu of the same version (CANN's compatibility table)" if kind == "npu" else ""
    return (f"--device {kind} needs torch {'.'.join(map(str, MIN_ACCELERATOR_TORCH))} or newer (its "
            f"streams and events serve every side stream of the engine); this torch is {version}: "
            f"install torch >= {'.'.join(map(str, MIN_ACCELERATOR_TORCH))}{extra}, or use --device cpu")


def detect_device_type(requested: str = "auto") -> str:
    """The device type a run uses ("npu", "cuda" or "cpu"); ValueError with one line for a
    requested device this machine lacks, or a torch too old for the chosen accelerator."""
    kind = _detect(requested)
    problem = accelerator_torch_problem(kind)
    if problem:
        raise ValueError(problem)
    return kind


def _detect(requested: str) -> str:
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
    kernel_paths: KernelPaths = ALL_FUSED   # fused NPU ops this chip runs (engine/device/chips.py)
    overflow_mode: str = "inf_nan"          # "saturation": overflow read from the float status
    notes: tuple = ()                       # one line per fused op that falls back, for the log
    capability: tuple | None = None         # CUDA compute capability (major, minor); None elsewhere

    def overflow_check(self):
        """What the loss scaler asks for an overflow besides ``isfinite`` (see ``FloatStatusCheck``)."""
        if self.type == "npu" and self.overflow_mode == "saturation":
            return FloatStatusCheck(self.device)
        return NO_OVERFLOW_REGISTER

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


def available_memory(kind: str, local_rank: int = 0, local_world_size: int = 1,
                     meminfo: str = "/proc/meminfo", backend: str | None = None) -> tuple[int | None, str]:
    """Bytes this process may still allocate on its device, and where the figure comes from.

    npu / cuda: the free memory of the device ``device_index`` binds (``mem_get_info``). It is
    shared by the node's processes only where they can be on one device together: ``backend``
    (the run's collective backend, default the device's own) gloo with a single visible device
    (each may take its share, not the whole). Under nccl or hccl no two processes share a device,
    so one visible device is this process's own (Slurm's ``--gpus-per-task=1``): the whole of it.
    cpu: the host's MemAvailable (``meminfo``) shared by the node's ``local_world_size``
    processes. (None, why) when it cannot be read; nothing is then refused for memory. A
    ValueError (``device_index``) when the node's processes cannot each bind a device.
    """
    if kind in ("npu", "cuda"):
        visible = device_count(kind)
        index = device_index(local_rank, local_world_size, visible)
        module = torch.npu if kind == "npu" else torch.cuda
        free, total = module.mem_get_info(index)
        together = (backend or BACKENDS[kind]) == "gloo" and visible == 1
        share = local_world_size if together and local_world_size > 1 else 1
        shared = f", shared by {share} processes on it" if share > 1 else ""
        return int(free) // share, f"free on {kind}:{index} (of {total / 2 ** 30:.1f} GiB{shared})"
    try:
        with open(meminfo) as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        kib = int(fields["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError):
        return None, f"{meminfo} has no MemAvailable"
    share = max(1, local_world_size)
    shared = f", shared by {share} processes on this node" if share > 1 else ""
    return kib * 1024 // share, f"host memory available (MemAvailable{shared})"


def _cpu_max_rss_bytes() -> int:
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def device_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """The device this process binds: LOCAL_RANK modulo the devices it can see.

    torchrun on a node with 8 visible devices: local ranks 0..7 bind 0..7. Slurm with one device
    per task (``--gpus-per-task=1``, or ASCEND_RT_VISIBLE_DEVICES set per task): each task sees a
    single device, index 0, whatever its SLURM_LOCALID. Fewer visible devices than processes on the
    node (but more than one) would put two processes on one device, which NCCL and HCCL refuse.

    >>> device_index(5, 8, 8), device_index(3, 4, 1), device_index(1, 2, 4)
    (5, 0, 1)
    """
    if visible < 1:
        raise ValueError("no device of this type is visible to the process; check "
                         "CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES or use --device cpu")
    if 1 < visible < local_world_size:
        raise ValueError(f"{local_world_size} processes on this node (LOCAL_WORLD_SIZE) but only "
                         f"{visible} visible devices: two processes would share one; give each "
                         f"process its own device or start {visible} per node")
    return local_rank % visible


def _runtime_inf_nan() -> bool | None:
    """torch_npu's own answer to whether the chip runs in Inf/NaN mode (None if it cannot say)."""
    import torch_npu
    check = getattr(getattr(torch_npu.npu, "utils", None), "is_support_inf_nan", None)
    return None if check is None else bool(check())


def setup_device(requested: str = "auto", local_rank: int = 0, local_world_size: int = 1) -> DeviceInfo:
    """Detect the device type and bind this process to its device (``device_index``, from
    LOCAL_RANK, not RANK); on an NPU also choose the chip's kernel paths and overflow mode."""
    kind = detect_device_type(requested)
    if kind == "cpu":
        return DeviceInfo(kind, torch.device("cpu"), BACKENDS[kind], "cpu")
    index = device_index(local_rank, local_world_size, device_count(kind))
    module = torch.npu if kind == "npu" else torch.cuda
    module.set_device(index)
    device, name = torch.device(kind, index), module.get_device_name(index)
    if kind == "cuda":   # the capability also picks ring attention's block kernel (flash: 8.0+)
        cc = tuple(torch.cuda.get_device_capability(index))
        return DeviceInfo(kind, device, BACKENDS[kind], name, KernelPaths(cuda_capability=cc),
                          capability=cc)
    paths, notes = npu_kernel_paths(name)
    mode = overflow_mode(name, _runtime_inf_nan())
    if mode == "saturation":
        notes.append(f"{name} runs in saturation mode (an overflow becomes +-MAX): the loss scaler "
                     f"reads the float status register instead of testing gradients for inf/nan")
    return DeviceInfo(kind, device, BACKENDS[kind], name, paths, mode, tuple(notes))


def set_matmul_precision(kind: str, allow_tf32: bool) -> bool:
    """Let fp32 matmuls and convolutions run on TF32 (CUDA) or HF32 (Ascend) units, or forbid it;
    returns whether the device now does. Set both ways explicitly, since the defaults differ
    (PyTorch: cuDNN TF32 on, matmul off; torch_npu: conv HF32 on, matmul off). CPU: no such mode.
    """
    if kind == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32
        return allow_tf32
    if kind == "npu":  # documented in torch_npu's API reference, defaults False and True
        import torch_npu
        torch_npu.npu.matmul.allow_hf32 = allow_tf32
        torch_npu.npu.conv.allow_hf32 = allow_tf32
        return allow_tf32
    return False


class FloatStatusCheck:
    """Overflow detection on saturation-mode NPUs (Atlas training series, or A2/A3 with
    ``INF_NAN_MODE_ENABLE=0``): an overflowing fp16 result saturates to +-MAX and a NaN becomes 0,
    so gradients stay finite and ``isfinite`` never fires; the chip records the overflow in its
    float status register instead. ``clear()`` before the step's forward, ``flag()`` after the
    gradients are final: a 0-d fp32 tensor on the device, 1.0 if any kernel overflowed in between.

    Which torch_npu calls, probed on the installed torch_npu (never assumed):

    - ``torch_npu.npu_clear_float_status`` / ``npu_get_float_status`` on an 8-word fp32 buffer: the
      op-plugin reference documents the pair (beta) for the Atlas training, A2 and A3 series; the
      flag stays on the device, no host sync. torch_npu's own GradScaler and DeepSpeed's NPU loss
      scaler read the same register.
    - where a torch_npu lacks them, the public wrappers ``torch_npu.npu.utils.clear_npu_overflow_flag``
      / ``npu_check_overflow`` (documented for the same series; in saturation mode they ignore
      their argument and read the register, and ``npu_check_overflow`` clears it). They return a
      host bool, so that path costs one synchronisation per step.

    torch_npu's ``get_npu_overflow_flag`` is not used: it raises on chips that support Inf/NaN mode
    (Ascend910B1 and later), and this check only runs in saturation mode anyway.
    """

    def __init__(self, device: torch.device, torch_npu=None):
        self.device = device
        self._tnpu = torch_npu
        self.api: str | None = None  # chosen on first use, from the installed torch_npu
        self._status = torch.zeros(8, dtype=torch.float32, device=device)  # the register's 8 words

    def _calls(self):
        """(get, clear) of the installed torch_npu, probed once."""
        if self.api is None:
            tnpu = self._tnpu if self._tnpu is not None else import_torch_npu()
            if hasattr(tnpu, "npu_get_float_status") and hasattr(tnpu, "npu_clear_float_status"):
                self.api = "npu_get_float_status"
                self._pair = (tnpu.npu_get_float_status, tnpu.npu_clear_float_status)
            else:
                self.api = "npu_check_overflow"
                self._pair = (tnpu.npu.utils.npu_check_overflow, tnpu.npu.utils.clear_npu_overflow_flag)
        return self._pair

    def clear(self) -> None:
        _, clear = self._calls()
        if self.api == "npu_get_float_status":
            clear(self._status)
        else:
            clear()

    def flag(self) -> torch.Tensor:
        get, _ = self._calls()
        if self.api == "npu_get_float_status":
            return (get(self._status).float().sum() > 0).float()
        return torch.tensor(float(bool(get(0.0))), device=self.device)  # a host bool: one sync


class _NoOverflowRegister:
    """Devices whose overflows show up as inf/nan in the gradients: nothing to clear or read."""

    def clear(self) -> None:
        return None

    def flag(self) -> None:
        return None


NO_OVERFLOW_REGISTER = _NoOverflowRegister()


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


def profiler_api(kind: str):
    """(profile, activities, trace_handler) for --profile-steps: ``torch.profiler`` on CPU and CUDA,
    ``torch_npu.profiler`` (its Ascend counterpart, same call shape) on NPU."""
    if kind == "npu":
        import torch_npu
        api = torch_npu.profiler
        activities = [api.ProfilerActivity.CPU, api.ProfilerActivity.NPU]
    else:
        api = torch.profiler
        activities = [api.ProfilerActivity.CPU]
        if kind == "cuda":
            activities.append(api.ProfilerActivity.CUDA)
    return api.profile, activities, api.tensorboard_trace_handler
