"""ZeRO-3 (``--data-parallel-sharding-strategy optim_grads_params``) and the optimizer offload
through the real trainer, in one spawned group of 4 gloo ranks.

The group first runs every 4-rank check, then splits into a (1,1,2) job on ranks 0-1 and the two
serial reference runs on ranks 2 and 3 (single processes, no process group), so the references
are computed beside the rest by the plain serial code, never by a re-implementation.

- Equivalence: ZeRO-3 trains the serial model over 20 steps within docs/design.md's relative
  1e-4 per step at (tp, pp, dp) = (1,1,2), (1,1,4), (2,1,2) with SP, (1,2,2) interleaved with full
  recomputation and (1,2,2) zb-v, cp 2 x dp 2 (GQA), and MoE with ep 2, EDP 2.
- Memory: between steps every parameter's storage holds 0 bytes, and ``param_bytes`` times dp is
  the serial model's parameter bytes (up to the buckets' padding) at dp 2 and 4; gradients and
  optimizer state follow.
- Streams: gpt2, llama, MoE and the user block DirectNormBlock under the stream-order checker, no
  violation; the same gpt2 run with the gather's wait left out is caught, and so is a bucket
  freed (resized away) while its gather is still in flight.
- Offload, under the checker: a step skipped for a NaN (bf16, no clipping: nothing waited for
  the gradients' copies down) leaves the next step's reduce-scatter ordered after those copies,
  and no bucket gathered.
- Offload: ``--optimizer-cpu-offload`` (its host vectors in chunks of 2 KiB, several per vector:
  parallel/dp/host_flat.py) trains bit for bit the model it trains without, under
  ZeRO-3 and (a fraction 0.5, TP with SP) ZeRO-1: on this CPU host and device memory are the same,
  so equal bits are the claim, not a tolerance. Its state is host memory in the figures.
- Checkpoints: a ZeRO-3 checkpoint at step 10 of (1,1,4) resumes under ZeRO-1 at (1,2,2), and a
  ZeRO-1 checkpoint at step 5 of (2,1,2) with SP resumes under ZeRO-3 at (1,1,4); both continue
  the serial run to step 20.
- Re-runs: a transient NaN gradient under ``--rerun-on-anomaly`` re-runs its step and the run
  goes on as the clean one.
"""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch.distributed as dist

import parallel.dp.host_flat as host_flat
import parallel.dp.zero3 as zero3
from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.observe.faults import GradFault
from engine.training.trainer import Trainer, TrainingDiverged
from parallel.dp.zero import DistributedOptimizer
from parallel.grid.launch import LaunchEnv
from parallel.runtime import streams
from parallel.grid.state import ParallelState
from parallel.runtime.stream_check import StreamChecker
from parallel.grid.topology import RankGrid
from engine.fuzz.pool import free_port
from tests.helpers.dist_utils import run_distributed

STEPS = 20
SHORT = 5    # the offload's bit-equality runs, and the ZeRO-1 checkpoint's step
BASE = ["--mock-data", "--vocab-size", "64", "--no-progress", "--device", "cpu",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--precision", "fp32",
        "--lr", "2e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "constant",
        "--timeout-s", "60"]
DENSE = ["--num-layers", "2", "--num-query-groups", "2"]
DEEP = ["--num-layers", "4", "--num-query-groups", "2"]   # 4 virtual stages on pp 2
MOE = ["--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "24"]
Z3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--bucket-size-mb", "0.02"]
Z1 = ["--data-parallel-sharding-strategy", "optim", "--bucket-size-mb", "0.02"]
OFFLOAD = ["--optimizer-cpu-offload"]
MODELS = {"dense": DENSE, "deep": DEEP, "moe": MOE}
LAYOUTS = {   # name: (model, flags) of the ZeRO-3 runs compared with serial
    "(1,1,4)": ("dense", ["--dp", "4"]),
    "(2,1,2) sp": ("dense", ["--tp", "2", "--dp", "2", "--sequence-parallel"]),
    "(1,2,2) interleaved": ("deep", ["--pp", "2", "--dp", "2", "--pipeline-schedule",
                                    "interleaved", "--virtual-pipeline-size", "2",
                                    "--recompute", "full"]),
    "(1,2,2) zb-v": ("deep", ["--pp", "2", "--dp", "2", "--pipeline-schedule", "zb-v"]),
    "cp2 dp2": ("dense", ["--cp", "2", "--dp", "2"]),
    "moe ep2 edp2": ("moe", ["--dp", "4", "--ep", "2"]),
}
CHECKED = ["--mock-data", "--vocab-size", "64", "--no-progress", "--device", "cpu",
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
           "--precision", "fp32", "--train-iters", "2", "--timeout-s", "60",
           "--data-parallel-sharding-strategy", "optim_grads_params", "--bucket-size-mb", "0.001"]
BLOCKS = {"gpt2": ["--block", "gpt2"], "llama": ["--block", "llama"],
          "moe": ["--block", "gpt2", "--ep", "2", "--num-experts", "4", "--moe-router-topk", "2",
                  "--moe-ffn-hidden-size", "24"],
          "user": ["--block", "tests.helpers.blocks:DirectNormBlock"]}


def _train(argv: list[str], launch=None, fault=None) -> dict:
    """Losses, memory figures and what the parameters hold after a run of ``BASE + argv``
    (``fault``: a GradFault planted first)."""
    trainer = Trainer(parse_args(BASE + argv), launch=launch)
    if fault is not None:
        fault.install(trainer)
    try:
        records = trainer.train().records
        losses = [r["loss"] for r in records]
        opt = trainer.optimizer
        params = [p for c in trainer.chunks for p in c.parameters()]
        out = {"losses": losses, "grad_norms": [r["grad_norm"] for r in records],
               "memory": dict(trainer.memory),
               "numel": sum(p.numel() for p in params),
               "storage": sum(p.untyped_storage().nbytes() for p in params),
               "dp": trainer.ps.dp_size * trainer.ps.cp_size,
               "reruns": [r.get("rerun") for r in records]}
        offload = getattr(opt, "offload", None)
        if offload is not None:
            out["host_chunks"] = len(offload.master.chunks)
        store = getattr(opt, "param_gather", None)
        if getattr(store, "shards", None) is not None:   # ZeRO-3: the persistent shards
            out["shard_bytes"] = sum(t.untyped_storage().nbytes() for t in store.shards.values())
            out["buckets"] = len(store.shards)
        return out
    finally:
        trainer.close()


def _checked(argv: list[str], planted: bool = False, fault=None) -> list[str]:
    checker = StreamChecker()
    with checker.installed():
        trainer = Trainer(parse_args(CHECKED + argv))
        if fault is not None:
            fault.install(trainer)
        try:
            trainer.train()
        except TrainingDiverged:   # the planted defect: reads of unfinished gathers (every rank)
            assert planted
        finally:
            trainer.close()
    return list(checker.violations)


def _free_in_flight(planted: bool) -> list[str]:
    """A bucket's gather started and its storage freed at once, under the checker: ``free``
    waits for the gather first; planted, the storage is resized away with the collective waited
    for behind the stream API's back (on a GPU: no stream waits, and the gather writes into a
    block the allocator has handed on)."""
    trainer = Trainer(parse_args(CHECKED + BLOCKS["gpt2"]))
    store = trainer.optimizer.param_gather
    checker = StreamChecker()
    try:
        with checker.installed():
            store.gather([0])
            if planted:
                store._handles.pop(0).work.wait()     # the backend's own handle: unseen
                streams.released(store.full[0], resized=True)
                zero3._resize(store.full[0], 0)
                store.state[0] = zero3.FREE
            else:
                store.free([0])
    finally:
        trainer.close()
    return list(checker.violations)


def _unwaited_ensure(self, indices):
    """The defect the checker must see: the gather is started and its wait left out."""
    self.gather(indices)
    for i in indices:
        if self.state[i] == zero3.GATHERING:
            self.state[i] = zero3.READY


def _group_checks(ckpt: str) -> dict:
    """Every check of the 4-rank group (the checkpoints under ``ckpt``)."""
    out = {}
    z3_save = ["--save", f"{ckpt}/z3", "--save-interval", "10"]
    for name, (model, flags) in LAYOUTS.items():
        extra = z3_save if name == "(1,1,4)" else []
        out[name] = _train(MODELS[model] + flags + Z3 + ["--train-iters", str(STEPS)] + extra)
    fault = GradFault(rank=1, step=2, param="layers.1.mlp.fc2.weight")   # a NaN, once
    out["(1,1,4) rerun"] = _train(DENSE + ["--dp", "4"] + Z3 + ["--train-iters", "3",
                                                                "--rerun-on-anomaly"], fault=fault)
    # host chunks of 2 KiB: the model's few KiB of offloaded state in several (host_flat.py)
    with mock.patch.object(host_flat, "CHUNK_BYTES", 2048):
        out["(1,1,4) offload"] = _train(DENSE + ["--dp", "4"] + Z3 + OFFLOAD +
                                        ["--train-iters", str(SHORT)])
    tpsp = DENSE + ["--tp", "2", "--dp", "2", "--sequence-parallel"] + Z1 + \
        ["--train-iters", str(SHORT)]
    out["zero1 (2,1,2) sp"] = _train(tpsp + ["--save", f"{ckpt}/z1"])
    with mock.patch.object(host_flat, "CHUNK_BYTES", 2048):
        out["zero1 (2,1,2) sp offload 0.5"] = _train(tpsp + OFFLOAD +
                                                     ["--optimizer-offload-fraction", "0.5"])
    out["zero3 ckpt -> zero1 (1,2,2)"] = _train(
        DENSE + ["--pp", "2", "--dp", "2"] + Z1 +
        ["--train-iters", str(STEPS), "--load", f"{ckpt}/z3/iter_0000010"])
    out["zero1 ckpt -> zero3 (1,1,4)"] = _train(
        DENSE + ["--dp", "4"] + Z3 + ["--train-iters", str(STEPS), "--load", f"{ckpt}/z1"])
    for name, block in BLOCKS.items():
        out["checked " + name] = _checked(block)
    with mock.patch.object(zero3.ShardedParams, "ensure", _unwaited_ensure):
        out["checked planted"] = _checked(BLOCKS["gpt2"], planted=True)
    out["free in flight"] = _free_in_flight(False)
    out["free in flight planted"] = _free_in_flight(True)
    # a NaN skips step 1 before anything waits for its gradients' copies down: the next step's
    # reduce-scatter must still be ordered after them
    out["gathered after skip"] = []
    with _gathered_after_skips(out["gathered after skip"]):
        out["checked offload skip"] = _checked(
            BLOCKS["gpt2"] + OFFLOAD + ["--precision", "bf16", "--clip-grad", "0",
                                        "--train-iters", "3"],
            fault=GradFault(rank=1, step=1, param="layers.1.mlp.fc2.weight"))
    return out


def _gathered_after_skips(seen: list):
    """Record the buckets still gathered after each skipped step."""
    real = DistributedOptimizer.skipped_step

    def skipped_step(self):
        real(self)
        seen.append(list(self.param_gather.gathered))
    return mock.patch.object(DistributedOptimizer, "skipped_step", skipped_step)


SERIAL = {2: ["dense"], 3: ["deep", "moe"]}   # rank: the serial runs it does


def _split(ps) -> dict:
    """After the group's checks: ranks 0-1 run the (1,1,2) job on a process group of their own
    (its rendezvous on a port rank 0 chose just now), ranks 2 and 3 the serial runs."""
    port = [free_port() if ps.rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    ps.destroy()              # the 4-rank group is done (the harness's destroy then finds none)
    rank = ps.rank
    if rank < 2:
        os.environ.update(MASTER_PORT=str(port[0]), RANK=str(rank), WORLD_SIZE="2")
        launch = LaunchEnv(rank, 2, rank, 2)
        return {"(1,1,2)": _train(DENSE + ["--dp", "2"] + Z3 + ["--train-iters", str(STEPS)],
                                  launch)}
    return {f"serial {name}": _train(MODELS[name] + ["--train-iters", str(STEPS)], LaunchEnv())
            for name in SERIAL[rank]}


def group(ps, ckpt: str) -> dict:
    out = _group_checks(ckpt)
    out.update(_split(ps))
    assert not dist.is_initialized()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("zero3_ckpt"))
    return run_distributed(group, grid=RankGrid(dp=4), args=(ckpt,), timeout_s=120)


def _serial(results, model: str) -> dict:
    return next(results[r][f"serial {model}"] for r, names in SERIAL.items() if model in names)


def _close(run: dict, serial: dict, what: str, first: int = 1, last: int | None = None) -> None:
    """``run``'s losses and gradient norms against the serial run's steps ``first``..``last``,
    docs/design.md's relative 1e-4. The norms too: AdamW is nearly blind to a uniform gradient
    scale (a DP sum where a mean belongs moves the loss by under 1e-4 for the first 8 steps and
    the norm by 2x at step 1)."""
    for key in ("losses", "grad_norms"):
        got, want = run[key], serial[key][first - 1:last]
        assert len(got) == len(want), f"{what}: {len(got)} {key}, the serial run {len(want)}"
        for step, (a, b) in enumerate(zip(got, want), start=first):
            assert abs(a - b) <= 1e-4 * abs(b), f"{what}: step {step} {key}: {a} vs serial {b}"


@pytest.mark.parametrize("name", [*LAYOUTS, "(1,1,2)"])
def test_zero3_trains_the_serial_model(results, name):
    serial = _serial(results, LAYOUTS.get(name, ("dense",))[0])
    assert len(serial["losses"]) == STEPS
    ranks = (0, 1) if name == "(1,1,2)" else range(4)
    for rank in ranks:
        _close(results[rank][name], serial, f"{name} rank {rank}")


@pytest.mark.parametrize("name, dp", [("(1,1,2)", 2), ("(1,1,4)", 4)])
def test_parameters_take_one_dp_th(results, name, dp):
    serial = _serial(results, "dense")
    full = 4 * serial["numel"]               # fp32 bytes of the whole serial model
    assert serial["memory"]["param_bytes"] == full
    for rank in range(dp if name == "(1,1,2)" else 4):
        run = results[rank][name]
        mem = run["memory"]
        assert run["dp"] == dp
        assert run["storage"] == 0, "a parameter holds storage between steps"
        assert mem["param_bytes"] == run["shard_bytes"]
        pad = 4 * 16 * dp * run["buckets"]   # each bucket pads to a multiple of 16 x dp
        assert full <= mem["param_bytes"] * dp <= full + pad, (mem, full)
        assert mem["grad_bytes"] == mem["param_bytes"]                  # the gradient shards
        assert mem["optimizer_state_bytes"] == 2 * mem["param_bytes"]   # fp32: shard = master
        assert mem["optimizer_state_host_bytes"] == 0


def test_offload_trains_the_same_model_bit_for_bit(results):
    for rank in range(4):
        plain, off = results[rank]["(1,1,4)"], results[rank]["(1,1,4) offload"]
        assert off["losses"] == plain["losses"][:SHORT] and off["host_chunks"] > 1
        mem = off["memory"]
        assert mem["optimizer_state_bytes"] == 0
        assert mem["optimizer_state_host_bytes"] == 3 * mem["param_bytes"]   # master, moments
        z1 = results[rank]["zero1 (2,1,2) sp"]
        half = results[rank]["zero1 (2,1,2) sp offload 0.5"]
        assert half["losses"] == z1["losses"] and half["host_chunks"] > 1
        assert 0 < half["memory"]["optimizer_state_host_bytes"]
        assert half["memory"]["optimizer_state_bytes"] < z1["memory"]["optimizer_state_bytes"]


def test_a_transient_fault_reruns_the_step(results):
    """--rerun-on-anomaly under ZeRO-3: the step with a NaN gradient runs again from its inputs
    (the shards untouched) and the run goes on as the clean one."""
    for rank in range(4):
        run = results[rank]["(1,1,4) rerun"]
        assert run["losses"] == results[rank]["(1,1,4)"]["losses"][:3]
        assert [bool(r) for r in run["reruns"]] == [False, True, False], run["reruns"]


def test_offload_matches_serial(results):
    serial = _serial(results, "dense")
    for rank in range(4):
        _close(results[rank]["zero1 (2,1,2) sp offload 0.5"], serial, f"offload 0.5 rank {rank}",
               last=SHORT)


@pytest.mark.parametrize("name, step", [("zero3 ckpt -> zero1 (1,2,2)", 10),
                                        ("zero1 ckpt -> zero3 (1,1,4)", SHORT)])
def test_checkpoints_cross_between_zero3_and_zero1(results, name, step):
    serial = _serial(results, "dense")
    for rank in range(4):
        run = results[rank][name]
        assert len(run["losses"]) == STEPS - step, f"{name} did not resume at step {step}"
        _close(run, serial, f"{name} rank {rank}", first=step + 1)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_no_read_before_its_gather(results, block):
    for rank in range(4):
        assert results[rank]["checked " + block] == []


def test_a_bucket_freed_while_its_gather_writes_it_is_caught(results):
    """A resize frees the memory whatever the backend holds: the checker's exemption for comm
    streams (a backend keeps a collective's tensors alive) does not cover it."""
    for rank in range(4):
        assert results[rank]["free in flight"] == []
        planted = results[rank]["free in flight planted"]
        assert any("released while in use" in v and "all_gather on dp" in v for v in planted), \
            planted


def test_a_skipped_step_orders_the_next_reduction_after_its_copies_down(results):
    for rank in range(4):
        assert results[rank]["checked offload skip"] == []


def test_a_skipped_step_frees_every_gathered_bucket(results):
    """The root unit's buckets, gathered from the forward to the step, are freed by a skip too
    (they were kept into the next step once)."""
    for rank in range(4):
        assert results[rank]["gathered after skip"] == [[]]


def test_a_read_before_its_gather_is_caught(results):
    for rank in range(4):
        violations = results[rank]["checked planted"]
        assert violations, "the unwaited gather went unseen"
        assert any("all_gather on dp" in v for v in violations), violations


Z3_FLAG = ["--data-parallel-sharding-strategy", "optim_grads_params"]


@pytest.mark.parametrize("argv, message", [
    (Z3_FLAG + ["--grad-compression", "int8"],
     r"^gradient compression with --data-parallel-sharding-strategy optim_grads_params is not "
     r"built; drop --grad-compression"),
    (Z3_FLAG + ["--grad-compression-policy", '{"default": "int8"}'],
     r"^gradient compression with --data-parallel-sharding-strategy optim_grads_params"),
    (Z3_FLAG + ["--compile"],
     r"^--data-parallel-sharding-strategy optim_grads_params with --compile is not built"),
    (["--optimizer-cpu-offload"], r"^--optimizer-cpu-offload moves the distributed optimizer's "
                                  r"state to host memory: add --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--optimizer-cpu-offload", "--grad-compression", "topk"],
     r"^--optimizer-cpu-offload with --grad-compression topk is not built"),
    (["--use-distributed-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
      "0"], r"^--optimizer-offload-fraction must be in \(0, 1\], got 0.0"),
    (["--data-parallel-sharding-strategy", "no_shard", "--use-distributed-optimizer"],
     r"^--data-parallel-sharding-strategy no_shard contradicts --use-distributed-optimizer"),
    (Z3_FLAG + ["--zero-stage", "2"],
     r"^--data-parallel-sharding-strategy optim_grads_params is ZeRO-3, which contradicts "
     r"--zero-stage 2"),
    (["--zero-stage", "3"], r"^--zero-stage 3 shards the distributed optimizer's gradients and "
                            r"parameters: add --use-distributed-optimizer"),
])
def test_unsupported_combinations_are_refused_in_one_line(monkeypatch, argv, message):
    """Before any process group, on every rank: one line saying what to change."""
    def no_collectives(*args, **kwargs):
        raise AssertionError("the process group was started before the configuration was checked")

    monkeypatch.setattr(ParallelState, "initialize", no_collectives)
    with pytest.raises(ConfigError, match=message) as info:
        Trainer(parse_args(BASE + DENSE + ["--dp", "2"] + argv), launch=LaunchEnv(0, 2, 0, 2))
    assert "\n" not in str(info.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("argv, stage", [
    (["--use-distributed-optimizer"], 1), (["--use-distributed-optimizer", "--zero-stage", "2"], 2),
    (["--use-distributed-optimizer", "--zero-stage", "3"], 3), ([], 0),
    (["--data-parallel-sharding-strategy", "optim_grads"], 2), (Z3_FLAG, 3)])
def test_the_aliases_name_one_strategy(argv, stage):
    par = parse_args(BASE + DENSE + argv).parallel
    assert par.data_parallel_sharding_strategy == ("no_shard", "optim", "optim_grads",
                                                   "optim_grads_params")[stage]
    assert par.use_distributed_optimizer == (stage > 0) and par.zero_stage == max(stage, 1)


def test_the_dry_run_records_zero3_and_the_planner_agrees():
    """engine.dryrun builds a ZeRO-3 run with the offload on the meta device: the parameter
    gathers are recorded in the forward and again in the backward, more than one per bucket, and
    the planner's figures (gathers, gathered peak, host memory) agree within the comparison's
    tolerance: these 20 KB buckets pad each unit a little, which the planner does not count
    (tests/engine/dryrun/test_dryrun_planner.py compares larger units exactly)."""
    from engine.dryrun import dry_run
    result = dry_run(parse_args(BASE + DENSE + Z3 + OFFLOAD + ["--train-iters", "2"]), 4)
    compared = {row.figure: row for row in result.comparison[0]}
    for figure in ("param_bytes", "dp_comm_bytes", "gathered_bytes", "optimizer_state_host_bytes"):
        row = compared[figure]
        assert row.dry_run > 0 and not row.flagged, row
    rows = {r.what: r for r in result.overlaps[0]}
    gathers, buckets = rows["zero gathers"], rows["dp buckets"]
    assert gathers.overlapped and gathers.how.startswith("ZeRO-3"), gathers
    assert buckets.ops == "reduce_scatter" and gathers.calls > buckets.calls, (gathers, buckets)
