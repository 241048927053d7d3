"""``python -m engine.plan``'s command line against engine.train: every printed command passes
engine.train's validation (query groups per TP rank, ring attention without attention dropout),
the plan is of the run the command starts (its dropout, the recipe's run keys), and what the
planner cannot price or no layout can obey is one line, exit 2."""
from __future__ import annotations

import json
import shlex

import pytest

from engine.config.cli import parse_args
from engine.plan.model import GIB
from engine.tools import plan_cli


def rows(capsys, argv: list[str]) -> list[dict]:
    assert plan_cli.main(argv + ["--json"]) == 0, capsys.readouterr().err
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def train_args(row: dict) -> list[str]:
    argv = shlex.split(row["command"])
    return argv[argv.index("engine.train") + 1:]


MQA = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
       "--num-query-groups", "1", "--block", "llama", "--vocab-size", "128256", "--seq-length", "4096",
       "--global-batch-size", "512", "--device", "h100", "--devices", "256"]
CP_DROPOUT = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
              "--vocab-size", "32000", "--seq-length", "32768", "--global-batch-size", "8",
              "--device", "h100", "--devices", "8", "--cp", "1,2,4", "--dropout", "0.1"]


@pytest.mark.parametrize("argv, world", [(MQA, 256), (CP_DROPOUT, 8)])
def test_every_printed_command_passes_engine_trains_validation(capsys, argv, world):
    """MQA (one key/value group: no tp > 1 can split it) and cp with dropout (ring attention has
    no attention dropout): each of the top 40 commands is one engine.train accepts."""
    from engine.dryrun import prepare
    found = rows(capsys, argv + ["--top", "40"])
    assert found
    for row in found:
        prepare(parse_args(train_args(row)), world, 8)   # ConfigError: engine.train refuses it
    if argv is MQA:
        assert {row["tp"] for row in found} == {1}          # by hand: G = 1 cannot be split
    else:
        assert {row["cp"] for row in found} == {1}          # attention dropout 0.1 with every cp


def test_a_pinned_layout_that_splits_query_groups_is_refused(capsys):
    argv = MQA[:MQA.index("--num-query-groups") + 1] + ["2"] + MQA[MQA.index("--block"):]
    assert plan_cli.main(argv + ["--layout", "8,1"]) == 2
    err = capsys.readouterr().err
    assert "query groups 2 not divisible by tp 8" in err and len(err.splitlines()) == 1


PAPER = ["--num-layers", "48", "--hidden-size", "8192", "--num-attention-heads", "64",
         "--vocab-size", "51200", "--seq-length", "2048", "--global-batch-size", "1536",
         "--device", "a100-80gb", "--devices", "512", "--layout", "8,2", "--micro-batch-size", "4",
         "--recompute", "none", "--zero", "on", "--zero-stage", "1", "--sequence-parallel", "off",
         "--optimizer-cpu-offload", "off"]


def test_the_plan_is_of_the_printed_commands_dropout(capsys):
    """engine.train's default dropout is 0 and the printed command gives none: the plan keeps no
    masks, and is the start-up check's figure for that command. With --dropout 0.1 the first
    stage keeps, by hand, 2 one-byte masks of s b h per layer (24 layers, 2 micro-batches in
    flight) and the embedding's (2 in flight): 6.125 GiB more."""
    from engine.plan.memory import stage_memory
    from engine.training.memory_check import planner_inputs
    plain, = rows(capsys, PAPER)
    masked, = rows(capsys, PAPER + ["--dropout", "0.1"])
    assert plain["memory_terms"]["stage"] == masked["memory_terms"]["stage"] == "first"
    sbh = 2048 * 4 * 8192
    extra = masked["memory_terms"]["activations"] + masked["memory_terms"]["pipeline_ends"] \
        - plain["memory_terms"]["activations"] - plain["memory_terms"]["pipeline_ends"]
    assert extra == 2 * sbh * 24 * 2 + sbh * 2 == 6.125 * GIB
    for row in (plain, masked):
        cfg = parse_args(train_args(row))
        assert cfg.model.dropout == (0.1 if row is masked else 0.0)
        trainer = stage_memory(*planner_inputs(cfg, cfg.parallel.grid(512)), 0, "nccl")
        assert trainer.as_dict() == row["memory_terms"]


RECIPE = ("num_layers: 4\nhidden_size: 256\nnum_attention_heads: 8\nvocab_size: 1000\n"
          "seq_length: 128\nglobal_batch_size: 8\nprecision: bf16\nfp8_format: e4m3\n"
          "optimizer_cpu_offload: true\nmicro_batch_size: 4\nlr: 1.0e-4\n")


def test_a_recipes_run_keys_are_planned_and_printed(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    found = rows(capsys, ["--config", str(recipe), "--device", "h100", "--devices", "8", "--top", "3"])
    for row in found:
        cfg = parse_args(train_args(row))
        assert (cfg.precision.precision, cfg.precision.fp8_format) == ("bf16", "e4m3")
        assert cfg.data.micro_batch_size == 4 and row["micro_batch_size"] == 4
        assert cfg.optim.optimizer_cpu_offload and row["offload"] == 1.0
    # a flag typed over the recipe wins
    found = rows(capsys, ["--config", str(recipe), "--device", "h100", "--devices", "8",
                          "--micro-batch-size", "2", "--top", "1"])
    assert parse_args(train_args(found[0])).data.micro_batch_size == 2
    # fp16 with FP8: engine.train's own refusal
    recipe.write_text(RECIPE.replace("bf16", "fp16"))
    assert plan_cli.main(["--config", str(recipe), "--device", "h100", "--devices", "8"]) == 2
    assert "--fp8-format e4m3" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["grad_compression: int8", "bucket_size_mb: 1",
                                 "cp_comm_type: a2a", "stage_end_weight: 0.5"])
def test_recipe_keys_the_planner_cannot_price_are_refused(tmp_path, capsys, key):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE + key + "\n")
    assert plan_cli.main(["--config", str(recipe), "--device", "h100", "--devices", "8"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gridtron: ") and key.split(":")[0] in err[0]


MOE = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--block",
       "llama", "--vocab-size", "32000", "--seq-length", "2048", "--global-batch-size", "64",
       "--num-experts", "8", "--moe-router-topk", "2", "--device", "h100", "--devices", "16",
       "--ep", "8", "--top", "1"]


def test_the_allgather_dispatcher_is_planned(capsys):
    """Priced (engine/plan/moe_allgather.py, tests/engine/plan/test_plan_moe_allgather.py), not
    refused: the best command runs it."""
    assert plan_cli.main(MOE + ["--moe-token-dispatcher-type", "allgather"]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert "--ep 8 " in out[-1] and out[-1].endswith("--moe-token-dispatcher-type allgather")


SMALL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--vocab-size", "1000", "--seq-length", "128", "--device", "h100"]


@pytest.mark.parametrize("extra, rule", [
    # by hand: tp <= 4 (heads), pp <= 4 (layers), so dp >= 4 > the batch of 2
    (["--global-batch-size", "2", "--devices", "64"], "global batch 2 not divisible"),
    (["--global-batch-size", "8", "--devices", "8", "--cp", "3"], "cp in 3"),
    (["--global-batch-size", "8", "--devices", "8", "--cp", "2", "--attention", "unfused"],
     "fused"),
    (["--global-batch-size", "8", "--devices", "8", "--layout", "16,1"], "16 != 8 devices"),
])
def test_no_layout_obeys_the_rules_names_the_rule(capsys, extra, rule):
    """Not "add devices": the rule every layout breaks, one line, exit 2 (engine.train's code for
    the same mistake)."""
    assert plan_cli.main(SMALL + extra) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and rule in err[0] and "device memory" not in err[0], err


def test_no_note_on_a_search_space_flag(capsys):
    """--sequence-parallel off chooses the search space; the printed command (best tp 1) has no
    such flag, so engine.train's note on --no-sequence-parallel is not printed."""
    assert plan_cli.main(SMALL + ["--global-batch-size", "8", "--devices", "8",
                                  "--sequence-parallel", "off", "--top", "1"]) == 0
    assert "note" not in capsys.readouterr().err
