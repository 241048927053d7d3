"""Bad input fails before the first step, on every rank, with a message that says what to change.
(Unknown flags and YAML keys, missing data, batch splits, position-table length and most grid
errors are covered in test_cli.py; these are the remaining cases.)"""
import os

import pytest

from engine.checkpoint import CheckpointError
from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.data import prepare
from engine.training.launch import main as train_main
from engine.training.trainer import Trainer
from engine.training.validate import validate_run
from parallel.state import LaunchEnv
from parallel.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

TINY = ["--no-progress", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 1-step checkpoint of the TINY model on 300-token mock data."""
    root = str(tmp_path_factory.mktemp("bad_input") / "ck")
    trainer = Trainer(parse_args(TINY + ["--mock-data", "--vocab-size", "300", "--train-iters", "1",
                                         "--save", root]))
    trainer.train()
    trainer.close()
    return root


def _train(argv):
    trainer = Trainer(parse_args(argv))
    try:
        return trainer.train().records
    finally:
        trainer.close()


def each_rank_fails(ps, cases):
    """Every rank must raise the error before training: returns (message, steps run) per case."""
    out = []
    for argv in cases:
        trainer = Trainer(parse_args(argv))
        try:
            out.append(("no error", len(trainer.train().records)))
        except CheckpointError as exc:
            out.append((str(exc), 0))
        finally:
            trainer.close()
    return out


def test_checkpoint_mismatch_fails_on_every_rank(saved):
    cases = [(["--mock-data", "--vocab-size", "256"],
              "trained on a 300-token vocabulary from mock data, but this run's data has 256 tokens"),
             (["--mock-data", "--vocab-size", "300", "--ffn-hidden-size", "128"],
              "saved with --ffn-hidden-size 256 but this run has --ffn-hidden-size 128")]
    argvs = [TINY + extra + ["--train-iters", "3", "--load", saved] for extra, _ in cases]
    results = run_distributed(each_rank_fails, grid=RankGrid(dp=2), args=(argvs,), timeout_s=60)
    for per_rank in results:
        for (message, steps), (_, match) in zip(per_rank, cases):
            assert match in message and steps == 0, message


def test_data_from_another_tokenizer(saved, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("some text for the byte tokenizer " * 200)
    prefix = str(tmp_path / "bytes")
    prepare([str(tmp_path / "t.txt")], prefix, tokenizer="byte")
    argv = TINY + ["--data-path", prefix, "--train-iters", "3", "--load", saved]
    with pytest.raises(CheckpointError, match="this run's data has 257 tokens from tokenizer byte .*"
                                              "--mock-data --vocab-size 300"):
        _train(argv)
    assert train_main(argv) == 2
    assert "checkpoint error" in capsys.readouterr().err


def test_other_model_shape_through_the_command_line(saved, capsys):
    assert train_main(TINY + ["--mock-data", "--vocab-size", "300", "--hidden-size", "32",
                              "--train-iters", "2", "--load", saved]) == 2
    err = capsys.readouterr().err
    assert "saved with --hidden-size 64 but this run has --hidden-size 32" in err
    assert "use the checkpoint's model shape (--use-checkpoint-args) or start without --load" in err


def test_load_without_checkpoint(tmp_path):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    with pytest.raises(CheckpointError, match="holds no checkpoint .*directory written by --save"):
        _train(TINY + ["--mock-data", "--vocab-size", "300", "--train-iters", "1", "--load", empty])
    # the Megatron idiom --load DIR --save DIR starts from scratch while DIR is still empty
    assert len(_train(TINY + ["--mock-data", "--vocab-size", "300", "--train-iters", "1",
                              "--load", empty, "--save", empty])) == 1


def test_corpus_too_small(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("hi")
    prefix = str(tmp_path / "tiny")
    prepare([str(tmp_path / "tiny.txt")], prefix, tokenizer="byte")
    assert train_main(TINY + ["--data-path", prefix, "--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "use a smaller --seq-length or more data" in err


@pytest.mark.parametrize("argv,match", [
    (["--tp", "0"], "--tp must be >= 1"),
    (["--order", "tp-pp"], "order must name tp, cp, pp and dp once each"),
    (["--virtual-pipeline-size", "2"], "needs --pipeline-schedule interleaved"),
    (["--keep-last", "0"], "--keep-last >= 1"),
    (["--save-interval", "-1"], "--save-interval must be >= 0"),
])
def test_grid_and_checkpoint_flag_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        validate_run(parse_args(argv), LaunchEnv(0, 4, 0, 4))


def test_train_iters_at_or_below_the_loaded_step(saved, capsys):
    mock = TINY + ["--mock-data", "--vocab-size", "300", "--load", saved]
    assert train_main(mock + ["--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "is at step 1 and --train-iters is 1: nothing to train" in err and len(err.splitlines()) == 1
    # --finetune restarts from step 0 with the weights; --no-load-optim continues with fresh moments
    assert [r["step"] for r in _train(mock + ["--train-iters", "1", "--finetune"])] == [1]
    assert [r["step"] for r in _train(mock + ["--train-iters", "2", "--no-load-optim"])] == [2]


def test_vocab_size_that_disagrees_with_the_data(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("some text for the byte tokenizer " * 200)
    prefix = str(tmp_path / "bytes")
    prepare([str(tmp_path / "t.txt")], prefix, tokenizer="byte")
    assert train_main(TINY + ["--data-path", prefix, "--vocab-size", "300", "--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "vocab size 300 does not match the data" in err and "set it to 257" in err
    assert len(_train(TINY + ["--data-path", prefix, "--vocab-size", "257", "--train-iters", "1"])) == 1
