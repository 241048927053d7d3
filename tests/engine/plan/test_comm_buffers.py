"""The planner's communicator buffers with DP gradient compression: the exchange worker's own
DP x CP communicator (parallel/runtime/lanes.py) is one more group's buffers, and the dry run, which
builds the run's groups, counts the same."""
from __future__ import annotations

from dataclasses import replace

from engine.config.cli import parse_args
from engine.plan.memory import communicators, stage_memory
from engine.plan.model import COMM_BUFFER_BYTES, Layout, ModelShape
from engine.training.memory_check import planner_inputs

SHAPE = ModelShape(4, 64, 4, 100, 32, 8)
TINY = ["--mock-data", "--vocab-size", "500", "--no-progress", "--device", "cpu",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--train-iters", "1", "--lr-warmup-iters", "0",
        "--global-batch-size", "4", "--micro-batch-size", "1"]


def test_compression_adds_one_communicator_of_buffers():
    for layout in (Layout(tp=2, pp=2, dp=2), Layout(tp=1, pp=1, dp=4, cp=2), Layout(tp=2, pp=1, dp=2)):
        plain = stage_memory(SHAPE, layout, 0, "hccl")
        compressed = stage_memory(SHAPE, replace(layout, compression=True), 0, "hccl")
        assert compressed.comm_buffers - plain.comm_buffers == COMM_BUFFER_BYTES["hccl"], layout
        assert compressed.total - plain.total == 2 * 200 * 2 ** 20          # 2 x HCCL_BUFFSIZE
    # without data parallelism there is no exchange, and no group for it
    alone = Layout(tp=2, pp=2, dp=1)
    assert communicators(replace(alone, compression=True), True) == communicators(alone, True)


def test_the_run_tells_the_planner_it_compresses():
    grid = lambda cfg: cfg.parallel.grid(2)  # noqa: E731
    for flags, want in ((["--grad-compression", "int8"], True), ([], False),
                        (["--grad-compression-policy",
                          '{"default": "none", "rules": [{"pattern": "*mlp*", "compressor": "int8"}]}'],
                         True)):
        cfg = parse_args(TINY + flags)
        _, layout = planner_inputs(cfg, grid(cfg))
        assert layout.compression is want, flags


def test_the_dry_run_counts_the_exchange_communicator():
    from engine.dryrun import dry_run
    counts = {}
    for flags in ([], ["--grad-compression", "int8"]):
        result = dry_run(parse_args(TINY + ["--dp", "2"] + flags), 2, "ascend910b2")
        assert not isinstance(result.comparison, str), result.comparison
        (record,), (rows,) = result.records, result.comparison
        row = next(r for r in rows if r.figure == "comm_buffer_bytes")
        assert row.dry_run == row.planner, (flags, row)            # planner and build agree
        counts[bool(flags)] = record.communicators
    assert counts[True] == counts[False] + 1
