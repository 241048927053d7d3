"""engine.dryrun: one rank per role on the meta device under the fake process group, against real
steps on 8 gloo ranks, at 1,024 and 8,192 ranks of a 70B-class model, and against the planner.

The central check (test_dry_run_equals_a_real_step): for three layouts of 8 ranks, every rank is
built by the dry run and its step's collectives (op, group kind, group ranks, dtype, payload bytes,
in issue order), its metrics keys (param/grad/optimizer bytes, the *_comm_bytes) and its peak of
saved activations equal those of the same rank's first step of a real run on gloo, recorded by the
same observers; the ranks of one role record the same bytes, and the role's activation per stage
(per micro-batch x the stage's in-flight count) is each stage's own measured peak. The planner
against the dry run: test_dryrun_planner.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.dryrun import dry_run, prepare, record_roles
from engine.dryrun.record import MEMORY_KEYS, SavedActivations, record_role
from engine.dryrun.roles import rank_roles
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import SUITE_RULES, record_comm, run_distributed

TINY = ["--mock-data", "--vocab-size", "500", "--no-progress", "--device", "cpu",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--train-iters", "1", "--lr-warmup-iters", "0", "--peak-tflops", "1",
        "--no-log-straggler"]
LAYOUTS = {  # 8 ranks each; vocabulary 500 is padded (to 512 or 1024), so shards carry padding
    "llama tp2 pp2 dp2, SP, GQA, ZeRO-1, bf16, selective": TINY + [
        "--block", "llama", "--num-query-groups", "2", "--tp", "2", "--pp", "2",
        "--sequence-parallel", "--use-distributed-optimizer", "--precision", "bf16",
        "--recompute", "selective", "--global-batch-size", "8", "--micro-batch-size", "1"],
    "gpt2 tp2 pp4 interleaved, tied, fp32, full recompute": TINY + [
        "--num-layers", "8", "--tp", "2", "--pp", "4", "--pipeline-schedule", "interleaved",
        "--virtual-pipeline-size", "2", "--precision", "fp32", "--recompute", "full",
        "--global-batch-size", "8", "--micro-batch-size", "2"],
    "llama cp2 tp2 dp2 ring, ZeRO-2, bf16": TINY + [
        "--block", "llama", "--cp", "2", "--tp", "2", "--use-distributed-optimizer",
        "--zero-stage", "2", "--precision", "bf16", "--global-batch-size", "8",
        "--micro-batch-size", "2"],
    "gpt2 pp4 dp2 zb-v, tied on rank 0, ZeRO-1": TINY + [
        "--num-layers", "8", "--pp", "4", "--pipeline-schedule", "zb-v",
        "--use-distributed-optimizer", "--global-batch-size", "8", "--micro-batch-size", "1"],
}
KEYS = ("dp_comm_bytes", "dp_comm_wire_bytes", "tp_comm_bytes", "cp_comm_bytes", "pp_comm_bytes",
        *MEMORY_KEYS)


def _event(e) -> tuple:
    return e.op, e.group, tuple(e.ranks), e.dtype, e.payload_bytes


def _real_first_steps(ps, layouts):
    from engine.training.trainer import Trainer
    out = []
    for argv in layouts:
        trainer = Trainer(parse_args(argv))
        saved = SavedActivations([p for c in trainer.chunks for p in c.parameters()])
        with record_comm(trainer.ps) as events, saved.hooks():
            record = trainer.train_one(0)
        out.append({"events": [_event(e) for e in events], "activation": saved.peak,
                    "metrics": {k: record[k] for k in KEYS}})
        trainer.close()
    return out


@pytest.fixture(scope="module")
def real_steps():
    results = run_distributed(_real_first_steps, grid=RankGrid(dp=8), args=(list(LAYOUTS.values()),))
    return {name: [results[r][i] for r in range(8)] for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dry_run_equals_a_real_step(real_steps, name):
    cfg, grid, _ = prepare(parse_args(LAYOUTS[name]), 8)
    roles = [rec.role for rec in record_roles(cfg, grid, SUITE_RULES, 8)]
    assert sorted(r for role in roles for r in role.ranks) == list(range(8))
    for role in roles:
        records = [record_role(cfg, grid, role, SUITE_RULES, 8, rank=r) for r in role.ranks]
        for rec in records:
            real = real_steps[name][rec.rank]
            assert [_event(e) for e in rec.events] == real["events"], (name, rec.rank)
            assert {k: rec.metrics[k] for k in KEYS} == real["metrics"], (name, rec.rank)
            # exact, but for zb-v's rank 0 (both ends of the V), where the real step holds 32 bytes
            # more: 0-d scalars (one fp32 per micro-batch and chunk) the meta run does not keep
            slack = 64 if "zb-v" in name else 0
            assert abs(rec.activation_bytes - real["activation"]) <= slack, (name, rec.rank)
            assert rec.tensor_devices == {"meta"}
        first = records[0]
        for rec in records[1:]:  # one role: the same bytes whatever the tp, cp, dp position
            assert rec.metrics == first.metrics and rec.memory == first.memory
            assert Counter((c["op"], c["group"], c["dtype"], c["bytes"]) for c in rec.collectives) \
                == Counter((c["op"], c["group"], c["dtype"], c["bytes"]) for c in first.collectives)
            # activations of another stage of the role: per micro-batch x its in-flight count
            assert first.activation_per_stage[rec.stage] == rec.activation_bytes


def test_roles_of_a_pipeline():
    cfg, grid, _ = prepare(parse_args(TINY + ["--num-layers", "8", "--tp", "2", "--pp", "4",
                                              "--global-batch-size", "16", "--micro-batch-size", "2"]),
                           16)
    roles = rank_roles(cfg, grid)
    assert [(r.name, r.stages, r.representative) for r in roles] == [
        ("first stage", (0,), 0), ("middle stages", (1, 2), 4), ("last stage", (3,), 12)]
    assert roles[1].ranks == tuple(range(4, 12)) and roles[1].in_flight == {1: 3, 2: 2}
    assert [len(c) for c in roles[0].chunks] == [2]
    # weighted ends: stages 0-3 hold 2, 3, 3, 2 of 10 layers; the two middles are one role
    cfg, grid, _ = prepare(parse_args(TINY + ["--num-layers", "10", "--pp", "4",
                                              "--stage-end-weight", "1"]), 4)
    assert [(r.stages, [len(c) for c in r.chunks]) for r in rank_roles(cfg, grid)] == [
        ((0,), [2]), ((1, 2), [3]), ((3,), [2])]
    # interleaved: every stage holds two chunks; no pipeline: one role
    cfg, grid, _ = prepare(parse_args(TINY + ["--num-layers", "8", "--pp", "2", "--pipeline-schedule",
                                              "interleaved", "--virtual-pipeline-size", "2"]), 2)
    assert [[len(c) for c in r.chunks] for r in rank_roles(cfg, grid)] == [[2, 2], [2, 2]]
    cfg, grid, _ = prepare(parse_args(TINY + ["--tp", "2"]), 4)
    assert [(r.name, r.ranks) for r in rank_roles(cfg, grid)] == [("only stage", (0, 1, 2, 3))]


def test_rejects_what_the_run_rejects():
    with pytest.raises(ConfigError, match="divisible by --tp"):
        dry_run(parse_args(TINY + ["--tp", "3"]), 6)
    with pytest.raises(ConfigError, match="world size"):
        dry_run(parse_args(TINY + ["--tp", "2", "--pp", "2", "--dp", "2"]), 16)
    with pytest.raises(ConfigError, match="span nodes"):
        dry_run(parse_args(TINY + ["--tp", "4"]), 8, devices_per_node=2)
    # paths of the target machine are not this one's: not checked
    assert dry_run(parse_args(TINY + ["--save", "/nonexistent/ckpt", "--data-path", "/nope/data",
                                      "--vocab-size", "500"]), 1).records


# ---- 70B-class layouts at 1,024 and 8,192 ranks ------------------------------------------------

SEVENTY_B = ["--mock-data", "--vocab-size", "128256", "--num-layers", "80", "--hidden-size", "8192",
             "--num-attention-heads", "64", "--num-query-groups", "8", "--ffn-hidden-size", "28672",
             "--block", "llama", "--seq-length", "4096", "--micro-batch-size", "1",
             "--precision", "bf16", "--use-distributed-optimizer", "--sequence-parallel",
             "--tp", "8", "--no-progress"]


def _run_cli(args, tmp_path):
    """The dry run in a process of its own: its CPU seconds (user + system: on this shared
    machine wall time measures the other jobs too), its wall seconds and its peak memory."""
    out = tmp_path / "dryrun.json"
    code = ("import resource, runpy, sys; sys.argv = ['engine.dryrun'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('engine.dryrun', run_name='__main__')\n"
            "except SystemExit as e:\n    code = e.code\n"
            "u = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print('USAGE', u.ru_utime + u.ru_stime, u.ru_maxrss * 1024)\n"
            "sys.exit(code)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          cwd=str(Path(__file__).resolve().parents[3]))
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    cpu, rss = proc.stdout.rsplit("USAGE", 1)[1].split()
    return json.loads(out.read_text()), float(cpu), wall, int(rss), proc.stdout


@pytest.mark.parametrize("world, pp, gbs", [(8192, 16, 1024)])
def test_seventy_b_layouts_in_under_a_minute(tmp_path, world, pp, gbs):
    doc, cpu, wall, rss, stdout = _run_cli(
        ["--world-size", str(world), "--device", "h100", *SEVENTY_B, "--pp", str(pp),
         "--global-batch-size", str(gbs)], tmp_path)
    assert cpu < 60, f"{world} ranks took {cpu:.1f} CPU seconds ({wall:.1f} s wall)"
    roles = doc["roles"]
    assert [r["name"] for r in roles] == ["first stage", "middle stages", "last stage"]
    assert sum(len(r["ranks"]) for r in roles) == world
    first = roles[0]
    # one first-stage rank of a 70B model: 80/pp layers + the embedding, bf16, fp32 grads,
    # ZeRO-1 over dp: gigabytes that this process never allocated
    assert first["param_bytes"] > 1e9 and first["grad_bytes"] == 2 * first["param_bytes"]
    assert rss < first["param_bytes"] + first["grad_bytes"], rss
    assert doc["summary"]["largest_role"] == "first stage"
    assert {c["group"] for c in first["collectives"]} >= {"tp", "pp", "dp", "world"}
    assert "DOES NOT FIT" not in stdout


def test_reports_a_rank_that_does_not_fit(tmp_path, capsys):
    from engine.dryrun.cli import main
    code = main(["--world-size", "8", "--memory-gb", "0.0001", *TINY, "--tp", "2", "--pp", "2"])
    assert code == 1 and "DOES NOT FIT" in capsys.readouterr().out
    assert main(["--world-size", "6", *TINY, "--tp", "3"]) == 2
    assert "divisible by --tp" in capsys.readouterr().err


# ---- receives, precision, bad arguments ---------------------------------------------------------

PIPE = TINY + ["--pp", "2", "--global-batch-size", "8", "--micro-batch-size", "1"]


def test_receives_show_the_bytes_they_land(capsys):
    from engine.dryrun.report import as_json, text
    result = dry_run(parse_args(PIPE), 4)
    first, last = result.records
    act = 1 * 32 * 64 * 4  # (b, s, h) fp32, per micro-batch
    for rec in (first, last):
        recvs = [c for c in rec.collectives if c["op"] == "recv"]
        assert len(recvs) == 4 and all(c["bytes"] == 0 and c["received_bytes"] == act for c in recvs)
        assert all("received_bytes" not in c for c in rec.collectives if c["op"] != "recv")
    # what one stage lands is what the other sends: activations forward, gradients backward
    sent = lambda rec: sum(c["bytes"] for c in rec.collectives if c["op"] == "send")  # noqa: E731
    landed = lambda rec: sum(c["received_bytes"] for c in rec.collectives if c["op"] == "recv")  # noqa: E731
    assert landed(first) == sent(last) == 4 * act and landed(last) == sent(first) == 4 * act
    assert first.metrics["pp_comm_bytes"] == sent(first)  # traffic counts what is sent, once
    out = text(result)
    assert "    recv           pp        float32        4 x     32.00 KiB  received" in out, out
    assert "    send           pp        float32        4 x     32.00 KiB\n" in out
    doc = as_json(result)
    assert [c["received_bytes"] for c in doc["roles"][0]["collectives"] if c["op"] == "recv"] == [act] * 4


def test_precision_agrees_with_the_planner_and_is_printed():
    from engine.dryrun.report import as_json, text
    from engine.tools.plan_cli import build_parser as plan_parser
    planned = plan_parser().get_default("precision")
    assert planned == "bf16"
    on_device = dry_run(parse_args(PIPE), 4, "h100")  # no --precision: the planner's
    assert on_device.precision == on_device.cfg.precision.precision == planned
    told = dry_run(parse_args(PIPE + ["--precision", planned]), 4, "h100")
    assert on_device.records[0].metrics == told.records[0].metrics  # the same run as told
    lines = text(on_device).splitlines()
    assert lines[1].startswith("precision: bf16 (engine.plan's default for --device h100, so that "
                               "both tools plan the same run; engine.train's default is fp32: run "
                               "it with --precision bf16"), lines[1]
    assert as_json(on_device)["layout"]["precision"] == "bf16"
    assert text(told).splitlines()[1] == "precision: bf16 (--precision)"
    fp32 = dry_run(parse_args(PIPE + ["--precision", "fp32"]), 4, "h100")
    assert fp32.precision == "fp32" and text(fp32).splitlines()[1] == "precision: fp32 (--precision)"
    assert fp32.records[0].metrics["param_bytes"] == 2 * told.records[0].metrics["param_bytes"]
    plain = dry_run(parse_args(PIPE), 4)  # engine.train's --device (cpu): engine.train's default
    assert plain.precision == "fp32"
    assert text(plain).splitlines()[1] == ("precision: fp32 (engine.train's default without "
                                           "--precision; engine.plan plans bf16: give --precision "
                                           "bf16 to compare with it)")


BAD_DRYRUN_ARGS = [  # the dry run's arguments (TINY's model follows), the one line expected
    (["--world-size", "0"], "configuration error: --world-size must be between 1 and 1,048,576, got 0"),
    (["--world-size", "-4"], "configuration error: --world-size must be between 1 and 1,048,576, got -4"),
    (["--world-size", "1000000000000"],
     "configuration error: --world-size must be between 1 and 1,048,576, got 1000000000000"),
    (["--world-size", "4.5"], "configuration error: argument --world-size: invalid int value: '4.5'"),
    ([], "configuration error: --world-size N is required: the ranks of the job"),
    (["--world-siz", "4"], "configuration error: unknown argument '--world-siz'; did you mean --world-size?"),
    (["--world-size", "4", "--devices-per-node", "0"],
     "configuration error: --devices-per-node must be between 1 and 1,048,576, got 0"),
    (["--world-size", "4", "--memory-gb", "-1"],
     "configuration error: --memory-gb must be a positive number of GiB, got -1.0"),
    (["--world-size", "4", "--memory-gb", "inf"],
     "configuration error: --memory-gb must be a positive number of GiB, got inf"),
    (["--world-size", "4", "--memory-gb", "nan"],
     "configuration error: --memory-gb must be a positive number of GiB, got nan"),
    (["--world-size", "4", "--device", "h10"], "unknown device 'h10'; known: "),
    (["--world-size", "4", "--num-layers", "0"], "configuration error: --num-layers must be >= 1, got 0"),
]


@pytest.mark.parametrize("extra, message", BAD_DRYRUN_ARGS, ids=[" ".join(a) or "none" for a, _ in BAD_DRYRUN_ARGS])
def test_bad_arguments_get_one_line(extra, message, capsys):
    from engine.dryrun.cli import main
    assert main(TINY + extra) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gridtron: {message}"), captured.err


def test_json_path_is_checked_before_any_work(tmp_path, capsys):
    import hashlib
    from engine.dryrun.cli import main
    kept = tmp_path / "kept.json"
    kept.write_text('{"an": "earlier dry run"}')
    digest = hashlib.sha256(kept.read_bytes()).hexdigest()
    (tmp_path / "file").write_text("x")
    cases = [(str(tmp_path), "is a directory"),
             (str(tmp_path / "missing" / "d.json"), f"{tmp_path / 'missing'} does not exist"),
             (str(tmp_path / "file" / "d.json"), f"{tmp_path / 'file'} is a file"),
             (str(tmp_path) + "/", "names a directory, not a file")]
    for path, why in cases:
        assert main(["--world-size", "4", "--json", path] + PIPE) == 2, path
        err = capsys.readouterr().err
        assert err == (f"gridtron: configuration error: --json {path}: {why}; choose a file "
                       f"path you can write to\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "kept.json"]
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == digest
    assert main(["--world-size", "4", "--json", str(kept)] + PIPE) == 0  # a writable file: replaced
    assert json.loads(kept.read_text())["layout"]["pp"] == 2


# ---- which collectives are overlapped -----------------------------------------------------------

def test_overlap_rows_sort_a_step():
    from engine.dryrun.overlap import overlap_rows
    c = lambda op, group, n=4: {"op": op, "group": group, "dtype": "bfloat16", "bytes": n}  # noqa: E731
    step = ([c("send", "tp"), c("recv", "tp"), c("all_gather", "tp"), c("all_reduce", "tp"),
             c("reduce_scatter", "dp", 8), c("reduce_scatter", "dp", 8), c("all_gather", "dp"),
             c("send", "pp"), c("all_reduce", "world")])
    rows = overlap_rows(step, tp=2, ring=True, overlap_grad_reduce=True, overlap_param_gather=True,
                        zero=True)
    got = [(r.what, r.ops, r.calls, r.bytes, r.overlapped) for r in rows]
    assert got == [("tp ring", "send/recv", 2, 8, True), ("tp", "all_gather/all_reduce", 2, 8, False),
                   ("dp buckets", "reduce_scatter", 2, 16, True), ("zero gathers", "all_gather", 1, 4, True),
                   ("pp", "send", 1, 4, False), ("other", "all_reduce", 1, 4, False)]
    off = overlap_rows(step, tp=2, ring=False, overlap_grad_reduce=False, overlap_param_gather=False,
                       zero=True)
    assert [r.overlapped for r in off if r.what in ("dp buckets", "zero gathers")] == [False, False]


def test_dry_run_lists_the_overlapped_collectives(capsys):
    """tp 2, pp 2, dp 2 with SP and ZeRO-1: with --tp-comm-overlap the first stage's 2 layers run
    2 x 4 x 10 rings of one send each, its DP buckets and ZeRO gathers are overlapped."""
    from engine.dryrun.cli import main
    from engine.dryrun.report import as_json
    argv = TINY + ["--tp", "2", "--pp", "2", "--sequence-parallel", "--use-distributed-optimizer",
                   "--global-batch-size", "8", "--micro-batch-size", "1", "--tp-comm-overlap"]
    result = dry_run(parse_args(argv), 8, "h100")   # engine.train's --tp-comm-overlap
    assert result.tp_comm_overlap and not [n for n in result.notes if "ring sends" in n]
    first = {r.what: r for r in result.overlaps[0]}
    assert (first["tp ring"].ops, first["tp ring"].calls, first["tp ring"].overlapped) == ("send/recv", 160, True)
    assert first["tp"].overlapped is False and "all_reduce" in first["tp"].ops
    assert (first["dp buckets"].calls, first["dp buckets"].overlapped) == (2, True)
    assert (first["zero gathers"].calls, first["zero gathers"].overlapped) == (2, True)
    assert first["pp"].overlapped is False
    doc = as_json(result)
    assert doc["layout"]["tp_comm_overlap"] is True
    row = doc["roles"][0]["overlap"][2]
    assert (row["what"], row["ops"], row["group"], row["calls"], row["overlapped"]) == (
        "dp buckets", "reduce_scatter", "dp", 2, True)
    assert main(["--world-size", "8"] + argv) == 0
    out = capsys.readouterr().out
    assert ("overlapped with compute (--tp-comm-overlap on, --overlap-grad-reduce on, "
            "--overlap-param-gather on):") in out
    assert "tp ring      tp        send/recv" in out and "zero gathers dp        all_gather" in out


@pytest.mark.parametrize("name,extra,world", [
    # 10 layers on 4 stages: 2, 3, 3, 2 (the planner split them 2, 2, 2, 2: the middle stages'
    # weights a third short, and the memory check at start with them)
    ("stage end weight", ["--num-layers", "10", "--pp", "4", "--stage-end-weight", "1"], 4),
    # the position table's rows (the planner took --seq-length's: the first stage's weights 35 % short)
    ("position table", ["--pp", "2", "--max-position-embeddings", "1024"], 2),
    # every micro-batch in flight (the planner took 1F1B's: the activations half of them)
    ("gpipe", ["--pp", "4", "--pipeline-schedule", "gpipe", "--global-batch-size", "8",
               "--micro-batch-size", "1"], 4),
    # the queries' and keys' norms and their gradients' sum over TP (256 B and 512 B here)
    ("qk norms", ["--block", "llama", "--tp", "2", "--qk-layernorm"], 2),
    # experts padded to capacity: E C rows dispatched and no counts (priced dropless: half)
    ("padded capacity", ["--dp", "4", "--ep", "2", "--num-experts", "4", "--moe-router-topk", "2",
                         "--moe-expert-capacity-factor", "2.0",
                         "--moe-pad-expert-input-to-capacity"], 4),
])
def test_the_planner_plans_what_the_run_builds(name, extra, world):
    """Figures the planner used to get wrong for these flags now equal the dry run's (which equals
    a real step: test_dry_run_equals_a_real_step): the memory check at start plans with them."""
    result = dry_run(parse_args(TINY + ["--precision", "fp32"] + extra), world)
    # (the state: Adam's step counters too)
    exact = ("param_bytes", "grad_bytes", "tp_comm_bytes", "ep_comm_bytes")
    for rows in result.comparison:
        for row in rows:
            assert not row.flagged or row.why != "not explained", (name, row)
            if row.figure in exact:
                assert row.planner == pytest.approx(row.dry_run, rel=1e-9, abs=0.5), (name, row)
            if row.figure == "activation_bytes" and name == "gpipe":   # (it was a known gap)
                assert row.planner == pytest.approx(row.dry_run, rel=0.01), (name, row)
