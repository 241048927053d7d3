"""Device table: dense peaks per precision, memory and link bandwidths per accelerator type.

The planner (engine/plan/search.py) and the trainer's MFU/HFU both read it. Every peak is the
vendor's dense (no 2:4 sparsity) matrix rate; sources are listed in docs/planner.md and next to each
entry. ``peak_tflops(device, precision, tf32=False)`` picks the one a run computes at:

- ``bf16`` / ``fp16``: the half-precision tensor-core (cube) peak, ``DeviceSpec.peak_tflops``;
- ``fp32``: the TF32 tensor-core peak when TF32 (NVIDIA) / HF32 (Ascend) matmuls are enabled
  (``tf32=True``), else the plain FP32 (CUDA-core / vector) peak;
- ``fp8``: the FP8 tensor-core peak (``DeviceSpec.fp8_tflops``), what the tensor-parallel
  linears' GEMMs run at under ``--fp8-format`` (docs/precision.md); None on a chip without FP8;
- None where the vendor publishes no figure (never a guess): Huawei publishes no FP32 or HF32
  peak for the Ascend 910 or 910B, so a 910/910B fp32 run has no MFU unless ``--peak-tflops``
  is given. ``lookup_peak_tflops(raw_name)`` stays the half-precision peak, for existing callers.

Which fused torch_npu ops each Ascend SKU runs and how it reports float overflow (saturation or
Inf/NaN mode) are in the chip table, ``engine/device/chips.py``; docs/hardware.md lists both per SKU.

Units: ``peak_tflops`` in TFLOP/s, ``memory_gb`` in GiB (2**30 bytes, as the runtime reports it),
all bandwidths in GB/s (10**9 bytes/s) per direction and per device, the unit nccl-tests and
HCCL report ``busbw`` in. ``inter_node_gbps`` is one device's share of its node's scale-out network
(a DGX A100 has eight 200 Gb/s HCAs, one per GPU: 25 GB/s).

Ascend 910B SKUs: the peak is the cube units' rate, ``cube_core_cnt * cube_freq * 16*16*16 * 2``,
from the CANN platform description files (hicann/runtime,
``src/platform/platform_config/cann/Ascend910B{1,3,4}.ini`` and ``Ascend910B2.ini``):
B1 24 cores at 1850 MHz, B2 24 at 1800, B3 20 at 1800, B4 20 at 1500; memory_size 64 GiB
(B4: 32 GiB). Marketing figures (e.g. 376 TFLOP/s for B2, 313 for B3) add the vector units'
rate to the cube rate; matrix multiplications only run on the cube, so the cube rate is the
honest MFU denominator. Override it per run with ``--peak-tflops`` (plan and train) when a
part runs at another clock.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops: float | None  # dense bf16/fp16 matrix peak; None: measure it (CPU)
    memory_gb: float | None  # GiB; None: unknown (give --memory-gb to the planner)
    intra_node_gbps: float  # per device, per direction, to the other devices of its node
    inter_node_gbps: float  # per device, per direction, to other nodes
    devices_per_node: int
    hbm_gbps: float | None = None  # memory bandwidth, for the planner's memory-bound kernels
    fp32_tflops: float | None = None  # dense FP32 peak (no tensor cores); None: not published
    tf32_tflops: float | None = None  # dense TF32 (NVIDIA) / HF32 (Ascend) peak; None: not published
    fp8_tflops: float | None = None  # dense FP8 (e4m3 / e5m2) peak; None: no FP8 on this chip
    # --optimizer-cpu-offload (engine/plan/offload.py): the host link's effective rate per
    # direction for pinned copies (PCIe), and the device's share of its node's host DRAM bandwidth
    # (theoretical; the planner applies HOST_MEMORY_EFFICIENCY). None: not known for this part
    # (give --host-link-gbps / --host-memory-gbps), or a CPU, whose host and device are one memory.
    host_link_gbps: float | None = None
    host_memory_gbps: float | None = None

    def __post_init__(self) -> None:
        for key in ("peak_tflops", "fp32_tflops", "tf32_tflops", "fp8_tflops", "host_link_gbps",
                    "host_memory_gbps"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"DeviceSpec {self.name}: {key} must be > 0 or None, got {value}")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"DeviceSpec {self.name}: memory_gb must be > 0 or None, got {self.memory_gb}")
        if self.intra_node_gbps <= 0 or self.inter_node_gbps <= 0:
            raise ValueError(f"DeviceSpec {self.name}: link bandwidths must be > 0 GB/s")
        if self.devices_per_node < 1:
            raise ValueError(f"DeviceSpec {self.name}: devices_per_node must be >= 1")


def _cube_tflops(cores: int, mhz: int) -> float:
    """Ascend cube peak: each core multiplies a 16x16 by a 16x16 fp16 tile per cycle (2 FLOPs/MAC)."""
    return round(cores * mhz * 1e6 * 16 * 16 * 16 * 2 / 1e12, 1)


# 910B node (Atlas 800T A2): 8 NPUs on a full HCCS mesh (7 links, 392 GB/s aggregate per NPU as
# published; 196 GB/s per direction used here) and one 200 GbE RoCE port per NPU (25 GB/s).
# HBM: 1.6 TB/s for the 64 GiB parts; B4 has half the stacks (assumed 0.8 TB/s).
# Huawei publishes no FP32 or HF32 peak for the 910 or 910B: fp32_tflops and tf32_tflops stay None.
def _ascend910b(sku: str, cores: int, mhz: int, memory_gb: float, hbm: float) -> DeviceSpec:
    return DeviceSpec(f"ascend910{sku}", _cube_tflops(cores, mhz), memory_gb, 196.0, 25.0, 8, hbm)


DEVICE_SPECS = MappingProxyType({
    # Ascend 910 (910A/ProA): 256 TFLOP/s fp16, 32 GiB HBM2 (1.2 TB/s); 3 HCCS links of 30 GB/s
    # inside a 4-chip mesh (two meshes per 8-NPU server), one 100 GbE port per NPU.
    "ascend910": DeviceSpec("ascend910", 256.0, 32.0, 90.0, 12.5, 8, 1200.0),
    "ascend910b1": _ascend910b("b1", 24, 1850, 64.0, 1600.0),
    "ascend910b2": _ascend910b("b2", 24, 1800, 64.0, 1600.0),
    "ascend910b3": _ascend910b("b3", 20, 1800, 64.0, 1600.0),
    "ascend910b4": _ascend910b("b4", 20, 1500, 32.0, 800.0),
    # "ascend910b" without a SKU: the B2 numbers (pick the SKU key, or --peak-tflops, if it differs).
    "ascend910b": DeviceSpec("ascend910b", _cube_tflops(24, 1800), 64.0, 196.0, 25.0, 8, 1600.0),
    # NVIDIA datasheets, dense (the datasheets' starred figures are 2:4 sparse, twice these):
    # A100 fp32 19.5, tf32 156, bf16/fp16 312; H100 SXM fp32 67, tf32 494.7, bf16 989; H100 PCIe
    # fp32 51, tf32 378, bf16 756; H200 SXM as H100 SXM. NVL (PCIe cards, NVLink bridges): H100 NVL
    # fp32 60, tf32 417.5, bf16 835, 94 GB, 3.9 TB/s, bridges 600 GB/s both ways (300 per direction);
    # H200 NVL fp32 60, tf32 417.5, bf16 835, 141 GB, 4.8 TB/s, bridges 900 GB/s both ways (450).
    # FP8 (dense, half the datasheets' sparse 3958 / 3026 / 3341): H100 and H200 SXM 1979, H100
    # PCIe 1513, H100 NVL and H200 NVL 1670.5. A100: no FP8 tensor cores.
    # NVLink3: 12 links x 25 GB/s = 300 GB/s per direction; DGX A100: one HDR 200 Gb/s HCA per GPU.
    # NVLink4: 450 GB/s per direction; DGX H100/H200: one NDR 400 Gb/s HCA per GPU.
    # Host link (offload): PCIe Gen5 x16 is 32 GT/s x 16 lanes x 128/130 = 63 GB/s per direction;
    # pinned copies reach about 55 GB/s (what CUDA's bandwidthTest and nvbandwidth report on H100
    # systems; an assumption, not measured here): H100/H200, SXM, PCIe and NVL alike. A100: PCIe
    # Gen4 x16, 31.5 GB/s, about 25 GB/s reached. Host memory, per GPU (a DGX's node bandwidth over
    # its 8 GPUs; other servers differ, give --host-memory-gbps): DGX A100, 2 x AMD EPYC 7742 with
    # 8 channels of DDR4-3200 each, 409.6 GB/s, 51.2 per GPU; DGX H100/H200, 2 x Xeon Platinum
    # 8480C with 8 channels of DDR5-4800 each, 614.4 GB/s, 76.8 per GPU. PCIe cards and NVL: the
    # host is the buyer's choice, None.
    "a100-40gb": DeviceSpec("a100-40gb", 312.0, 40.0, 300.0, 25.0, 8, 1555.0, 19.5, 156.0,
                            host_link_gbps=25.0, host_memory_gbps=51.2),
    "a100-80gb": DeviceSpec("a100-80gb", 312.0, 80.0, 300.0, 25.0, 8, 2039.0, 19.5, 156.0,
                            host_link_gbps=25.0, host_memory_gbps=51.2),
    "h100": DeviceSpec("h100", 989.0, 80.0, 450.0, 50.0, 8, 3350.0, 67.0, 494.7, 1979.0,
                       host_link_gbps=55.0, host_memory_gbps=76.8),
    "h100-pcie": DeviceSpec("h100-pcie", 756.0, 80.0, 300.0, 50.0, 8, 2000.0, 51.0, 378.0, 1513.0,
                            host_link_gbps=55.0),
    "h200": DeviceSpec("h200", 989.0, 141.0, 450.0, 50.0, 8, 4800.0, 67.0, 494.7, 1979.0,
                       host_link_gbps=55.0, host_memory_gbps=76.8),
    "h100-nvl": DeviceSpec("h100-nvl", 835.0, 94.0, 300.0, 50.0, 8, 3900.0, 60.0, 417.5, 1670.5,
                           host_link_gbps=55.0),
    "h200-nvl": DeviceSpec("h200-nvl", 835.0, 141.0, 450.0, 50.0, 8, 4800.0, 60.0, 417.5, 1670.5,
                           host_link_gbps=55.0),
    # CPU: no table peak (the trainer measures a matmul); gloo over shared memory / Ethernet.
    "cpu": DeviceSpec("cpu", None, None, 10.0, 1.25, 1, None),
})

# Raw device names (torch.cuda/torch.npu get_device_name, lower-cased, spaces and '-' and '_'
# removed) to table keys. First match wins, so more specific patterns come first.
_NAME_RULES = (
    (r"h200nvl", "h200-nvl"),
    (r"gh200|h200", "h200"),
    (r"h100nvl", "h100-nvl"),
    (r"h100(pcie|80gbpcie)", "h100-pcie"),
    (r"h100|h800", "h100"),
    (r"a100.*40gb|a100(pcie|sxm4)?$", "a100-40gb"),
    (r"a100|a800", "a100-80gb"),
    (r"^ascend910b1", "ascend910b1"),
    (r"^ascend910b2", "ascend910b2"),
    (r"^ascend910b3", "ascend910b3"),
    (r"^ascend910b4", "ascend910b4"),
    (r"^ascend910(a|proa|premiuma)?$", "ascend910"),
    (r"^cpu$", "cpu"),
)


def _normalise(name: str) -> str:
    key = name.strip().lower()
    key = re.sub(r"^nvidia\s+", "", key)
    return re.sub(r"[\s_\-]+", "", key)


def lookup_device(device_name: str) -> str | None:
    """The DEVICE_SPECS key for a table key or a raw device name, or None when it is unknown.

    >>> lookup_device("NVIDIA H100 80GB HBM3"), lookup_device("Ascend910B2")
    ('h100', 'ascend910b2')
    >>> lookup_device("NVIDIA H200 NVL"), lookup_device("NVIDIA H200"), lookup_device("NVIDIA H100 NVL")
    ('h200-nvl', 'h200', 'h100-nvl')
    """
    if device_name in DEVICE_SPECS:
        return device_name
    key = _normalise(device_name)
    for pattern, spec_key in _NAME_RULES:
        if re.search(pattern, key):
            return spec_key
    return None


def lookup_peak_tflops(device_name: str) -> float | None:
    """Dense bf16/fp16 peak of a device given its raw name, or None (unknown device, or a CPU)."""
    key = lookup_device(device_name)
    return None if key is None else DEVICE_SPECS[key].peak_tflops


PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


def peak_tflops(device: str, precision: str, tf32: bool = False) -> float | None:
    """Dense peak (TFLOP/s) of ``device`` (table key or raw name) for matmuls in ``precision``.

    ``tf32``: fp32 matmuls run on TF32/HF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``,
    or ``allow_hf32`` on Ascend). None for an unknown device or an unpublished figure.

    >>> peak_tflops("a100-80gb", "fp32"), peak_tflops("a100-80gb", "fp32", tf32=True)
    (19.5, 156.0)
    >>> peak_tflops("h100", "fp8"), peak_tflops("a100-80gb", "fp8")
    (1979.0, None)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    key = lookup_device(device)
    if key is None:
        return None
    spec = DEVICE_SPECS[key]
    if precision in ("bf16", "fp16"):
        return spec.peak_tflops
    if precision == "fp8":
        return spec.fp8_tflops
    return spec.tf32_tflops if tf32 else spec.fp32_tflops


# What to change when a plan (or a dry run) asks for FP8 on a chip without it: the planner can
# take another peak; a dry run only another device.
FP8_FIX_PLAN = "give --fp8-peak-tflops or drop --fp8-format"
FP8_FIX_DEVICE = "drop --fp8-format, or choose a --device with FP8 (h100, h200)"


def fp8_peak_problem(spec: DeviceSpec, fp8_peak: float | None = None,
                     fix: str = FP8_FIX_PLAN) -> str | None:
    """Why an FP8 run (``--fp8-format``) cannot be planned on ``spec`` (one line), or None:
    neither the table nor ``fp8_peak`` (``--fp8-peak-tflops``) gives it an FP8 peak. One check
    for ``python -m engine.plan`` and ``python -m engine.dryrun --device``; ``fix``: what to
    change with the tool that asks.

    >>> fp8_peak_problem(DEVICE_SPECS["h100"]) is None
    True
    >>> fp8_peak_problem(DEVICE_SPECS["a100-80gb"], fix=FP8_FIX_DEVICE)
    '--fp8-format: a100-80gb has no FP8 peak in engine/plan/hardware.py (FP8 needs compute capability 8.9 or later: H100, H200); drop --fp8-format, or choose a --device with FP8 (h100, h200)'
    """
    if spec.fp8_tflops is not None or fp8_peak is not None:
        return None
    return (f"--fp8-format: {spec.name} has no FP8 peak in engine/plan/hardware.py (FP8 needs "
            f"compute capability 8.9 or later: H100, H200); {fix}")


@dataclass(frozen=True)
class OverlapEfficiency:
    """Fraction of the hideable communication time that a backend actually hides, per overlap.

    The planner's overlap model (engine/plan/overlap.py) splits each overlapped transfer into what
    cannot hide (one chunk of the TP ring, the last DP bucket, the first ZeRO bucket, and whatever
    exceeds the compute it runs beside) and what can; ``exposed = unhideable + (1 - e) x hideable``.

    - ``tp``: the TP chunk ring under its GEMMs (``--tp-comm-overlap``);
    - ``dp``: the bucketed gradient reduction under the last micro-batch's backward;
    - ``zero``: ZeRO's bucketed parameter all-gather ahead of the next forward.

    >>> OverlapEfficiency(0.5, 1.0, 1.0).tp
    0.5
    """
    tp: float = 1.0
    dp: float = 1.0
    zero: float = 1.0

    def __post_init__(self) -> None:
        for key in ("tp", "dp", "zero"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"overlap efficiency {key} must be in [0, 1], got {value!r}")


# Per collective backend. NCCL and HCCL: 1.0, i.e. the hideable time is hidden whole; this is the
# assumption the DP overlap of the step-time model has always made (the Narayanan et al. 2021 rows
# were checked with it, so it stays), and TP and ZeRO take the same value because nothing measured
# here says otherwise: NCCL and HCCL run transfers on their own streams and copy or DMA engines.
# gloo: 0.0, since on a CPU the collectives run on the cores that compute; `--calibrate` fits all
# three from a measured run's time_tp_exposed_s / time_dp_exposed_s (docs/planner.md).
OVERLAP_EFFICIENCY = MappingProxyType({
    "nccl": OverlapEfficiency(1.0, 1.0, 1.0),
    "hccl": OverlapEfficiency(1.0, 1.0, 1.0),
    "gloo": OverlapEfficiency(0.0, 0.0, 0.0),
})


def get_device_spec(name: str) -> DeviceSpec:
    """The spec for a table key or raw device name; raises with the list of known keys."""
    key = lookup_device(name)
    if key is None:
        raise KeyError(f"unknown device {name!r}; known: {', '.join(DEVICE_SPECS)} "
                       f"(or give --peak-tflops and --memory-gb with one of them)")
    return DEVICE_SPECS[key]
