"""engine.dryrun with mixture-of-experts layers: every rank of small MoE layouts (ep 2 over dp 2,
with pp 2 and with tp 2; ZeRO-1 with ep 1) against the same rank's first step of a real run on 4
gloo ranks, and a Mixtral-8x7B-class model on 512 ranks within two minutes of CPU.

Against the real step: parameter, gradient and optimizer bytes exactly; every collective but the
dispatch all-to-alls (op, group, ranks, dtype, bytes, in issue order); the dispatch's collectives
in number and, since a rank always sends its T K routed rows and receives what its EP peers route
to it, in bytes summed over each EP group, which the dry run's balanced routing gives every rank
(and the planner prices); the experts each rank builds. With the allgather dispatcher a rank's
collectives do not depend on the routing: every real rank's EP bytes equal the planner's
(engine/plan/moe_allgather.py). Activations are not compared: with real routing they depend on how
many rows each rank's experts receive.
"""
from __future__ import annotations

import pytest

from engine.config.cli import parse_args
from engine.dryrun import dry_run, prepare, record_roles
from engine.dryrun.record import MEMORY_KEYS, record_role
from engine.dryrun.roles import rank_roles
from engine.plan.traffic import step_traffic
from engine.training.memory_check import planner_inputs
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import SUITE_RULES, record_comm, run_distributed

TINY = ["--mock-data", "--vocab-size", "500", "--no-progress", "--device", "cpu",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--train-iters", "1", "--lr-warmup-iters", "0", "--peak-tflops", "1",
        "--no-log-straggler", "--num-experts", "4", "--moe-router-topk", "2"]
LAYOUTS = {  # 4 ranks each
    "gpt2 pp2 dp2 ep2, MoE layers 1-3, shared expert, aux loss, fp32": TINY + [
        "--pp", "2", "--ep", "2", "--moe-layer-freq", "[0,1,1,1]",
        "--moe-shared-expert-intermediate-size", "32", "--moe-aux-loss-coeff", "0.01",
        "--precision", "fp32", "--global-batch-size", "8", "--micro-batch-size", "1"],
    "llama tp2 dp2 ep2, sigmoid, seq aux and z-loss, bf16": TINY + [
        "--block", "llama", "--tp", "2", "--ep", "2", "--moe-router-score-function", "sigmoid",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
        "--moe-z-loss-coeff", "0.001", "--precision", "bf16", "--global-batch-size", "8",
        "--micro-batch-size", "2"],
    "gpt2 tp2 dp2 ep2 etp2, shared expert, aux loss, bf16": TINY + [
        "--tp", "2", "--ep", "2", "--etp", "2", "--moe-shared-expert-intermediate-size", "32",
        "--moe-aux-loss-coeff", "0.01", "--precision", "bf16", "--global-batch-size", "8",
        "--micro-batch-size", "2"],
    "gpt2 tp2 dp2 ep2 etp2 sp, shared expert, full recompute, bf16": TINY + [
        "--tp", "2", "--ep", "2", "--etp", "2", "--sequence-parallel",
        "--moe-shared-expert-intermediate-size", "32", "--recompute", "full",
        "--moe-aux-loss-coeff", "0.01", "--precision", "bf16", "--global-batch-size", "8",
        "--micro-batch-size", "2"],
    "llama tp2 dp2 ep2 etp2 sp, bf16": TINY + [
        "--block", "llama", "--tp", "2", "--ep", "2", "--etp", "2", "--sequence-parallel",
        "--moe-aux-loss-coeff", "0.01", "--precision", "bf16", "--global-batch-size", "8",
        "--micro-batch-size", "2"],
    "gpt2 pp2 dp2 ep2 allgather, MoE layers 1-3, full recompute, bf16": TINY + [
        "--pp", "2", "--ep", "2", "--moe-layer-freq", "[0,1,1,1]",
        "--moe-token-dispatcher-type", "allgather", "--recompute", "full",
        "--moe-aux-loss-coeff", "0.01", "--precision", "bf16", "--global-batch-size", "8",
        "--micro-batch-size", "2"],
    "llama tp2 dp2 ep2 etp2 sp allgather, shared expert, padded capacity, full recompute, fp32":
        TINY + ["--block", "llama", "--tp", "2", "--ep", "2", "--etp", "2", "--sequence-parallel",
                "--moe-token-dispatcher-type", "allgather", "--moe-shared-expert-intermediate-size",
                "32", "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
                "--recompute", "full", "--precision", "fp32", "--global-batch-size", "8",
                "--micro-batch-size", "2"],
    "gpt2 dp4 ep1, ZeRO-1, bf16": TINY + [
        "--use-distributed-optimizer", "--precision", "bf16", "--moe-aux-loss-coeff", "0.01",
        "--global-batch-size", "8", "--micro-batch-size", "2"],
}
KEYS = ("dp_comm_bytes", "tp_comm_bytes", "pp_comm_bytes", *MEMORY_KEYS)


def _event(e) -> tuple:
    """A collective as compared: the dispatch's bytes depend on the routing, not its shape."""
    return e.op, e.group, tuple(e.ranks), e.dtype, None if e.group == "ep" else e.payload_bytes


def _real_first_steps(ps, layouts):
    from engine.training.trainer import Trainer
    out = []
    for argv in layouts:
        trainer = Trainer(parse_args(argv))
        with record_comm(trainer.ps) as events:
            record = trainer.train_one(0)
        held = {m.layer_idx: list(m.experts.local) for c in trainer.chunks for m in c.modules()
                if hasattr(getattr(m, "experts", None), "local")}
        out.append({"events": [_event(e) for e in events],
                    "ep_bytes": sum(e.payload_bytes for e in events if e.group == "ep"),
                    "metrics": {k: record[k] for k in KEYS}, "held": held})
        trainer.close()
    return out


@pytest.fixture(scope="module")
def real_steps():
    results = run_distributed(_real_first_steps, grid=RankGrid(dp=4), args=(list(LAYOUTS.values()),))
    return {name: [results[r][i] for r in range(4)] for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_dry_run_equals_a_real_step(real_steps, name):
    cfg, grid, _ = prepare(parse_args(LAYOUTS[name]), 4)
    roles = [rec.role for rec in record_roles(cfg, grid, SUITE_RULES, 4)]
    assert sorted(r for role in roles for r in role.ranks) == list(range(4))
    shape, layout = planner_inputs(cfg, grid)
    ep = cfg.parallel.expert_model_parallel_size
    for role in roles:
        records = {r: record_role(cfg, grid, role, SUITE_RULES, 4, rank=r) for r in role.ranks}
        for rank, rec in records.items():
            real = real_steps[name][rank]
            assert [_event(e) for e in rec.events] == real["events"], (name, rank)
            assert {k: rec.metrics[k] for k in KEYS} == real["metrics"], (name, rank)
            # the experts built: those the role says this rank's EP position holds
            moe = rec.holds["moe"]
            first, last = moe["experts_of_ep_rank"][moe["ep_rank_of"][rank]]
            assert rec.holds["experts_held"] == real["held"] == {
                layer: list(range(first, last + 1)) for layer in real["held"]}, (name, rank)
            assert moe["experts_per_rank"] == 4 // ep and rec.role.moe_layers == len(real["held"])
        # balanced routing: every rank sends and receives T K rows; a real EP group in sum the same
        dry_ep = {rec.comm["ep"]["payload_bytes"] for rec in records.values()}
        assert len(dry_ep) == 1
        planned = step_traffic(shape, layout, role.stage)["ep"]
        assert dry_ep == {planned}
        if cfg.parallel.expert_tensor_parallel_size > 1:  # the planner's ETP-aware figures
            assert layout.etp == 2 and all(r.holds["moe"]["etp"] == 2 for r in records.values())
            whole = None  # under SP the dry run's tp bytes at ETP 1 (the dense SP terms cancel)
            if layout.sequence_parallel:
                argv = LAYOUTS[name] + ["--etp", "1"]
                cfg1, grid1, _ = prepare(parse_args(argv), 4)
                whole = {r: record_role(cfg1, grid1, role, SUITE_RULES, 4, rank=r).metrics[
                    "tp_comm_bytes"] for r in role.ranks}
            _planner_equals_dry_run(records, shape, layout, role.stage, whole)
        if ep > 1:
            assert planned > 0
            for group in {tuple(g) for g in _ep_groups(grid, ep) if set(g) <= set(role.ranks)}:
                assert sum(real_steps[name][r]["ep_bytes"] for r in group) == ep * planned, group
        if cfg.model.moe_token_dispatcher_type == "allgather":  # whatever the routing: every rank
            assert shape.moe.dispatcher == "allgather"
            assert {real_steps[name][r]["ep_bytes"] for r in role.ranks} == {planned}


def _planner_equals_dry_run(records, shape, layout, stage, tp_at_etp1=None):
    """Weights, gradients, TP, EP and EDP bytes of the planner at the run's ETP equal the dry run's
    (which equal the real step's), and differ from its ETP = 1 figures. Under sequence parallelism
    the planner prices Megatron's dense SP collectives (docs/planner.md), so there the TP bytes
    that ETP adds or saves are compared: the dry run's at the run's ETP less ``tp_at_etp1`` (the
    dry run of the same layout at ETP 1, per rank) against the planner's difference."""
    from dataclasses import replace

    from engine.plan.memory import stage_memory
    mem, traffic = stage_memory(shape, layout, stage), step_traffic(shape, layout, stage)
    whole = stage_memory(shape, replace(layout, etp=1), stage)
    tp_whole = step_traffic(shape, replace(layout, etp=1), stage)["tp"]
    for rank, rec in records.items():
        m = rec.metrics
        assert (m["param_bytes"], m["grad_bytes"]) == (mem.weights, mem.grads)
        assert m["param_bytes"] < whole.weights
        if tp_at_etp1 is None:
            assert m["tp_comm_bytes"] == traffic["tp"] > tp_whole
        else:  # SP: ETP 1 sums every expert's gradient over TP once per step, ETP 2 gathers
            assert m["tp_comm_bytes"] - tp_at_etp1[rank] == traffic["tp"] - tp_whole != 0
        assert (rec.comm["ep"]["payload_bytes"], rec.comm["edp"]["payload_bytes"]) == \
            (traffic["ep"], traffic["edp"])


def _ep_groups(grid, ep):
    from parallel.grid.expert_groups import ExpertGrid
    return ExpertGrid(grid, ep).groups("ep")


def test_moe_roles_count_the_moe_layers_of_each_stage():
    """[0,1,1,1] over pp 2: stage 0 holds one MoE layer, stage 1 two; over pp 4 stages 1-3 hold
    one each (one role) and stage 0 none, although every stage holds one layer."""
    cfg, grid, _ = prepare(parse_args(LAYOUTS["gpt2 pp2 dp2 ep2, MoE layers 1-3, shared expert, "
                                              "aux loss, fp32"]), 4)
    assert [(r.name, r.moe_layers) for r in rank_roles(cfg, grid)] == [("first stage", 1),
                                                                      ("last stage", 2)]
    argv = TINY + ["--pp", "4", "--moe-layer-freq", "[0,1,1,1]", "--global-batch-size", "8"]
    cfg, grid, _ = prepare(parse_args(argv), 4)
    assert [(r.stages, r.moe_layers) for r in rank_roles(cfg, grid)] == [
        ((0,), 0), ((1, 2), 1), ((3,), 1)]


MIXTRAL = ["--mock-data", "--vocab-size", "32000", "--num-layers", "32", "--hidden-size", "4096",
           "--num-attention-heads", "32", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
           "--block", "llama", "--seq-length", "4096", "--micro-batch-size", "1",
           "--global-batch-size", "64", "--precision", "bf16", "--num-experts", "8",
           "--moe-router-topk", "2", "--tp", "8", "--pp", "4", "--ep", "8", "--no-progress"]


def test_mixtral_8x7b_on_512_ranks_in_under_two_cpu_minutes(tmp_path):
    from tests.engine.dryrun.test_dryrun import _run_cli
    doc, cpu, wall, rss, stdout = _run_cli(["--world-size", "512", "--device", "h100", *MIXTRAL],
                                           tmp_path)
    assert cpu < 120, f"512 ranks took {cpu:.1f} CPU seconds ({wall:.1f} s wall)"
    roles = doc["roles"]
    assert [r["name"] for r in roles] == ["first stage", "middle stages", "last stage"]
    assert sum(len(r["ranks"]) for r in roles) == 512
    for role in roles:
        holds = role["holds"]
        # 8 layers per stage, one of the 8 experts per EP rank: 8 x 3 x 4096 x 14336 expert weights
        assert holds["expert_parameters"] == 8 * 3 * 4096 * 14336
        assert len(holds["experts_held"]) == 8 and holds["moe"]["experts_per_rank"] == 1
        assert sorted(set(holds["moe"]["ep_rank_of"].values())) == list(range(8))
        planner = {row["figure"]: row for row in role["planner"]}
        for figure in ("param_bytes", "grad_bytes", "optimizer_state_bytes", "ep_comm_bytes",
                       "edp_comm_bytes", "dp_comm_bytes"):
            assert not planner[figure]["flagged"], (role["name"], planner[figure])
        groups = {c["group"] for c in role["collectives"]}
        assert {"ep", "edp", "tp", "pp", "dp"} <= groups
    assert "DOES NOT FIT" not in stdout
    assert "ep           ep        all_to_all" in stdout


def test_capacity_without_padding_is_refused_by_the_dry_run():
    argv = TINY + ["--ep", "2", "--global-batch-size", "8", "--moe-expert-capacity-factor", "1.0"]
    with pytest.raises(Exception, match="capacity"):
        dry_run(parse_args(argv), 2)
    padded = dry_run(parse_args(argv + ["--moe-pad-expert-input-to-capacity"]), 2)
    assert padded.records[0].comm["ep"]["payload_bytes"] > 0
