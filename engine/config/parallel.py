"""The run's parallel layout (``--tp``, ``--pp``, ``--cp``, ``--dp``, the pipeline schedule, ZeRO,
sequence parallelism and the TP overlap, expert parallelism, the backend and its rules), validated
in ``__post_init__``; ``grid(world_size)`` turns it into the rank grid. A section of
``engine.config.schema.RunConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config.sharding import resolve_sharding
from models.config import check_finite
from parallel.grid.expert_groups import ExpertGrid
from parallel.grid.topology import RankGrid
from parallel.pipeline.schedules import chunks_per_rank, schedule_placement

SCHEDULES = ("1f1b", "gpipe", "interleaved", "1f1b-w", "zb-h1", "zb-v")
RECOMPUTE = ("none", "selective", "full")
CP_COMM_TYPES = ("p2p", "a2a")
BACKEND_RULES = ("auto", "none", "hccl", "hccl:950", "nccl")
DIST_BACKENDS = ("auto", "nccl", "hccl", "gloo")


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # default: world / (tp * cp * pp)
    cp: int = 1  # context parallelism: each sample's sequence split over cp ranks
    # context-parallel attention: p2p (ring attention, load-balanced causal chunks) or a2a (Ulysses:
    # all-to-all from sequence to head shards; needs heads / tp divisible by cp)
    cp_comm_type: str = "p2p"
    virtual_pipeline_size: int = 1
    # 1f1b-w, zb-h1 and zb-v split every backward into B (input gradient) and W (weight gradients);
    # zb-v holds two chunks per rank in a V (parallel/pipeline/zero_bubble.py)
    pipeline_schedule: str = "1f1b"
    # without sequence parallelism each TP rank sends 1/tp of a stage boundary tensor and the
    # receiving stage all-gathers it over TP (Megatron-LM's name)
    scatter_gather_tensors_in_pipeline: bool = True
    # count the embedding / output layer as this many blocks when splitting layers over stages
    # (0: split by block count alone, which needs num_layers % (pp * vp) == 0)
    stage_end_weight: float = 0.0
    sequence_parallel: bool = False
    # help: under --sequence-parallel, pipeline the all-gather before each column-parallel GEMM and
    # the reduce-scatter after each row-parallel GEMM with the GEMMs, in tp chunks (Megatron's name)
    tp_comm_overlap: bool = False
    recompute: str = "none"
    # ZeRO 0-3 by Megatron-LM's names (engine/config/sharding.py); None: from the two aliases below
    data_parallel_sharding_strategy: str | None = None
    use_distributed_optimizer: bool = False  # = optim
    # with --use-distributed-optimizer: 1 (optim), 2 (optim_grads), 3 (optim_grads_params); None: 1
    zero_stage: int | None = None
    # help: launch each gradient bucket's reduction as soon as its last gradient is in, during
    # backward (--no-overlap-grad-reduce: all of them after backward)
    overlap_grad_reduce: bool = True
    # help: with --use-distributed-optimizer: leave each bucket's parameter all-gather in flight
    # until the next forward reaches the first module using it (--no-overlap-param-gather: wait
    # right after the update; always so under --compile)
    overlap_param_gather: bool = True
    order: str = "tp-cp-dp-pp"
    bucket_size_mb: float = 25.0
    timeout_s: float = 300.0
    # check every collective against a backend's rules: auto (the backend's own on NPU/GPU, none on
    # gloo), none, hccl (Atlas A2/A3), hccl:950, nccl
    backend_rules: str = "auto"
    # help: run under the stream-order checker (parallel/runtime/stream_check.py): every access of a
    # storage from two streams, threads or communicators must be ordered; a violation ends the run
    # (slow: for tests and the layout fuzzer)
    stream_check: bool = False
    # the process groups' backend: auto (the device's: hccl, nccl, gloo on the CPU), or gloo with
    # device tensors (two processes on one GPU, which NCCL refuses; benchmarks/device_check/two_ranks.py)
    distributed_backend: str = "auto"
    # mixture of experts: EP ranks drawn from the dp x cp ranks of a stage
    # (parallel/grid/expert_groups.py)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1  # 1 or tp: the TP group splits every expert

    def __post_init__(self):
        check_finite(self)
        if self.backend_rules not in BACKEND_RULES:
            raise ValueError(f"--backend-rules must be one of {BACKEND_RULES}, got {self.backend_rules!r}")
        if self.distributed_backend not in DIST_BACKENDS:
            raise ValueError(f"--distributed-backend must be one of {DIST_BACKENDS}, got "
                             f"{self.distributed_backend!r}")
        for key in ("tp", "cp", "pp", "virtual_pipeline_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"--pipeline-schedule must be one of {SCHEDULES}, got {self.pipeline_schedule!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.stage_end_weight < 0:
            raise ValueError(f"--stage-end-weight must be >= 0, got {self.stage_end_weight}")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"--bucket-size-mb must be > 0, got {self.bucket_size_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout-s must be > 0 (seconds a collective may wait), got "
                             f"{self.timeout_s}")
        if self.pipeline_schedule == "zb-v" and self.virtual_pipeline_size not in (1, 2):
            raise ValueError(f"--pipeline-schedule zb-v always runs 2 model chunks per rank (in a "
                             f"V); drop --virtual-pipeline-size {self.virtual_pipeline_size} or "
                             f"set it to 2")
        vp = self.virtual_pipeline_size
        if vp > 1 and self.pipeline_schedule not in ("interleaved", "zb-v"):
            if self.pp == 1:
                raise ValueError(f"--virtual-pipeline-size {vp} needs --pipeline-schedule interleaved, "
                                 f"which needs --pp > 1 (it is the model chunks per pipeline stage); "
                                 f"raise --pp or drop --virtual-pipeline-size")
            raise ValueError(f"--pipeline-schedule {self.pipeline_schedule} runs one model chunk per "
                             f"rank, not --virtual-pipeline-size {vp}: drop --pipeline-schedule "
                             f"(interleaved is implied) or --virtual-pipeline-size")
        if self.pipeline_schedule == "interleaved" and self.pp == 1:
            raise ValueError("--pipeline-schedule interleaved needs --pp > 1")
        if self.pipeline_schedule == "interleaved" and self.virtual_pipeline_size < 2:
            raise ValueError(f"--pipeline-schedule interleaved needs --virtual-pipeline-size >= 2 "
                             f"(model chunks per rank), got {self.virtual_pipeline_size}; set it, "
                             f"or use --pipeline-schedule 1f1b for one chunk per rank")
        resolve_sharding(self)   # the strategy and its aliases, one meaning

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks a pipeline rank holds: 2 for zb-v (pp > 1), else --virtual-pipeline-size."""
        return 1 if self.pp == 1 else chunks_per_rank(self.pipeline_schedule, self.virtual_pipeline_size)

    @property
    def placement(self) -> str:
        """How chunks sit on ranks: "v" for zb-v (pp > 1), else Megatron's loop."""
        return "loop" if self.pp == 1 else schedule_placement(self.pipeline_schedule)

    def grid(self, world_size: int) -> RankGrid:
        mp = self.tp * self.cp * self.pp
        dp = self.dp if self.dp is not None else world_size // mp
        if dp < 1 or mp * dp != world_size:
            cp = f"{self.cp}*" if self.cp > 1 else ""
            raise ValueError(f"world size {world_size} != tp*{'cp*' if cp else ''}pp*dp = {self.tp}*"
                             f"{cp}{self.pp}*{self.dp if self.dp is not None else '?'}; launch that "
                             f"many processes or change --tp/--cp/--pp/--dp")
        grid = RankGrid(tp=self.tp, cp=self.cp, pp=self.pp, dp=dp, order=self.order)
        ExpertGrid(grid, self.expert_model_parallel_size, self.expert_tensor_parallel_size)
        return grid
