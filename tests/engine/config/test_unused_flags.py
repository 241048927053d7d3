"""Flags accepted but without effect in the run's layout get one note each; values that would be
changed silently are refused (engine/config/unused_flags.py, engine/training/validate.py).

Every user-settable field is classified (read by every run, or listed with the condition that
leaves it unread); each rule has a case with its exact note; the trainer prints notes as plain
``gridtron: note: ...`` lines, never Python warnings."""
import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.config.fields import field_table
from engine.training.trainer import Trainer
from engine.config.unused_flags import ALWAYS_READ, RULES
from engine.training.validate import validate_run
from parallel.grid.launch import LaunchEnv

MOCK = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size",
        "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "10"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
ONE_DP = "with one data-parallel rank (dp x cp = 1): "
R = {rule.why: rule for rule in RULES}


def _why(start: str) -> str:
    (why,) = [w for w in R if w.startswith(start)]
    return why


# (extra flags, world size, the notes expected exactly, in order)
CASES = [
    (["--cp-comm-type", "a2a"], 1, [f"--cp-comm-type a2a has no effect {_why('with --cp 1')}"]),
    (["--pipeline-schedule", "zb-h1", "--stage-end-weight", "1"], 1,
     [f"--pipeline-schedule zb-h1 has no effect {_why('with --pp 1')}",
      f"--stage-end-weight 1.0 has no effect {_why('with --pp 1')}"]),
    (["--tp", "2", "--no-scatter-gather-tensors-in-pipeline"], 2,
     [f"--no-scatter-gather-tensors-in-pipeline has no effect {_why('without --pp > 1')}"]),
    (["--sequence-parallel"], 1, [f"--sequence-parallel has no effect {_why('with --tp 1')}"]),
    (["--etp", "2", "--tp", "2"], 2,
     [f"--expert-tensor-parallel-size 2 has no effect {_why('without --num-experts')}"]),
    (MOE + ["--moe-token-dispatcher-type", "allgather", "--moe-router-bias-update-rate", "0.01",
            "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.01"], 1,
     [f"--moe-token-dispatcher-type allgather has no effect {_why('with --expert-model-parallel')}",
      f"--moe-router-bias-update-rate 0.01 has no effect {_why('without --moe-router-enable')}",
      f"--moe-aux-loss-coeff 0.01 has no effect {_why('with --moe-router-load-balancing-type')}"]),
    (["--rope-base", "500000"], 1, [f"--rope-base 500000.0 has no effect {_why('on a block')}"]),
    (["--block", "llama", "--rope-base", "500000"], 1, []),
    (["--use-distributed-optimizer", "--no-overlap-grad-reduce"], 1,
     ["--use-distributed-optimizer has no effect with one data-parallel rank (dp x cp = 1) and "
      "no --optimizer-cpu-offload: there is nothing to shard; drop it or add data-parallel ranks",
      f"--no-overlap-grad-reduce has no effect {ONE_DP}there is nothing to shard or reduce; drop "
      f"it or add data-parallel ranks"]),
    (["--data-parallel-sharding-strategy", "optim_grads_params", "--optimizer-offload-fraction",
      "0.5"], 1,
     [f"--data-parallel-sharding-strategy optim_grads_params has no effect "
      f"{_why('with one data-parallel rank (dp x cp = 1) and no')}",
      f"--optimizer-offload-fraction 0.5 has no effect {_why('without --optimizer-cpu-offload')}"]),
    # the distributed optimizer at dp 1 is what --optimizer-cpu-offload offloads
    (["--use-distributed-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
      "0.5"], 1, []),
    (["--zero-stage", "1", "--no-overlap-param-gather"], 2,
     [f"--zero-stage 1 has no effect {_why('without --use-distributed')}",
      f"--no-overlap-param-gather has no effect {_why('without --use-distributed')}"]),
    (["--grad-compression", "int8", "--grad-compression-warmup-steps", "2"], 1,
     [f"--grad-compression int8 has no effect {_why(ONE_DP + 'nothing is exchanged')}",
      f"--grad-compression-warmup-steps 2 has no effect {_why(ONE_DP + 'nothing is exchanged')}"]),
    (["--grad-compression-policy", '{"default": "int8"}', "--grad-compression-ratio", "0.1"], 2,
     [f"--grad-compression-ratio 0.1 has no effect {_why('beside --grad-compression-policy')}"]),
    (["--grad-compression", "int8", "--grad-compression-ratio", "0.1",
      "--grad-compression-variance-refresh", "exp"], 2,
     [f"--grad-compression-ratio 0.1 has no effect {_why('without --grad-compression topk;')}",
      f"--grad-compression-variance-refresh exp has no effect {_why('without --grad-compression topk or')}"]),
    (["--grad-compression-warmup-steps", "3"], 2,
     [f"--grad-compression-warmup-steps 3 has no effect {_why('without --grad-compression;')}"]),
    (["--grad-compression", "topk", "--grad-compression-warmup-steps", "3",
      "--grad-compression-warmup-fraction", "0.2"], 2,
     [f"--grad-compression-warmup-fraction 0.2 has no effect {_why('beside --grad-compression-warmup')}"]),
    (["--lr-decay-style", "constant", "--min-lr", "0.0001", "--spike-window", "8"], 1,
     [f"--min-lr 0.0001 has no effect {_why('with --lr-decay-style constant')}",
      f"--spike-window 8 has no effect {_why('without --spike-factor')}"]),
    (["--hysteresis", "4", "--allow-tf32"], 1,
     [f"--hysteresis 4 has no effect {_why('outside --precision fp16')}",
      f"--allow-tf32 has no effect {_why('outside fp32 on a GPU')}"]),
    (["--fp8-recipe", "rowwise", "--num-layers-at-end-in-bf16", "2"], 1,
     [f"--fp8-recipe rowwise has no effect {_why('without --fp8-format (the GEMMs')}",
      f"--num-layers-at-end-in-bf16 2 has no effect {_why('without --fp8-format and')}"]),
    (["--bf16", "--fp8-format", "hybrid", "--num-layers-at-start-in-bf16", "0"], 1,
     [f"--num-layers-at-start-in-bf16 0 has no effect {_why('without --fp8-format and')}"]),
    (["--bf16", "--fp8-format", "e4m3", "--first-last-layers-bf16",
      "--num-layers-at-start-in-bf16", "0"], 1, []),
    (["--tokenizer", "byte", "--tokenizer-type", "GPT2BPETokenizer"], 1,
     [f"--tokenizer byte has no effect {_why('with --data-path or --mock-data')}",
      f"--tokenizer-type GPT2BPETokenizer has no effect {_why('with --mock-data: nothing')}"]),
    (["--save-interval", "5", "--no-load-optim"], 1,
     [f"--save-interval 5 has no effect {_why('without --save')}",
      f"--no-load-optim has no effect {_why('without --load')}"]),
    (["--timeout-s", "60", "--distributed-backend", "gloo", "--eval-iters", "2"], 1,
     [f"--timeout-s 60.0 has no effect {_why('in a single process')}",
      f"--distributed-backend gloo has no effect {_why('in a single process')}",
      f"--eval-iters 2 has no effect {_why('without --eval-interval')}"]),
    (["--no-log-straggler", "--straggler-threshold", "1.5"], 2,
     [f"--straggler-threshold 1.5 has no effect {_why('with --no-log-straggler')}"]),
    (["--wandb-mode", "offline", "--profile-dir", "p"], 1,
     [f"--wandb-mode offline has no effect {_why('without --wandb-project')}",
      f"--profile-dir p has no effect {_why('without --profile-steps')}"]),
    # a warm-up as long as the run: compression never starts
    (["--grad-compression", "int8", "--grad-compression-warmup-steps", "10"], 2,
     ["--grad-compression-warmup-steps 10 is not shorter than the run (--train-iters 10): every "
      "step exchanges uncompressed gradients and --grad-compression int8 never starts; shorten the "
      "warm-up or train longer"]),
    (["--grad-compression", "topk", "--grad-compression-warmup-fraction", "0.99"], 2,
     ["the warm-up of 10 steps is not shorter than the run (--train-iters 10): every step "
      "exchanges uncompressed gradients and --grad-compression topk never starts; shorten the "
      "warm-up or train longer"]),
    # what has its effect says nothing
    (["--tp", "2", "--sequence-parallel", "--cp-comm-type", "p2p", "--zero-stage", "2",
      "--use-distributed-optimizer"], 4,
     [f"--cp-comm-type p2p has no effect {_why('with --cp 1')}"]),
]


@pytest.mark.parametrize("extra,world,notes", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_each_unused_flag_gets_its_note(extra, world, notes):
    _, got = validate_run(parse_args(MOCK + extra), LaunchEnv(0, world, 0, world))
    assert got == notes


def test_every_field_is_classified_and_every_rule_has_a_case():
    ruled = {name for rule in RULES for name in rule.fields}
    assert not ruled & ALWAYS_READ, ruled & ALWAYS_READ
    assert set(field_table()) - (ruled | ALWAYS_READ) == set()  # a new field must be classified
    said = " ".join(note for *_, notes in CASES for note in notes)
    assert [rule.why for rule in RULES if rule.why not in said] == []


@pytest.mark.parametrize("extra,message", [
    (["--grad-compression", "topk", "--grad-compression-warmup-fraction", "0"],
     "--grad-compression topk needs --grad-compression-warmup-fraction > 0 (or "
     "--grad-compression-warmup-steps >= 1): Adam's second moment"),
    (["--grad-compression", "onebit", "--grad-compression-warmup-steps", "0"],
     "--grad-compression onebit needs --grad-compression-warmup-steps >= 1"),
    (MOE + ["--moe-layer-freq", "[0,0]"],
     "--moe-layer-freq [0,0] selects none of the 2 layers: the model would be dense and "
     "--num-experts 4 unused; mark at least one layer 1, or drop --num-experts"),
])
def test_values_that_would_be_changed_silently_are_refused(extra, message):
    with pytest.raises(ConfigError) as err:
        parse_args(MOCK + extra)
    assert str(err.value).startswith(message), err.value


def test_the_trainer_prints_notes_as_plain_lines(capsys, recwarn):
    """Notes are ``gridtron: note: ...`` lines on stderr (no file path, no warnings module), each
    once; a block without a FLOPs formula is one of them."""
    trainer = Trainer(parse_args(MOCK + ["--cp-comm-type", "a2a", "--block",
                                         "tests.helpers.blocks:DirectNormBlock"]))
    trainer.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"gridtron: note: --cp-comm-type a2a has no effect {_why('with --cp 1')}"
    assert lines[1].startswith("gridtron: note: block tests.helpers.blocks.DirectNormBlock has no "
                               "FLOPs formula: its FLOPs are counted"), lines
    assert len(lines) == 2 and len(recwarn) == 0, (lines, [str(w.message) for w in recwarn])
