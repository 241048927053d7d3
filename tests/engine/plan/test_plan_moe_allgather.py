"""The allgather dispatcher in the planner (engine/plan/moe_allgather.py): its bytes counted by hand
from what parallel/expert_parallel/allgather.py gathers and reduce-scatters, their time over the
links the EP ranks span, what it keeps in memory, and the command line planning it
(tests/engine/dryrun/test_dryrun_moe.py checks the bytes against real steps)."""
import json
import shlex
from dataclasses import replace

import pytest

from engine.plan.flops import MoEShape
from engine.plan.hardware import DEVICE_SPECS
from engine.plan.memory import moe_activation_change, stage_memory
from engine.plan.model import COLLECTIVE_LATENCY_S, Cluster, Layout, ModelShape
from engine.plan.timing import estimate, layout_links, moe_layer_change
from engine.plan.traffic import ep_per_layer
from engine.tools import plan_cli

H100 = DEVICE_SPECS["h100"]
H, S, E, K, FE, FS = 64, 32, 8, 2, 96, 32
MOE = MoEShape(2, E, K, FE, FS, dispatcher="allgather")
SMALL = ModelShape(4, H, 4, 500, S, 64, 256, "gpt2", moe=MOE, moe_layers=(1, 3))


def by_hand(p: int, t: float, e: int = 2, table: float | None = None, redo: str = "") -> float:
    """Payload bytes of one MoE layer and micro-batch: all-gathers count the rank's shard,
    reduce-scatters their whole (P T, .) input; ``redo``: "gathers" or "all" recomputed."""
    table = 4 * t * K if table is None else table
    gathers = table + e * t * H + 4 * t * K          # routing table, tokens, router weights
    combine = 4 * p * t * H                           # the fp32 sum over every EP rank's tokens
    backward = 4 * t * H + 4 * p * t * K + e * p * t * H
    return gathers + combine + backward + {"": 0, "gathers": gathers, "all": gathers + combine}[redo]


def test_bytes_are_every_ep_ranks_tokens_whatever_the_routing():
    t = S * 2                                         # micro-batch 2
    lay = Layout(1, 1, 8, micro_batch_size=2, ep=4)
    assert ep_per_layer(SMALL, lay) == by_hand(4, t)
    # full recomputation: the gathers again; the combine's reduce-scatter too where the
    # recomputation runs past it (a shared expert after it, or no early stop)
    full = replace(lay, recompute="full")
    assert ep_per_layer(SMALL, full) == by_hand(4, t, redo="all")
    alone = replace(SMALL, moe=replace(MOE, shared_ffn=0))
    assert ep_per_layer(alone, full) == by_hand(4, t, redo="gathers")
    assert ep_per_layer(replace(alone, recompute_early_stop=False), full) == by_hand(4, t, redo="all")
    # padded to capacity: the table is the E C slots, C = ceil(1.5 T K / E) = 24; fp32 tokens
    padded = replace(SMALL, moe=replace(MOE, padded_capacity_factor=1.5), activation_bytes=4)
    assert ep_per_layer(padded, lay) == by_hand(4, t, e=4, table=4 * E * 24)
    # sequence parallelism: a rank's own shard; ETP with it: the TP group's tokens
    sp = replace(lay, tp=2, dp=4, sequence_parallel=True)
    assert ep_per_layer(SMALL, sp) == by_hand(4, t / 2)
    assert ep_per_layer(SMALL, replace(sp, etp=2)) == by_hand(4, t)
    assert ep_per_layer(SMALL, replace(lay, ep=1)) == 0
    # not the alltoall's figure
    assert ep_per_layer(replace(SMALL, moe=replace(MOE, dispatcher="alltoall")), lay) != by_hand(4, t)


def test_time_is_the_gathers_and_reduce_scatters_over_the_ep_links():
    """Each collective moves (P-1)/P of its whole (P x shard) buffer at the EP group's bus
    bandwidth, one latency each: 4 forward, 3 backward; with tp 8 the 8 EP ranks sit on 8
    nodes (their network shares), with tp 1 on one (NVLink). All exposed, per micro-batch."""
    c = Cluster.from_device(H100, 64)
    t = S                                            # micro-batch 1
    whole = [8 * 4 * t * K, 8 * 2 * t * H, 8 * 4 * t * K, 4 * 8 * t * H,      # forward
             4 * 8 * t * H, 4 * 8 * t * K, 2 * 8 * t * H]                      # backward
    for tp, gbps in ((1, c.intra_busbw_gbps), (8, c.inter_busbw_gbps)):
        lay = Layout(tp=tp, pp=1, dp=64 // tp, ep=8)
        change = moe_layer_change(SMALL, c, lay, layout_links(c, lay))
        want = sum(7 / 8 * w / (gbps * 1e9) + COLLECTIVE_LATENCY_S for w in whole)
        assert change.ep_comm == pytest.approx(want, rel=1e-12), tp
        est = estimate(SMALL, c, lay)
        assert est.time.ep_comm == pytest.approx(64 // (64 // tp) * 2 * change.ep_comm, rel=1e-12)


def test_memory_keeps_the_gathered_sort_and_a_combine_sized_transient():
    """Beside the alltoall's: the int64 sort of all P T K gathered assignments (dropless; padded
    to capacity nothing more than the alltoall's E C rows), and within the layer the fp32 (P T, h)
    sum of the combine."""
    alltoall = replace(SMALL, moe=replace(MOE, dispatcher="alltoall"))
    t = S * 2
    for ep in (2, 8):
        lay = Layout(1, 1, 8, micro_batch_size=2, ep=ep)
        assert moe_activation_change(SMALL, lay) - moe_activation_change(alltoall, lay) == 8 * ep * t * K
        gathered, plain = stage_memory(SMALL, lay, 0), stage_memory(alltoall, lay, 0)
        assert gathered.transient - plain.transient == 4 * ep * t * H
        assert gathered.activations - plain.activations == 2 * 8 * ep * t * K   # 2 MoE layers
    padded = replace(SMALL, moe=replace(MOE, padded_capacity_factor=1.5))
    padded_alltoall = replace(alltoall, moe=replace(alltoall.moe, padded_capacity_factor=1.5))
    lay = Layout(1, 1, 8, micro_batch_size=2, ep=4)
    assert moe_activation_change(padded, lay) == moe_activation_change(padded_alltoall, lay)
    # both keep the E C rows padded to capacity, more than the dropless T K
    assert moe_activation_change(padded, lay) > moe_activation_change(alltoall, lay)


ARGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
        "--vocab-size", "1000", "--seq-length", "256", "--global-batch-size", "64",
        "--num-experts", "8", "--moe-router-topk", "2", "--device", "h100", "--devices", "16",
        "--ep", "4", "--json", "--top", "5"]


def test_the_command_line_plans_the_allgather_dispatcher(capsys):
    """Planned, not refused: the rows price its collectives (not the all-to-alls') and every
    printed command runs it (engine.train's parser reads the flag back)."""
    from torch.distributed.run import get_args_parser
    from engine.config.cli import parse_args
    assert plan_cli.main(ARGS) == 0
    alltoall = {json.loads(line)["command"]: json.loads(line)
                for line in capsys.readouterr().out.splitlines()}
    assert plan_cli.main(ARGS + ["--moe-token-dispatcher-type", "allgather"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and all(row["ep"] == 4 for row in rows)
    for row in rows:
        argv = shlex.split(row["command"])
        cfg = parse_args(get_args_parser().parse_args(argv[1:]).training_script_args)
        assert cfg.model.moe_token_dispatcher_type == "allgather"
        twin = alltoall.get(row["command"].replace(" --moe-token-dispatcher-type allgather", ""))
        if twin is not None:
            assert row["time_terms"]["ep_comm"] != twin["time_terms"]["ep_comm"]
