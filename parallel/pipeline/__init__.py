"""Pipeline parallelism: layer partitioning, schedules as data, p2p transfers, one executor,
bubble accounting and timelines.

    parts = stage_layers(num_layers, pp, vp, ps.pp_rank)          # this rank's layer ranges
    lists = build_schedule("1f1b", pp, num_microbatches, vp)       # validated by the tests
    result = run_schedule(ps, lists, chunks, forward_step, num_microbatches,
                          tensor_shape, dtype, timeout_s)
"""
from parallel.pipeline.bubble import (BubbleMeasurement, SimResult, measured_bubble, simulate,
                                      theoretical_bubble)
from parallel.pipeline.executor import (PipelineEvent, PipelineResult, run_schedule,
                                        sum_embedding_grads)
from parallel.pipeline.p2p import PipelineCommError, Transfer, communicate, init_p2p
from parallel.pipeline.partition import partition_layers, stage_layers, virtual_stage
from parallel.pipeline.schedules import (SCHEDULES, Action, Kind, ScheduleError, build_schedule,
                                         validate_schedule)
from parallel.pipeline.timeline import (TimelineEvent, chrome_trace, gather_events,
                                        write_chrome_trace)

__all__ = [
    "Action", "BubbleMeasurement", "Kind", "PipelineCommError", "PipelineEvent", "PipelineResult",
    "SCHEDULES", "ScheduleError", "SimResult", "TimelineEvent", "Transfer", "build_schedule",
    "chrome_trace", "communicate", "gather_events", "init_p2p", "measured_bubble",
    "partition_layers", "run_schedule", "simulate", "stage_layers", "sum_embedding_grads",
    "theoretical_bubble", "validate_schedule", "virtual_stage", "write_chrome_trace",
]
