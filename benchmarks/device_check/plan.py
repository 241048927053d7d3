"""The device check's plan and what every stage shares: the stages and their deadlines, the
models, engine.train's flags for a stage and the last line of a stage's log (its processes run
under their deadlines by benchmarks/device_check/launch.py).

>>> [s.name for s in plan(skip_compile=True)][:4]
['kernels', 'eager', 'moe', 'moe_dense']
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MODEL = {"num-layers": 24, "hidden-size": 2048, "num-attention-heads": 16, "seq-length": 2048,
         "vocab-size": 51200}
TINY = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
        "vocab-size": 256}
RESERVE_S = 15.0   # kept back from the budget for writing the report
OFFLOAD_MIN_S = 300.0  # the offload stage's 8B: startup and 4 steps (benchmarks/device_check/offload.py)
MIN_STAGE_S = 20.0  # a stage that would get less than this is skipped
TWO_RANKS_MODEL = {"num-layers": 4, "hidden-size": 256, "num-attention-heads": 4,
                   "seq-length": 256, "vocab-size": 1024}  # the two_ranks stage


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: float                 # its own deadline at most
    optional: bool = False       # run only while time remains
    flags: tuple[str, ...] = ()  # extra engine.train flags (training stages)
    steps: int | None = None     # at most --steps (None: --steps)
    min_s: float = 0.0           # skipped when the budget leaves less than this (and MIN_STAGE_S)

    @property
    def training(self) -> bool:
        return self.name not in ("kernels", "tp_overlap", "two_ranks", "syncs", "fp8", "offload")


@dataclass
class StageResult:
    name: str
    status: str                  # ok | failed | deadline | skipped
    deadline_s: float | None
    wall_s: float | None
    detail: str = ""
    kernels: list = field(default_factory=list)
    summary: dict | None = None
    gemm_chunks: list = field(default_factory=list)   # the TP overlap's chunked GEMM on one device
    tp_overlap: dict | None = None  # tp=2 without / with --tp-comm-overlap on two devices
    two_ranks: dict | None = None   # two processes on one device (gloo) against the serial run
    syncs: list = field(default_factory=list)  # host waits: the dispatch mode's and CUDA's count
    fp8: dict | None = None         # bf16 against FP8 per model (benchmarks/device_check/fp8.py)
    offload: dict | None = None     # the 8B with its optimizer offloaded (device_check/offload.py)


def plan(skip_compile: bool = False) -> list[Stage]:
    """The stages in order. Caps are sized for a 1.3B model on one H100/H200-class device: 20
    eager steps take about a minute, inductor's first compile two to three. After the kernels,
    the 1.3B eager reference and the MoE pair come the stages whose figures no device has
    measured yet, those with targets first: FP8 (four runs, two of them a model of about 3B;
    capped so that the next stage still gets its time), two processes on one device, the host
    waits, llama's compiled paths; the compiled 1.3B run (measured: 56.8% MFU on an H200), ZeRO
    and packed documents follow while time remains. A 9-minute budget does not reach them all:
    the table says which were skipped. Last, the 8B with its optimizer offloaded, which needs a
    call of its own (``--only offload``: benchmarks/device_check/offload.py)."""
    stages = [Stage("kernels", 120.0),   # with the FP8 blockwise row: the quantization compiles
              Stage("eager", 180.0), Stage("moe", 90.0),
              Stage("moe_dense", 75.0), Stage("fp8", 260.0, optional=True, steps=10),
              Stage("two_ranks", 140.0, optional=True, steps=4),
              Stage("syncs", 90.0, optional=True),
              Stage("llama", 150.0, optional=True, flags=("--block", "llama"), steps=10)]
    if not skip_compile:
        stages.append(Stage("compiled", 240.0, optional=True, flags=("--compile",)))
    stages += [Stage("tp_overlap", 150.0, optional=True, steps=10),
               Stage("zero", 120.0, optional=True, flags=("--use-distributed-optimizer",), steps=10),
               Stage("packed", 120.0, optional=True, steps=10,
                     flags=("--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss")),
               Stage("offload", 480.0, optional=True, min_s=OFFLOAD_MIN_S)]
    return stages


def deadline_for(stage: Stage, remaining_s: float) -> float | None:
    """The stage's deadline given the budget left, or None when it gets no run (too little time).

    >>> deadline_for(Stage("eager", 180.0), 500.0), deadline_for(Stage("eager", 180.0), 100.0)
    (180.0, 85.0)
    >>> deadline_for(Stage("zero", 120.0, optional=True), 30.0) is None
    True
    >>> deadline_for(Stage("offload", 480.0, optional=True, min_s=300.0), 200.0) is None
    True
    """
    left = remaining_s - RESERVE_S
    if left < max(MIN_STAGE_S, stage.min_s):
        return None
    return min(stage.cap_s, left)


def train_argv(kind: str, steps: int, metrics: str, run_dir: str, flags=(), micro_batch: int = 4,
               global_batch: int = 16, model: dict | None = None, precision: str = "bf16") -> list[str]:
    """engine.train's flags for a stage: mock data, no checkpoint, no plot (matplotlib is not
    needed), metrics to ``metrics``."""
    argv = ["--mock-data", "--device", kind, "--precision", precision, "--no-progress",
            "--train-iters", str(steps), "--lr-warmup-iters", "2", "--log-interval", "1",
            "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
            "--metrics-file", metrics, "--run-dir", run_dir, "--save", "", "--plot", ""]
    for key, value in (model or MODEL).items():
        argv += [f"--{key}", str(value)]
    return argv + list(flags)


def last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else "(no output)"
