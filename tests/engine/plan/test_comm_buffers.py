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
        # 2 x HCCL_BUFFSIZE, beside the residuals (test_compression_residuals_are_optimizer_state)
        assert compressed.total - plain.total - compressed.compression == 2 * 200 * 2 ** 20
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


# TINY's weights, by hand: per layer QKV 64x192+192, proj 64x64+64, fc1 64x256+256, fc2 256x64+64,
# two LayerNorms 4x64; the embedding 512x64 (V 500 padded to 128), positions 32x64, final norm 128
TINY_WEIGHTS = 2 * (64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64 + 4 * 64) \
    + 512 * 64 + 32 * 64 + 2 * 64


def test_compression_residuals_are_optimizer_state():
    """int8 keeps an fp32 residual of every weight (4 bytes) and, without ZeRO, the owner's
    residual of its 1/dp shard (4/dp): the planner's compression term, and the dry run's
    optimizer_state_bytes over the uncompressed run's by exactly that (torch's AdamW step
    counters aside: the planner's row is within them)."""
    n = TINY_WEIGHTS
    runs = {}
    for flags in ([], ["--grad-compression", "int8"], ["--grad-compression", "int8",
                                                       "--use-distributed-optimizer"]):
        cfg = parse_args(TINY + ["--dp", "2"] + flags)
        shape, layout = planner_inputs(cfg, cfg.parallel.grid(2))
        runs[len(flags)] = (stage_memory(shape, layout, 0).compression, cfg)
    assert [runs[k][0] for k in (0, 2, 3)] == [0, 6 * n, 4 * n]     # 4 + 4/2; ZeRO: 4
    from engine.dryrun import dry_run
    state = {}
    for k in (0, 2):
        result = dry_run(runs[k][1], 2, "ascend910b2")
        row = next(r for r in result.comparison[0] if r.figure == "optimizer_state_bytes")
        assert 0 <= row.dry_run - row.planner < 1024, row      # AdamW's 4-byte step counters
        state[k] = row.dry_run
    assert state[2] - state[0] == 6 * n
    # the memory check at start counts them: a device with room for all but the residuals refuses
    from engine.training.memory_check import memory_problem
    cfg = runs[2][1]
    grid = cfg.parallel.grid(2)
    room = int(stage_memory(*planner_inputs(cfg, grid), 0).total - 6 * n) + 1
    assert memory_problem(runs[0][1], grid, 0, room, "free", "gloo") is None
    assert memory_problem(cfg, grid, 0, room, "free", "gloo").startswith(
        f"this run needs about {(room - 1 + 6 * n) / 2 ** 20:.3g} MiB")


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
