"""Bad input fails before the first step, on every rank, with one line that says what to change,
a non-zero exit and nothing changed on disk (docs/design.md, "Bad input").

``CASES`` is the table: every class of mistake (flags, recipes, sizes against memory, output
paths, data, checkpoints) through ``python -m engine.train``'s main, each case checked for its
exact line, its exit code and the digests of every file before and after. Multi-rank cases (ranks
that disagree, a rank that stopped, a rank that never comes) run on two real ranks. (Unknown flags
and YAML keys, batch splits, position-table length and most grid errors are also covered in
test_cli.py.)"""
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import CheckpointError
from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.data import prepare
from engine.data.megatron import write_index
from engine.training.launch import main as train_main
from engine.training.trainer import Trainer
from engine.data.indexed import write_documents
from engine.data.tokenizer import ByteTokenizer
from engine.plan.memory import stage_memory
from engine.training.memory_check import memory_problem, planner_inputs, size_text
from engine.training.validate import validate_run
from parallel.grid.launch import LaunchEnv
from parallel.grid.rendezvous import Disagreement
from parallel.grid.topology import RankGrid
from engine.fuzz.pool import free_port
from tests.helpers.dist_utils import run_distributed
from tests.helpers.training import train_records

ROOT = str(Path(__file__).resolve().parents[3])

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
    return train_records(argv)


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


# ---- the table ------------------------------------------------------------------------------

MOCK = TINY + ["--mock-data", "--vocab-size", "300", "--train-iters", "1"]
DATA = TINY + ["--train-iters", "1"]
CONFIG, CHECKPOINT = "gridtron: configuration error: ", "gridtron: checkpoint error: "
PREPARE = "prepare the data again (python -m engine.data prepare)"
MEMORY = "this run needs about "


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """A directory of bad inputs: recipes, files where directories belong, data of every kind."""
    root = tmp_path_factory.mktemp("bad")
    (root / "afile").write_text("a file, not a directory")
    (root / "outdir").mkdir()
    (root / "emptyck").mkdir()
    recipes = {"dup": "lr: 1.0e-3\nnum_layers: 2\nlr: 2.0e-3\n",
               "dup2": "lr: 1.0e-3\noptim:\n  lr: 2.0e-3\n",
               "dup3": "model:\n  num_layers: 2\nmodel:\n  hidden_size: 64\n",
               "malformed": "num_layers: [2\n", "unknown": "num_layer: 2\n",
               "float": "num_layers: 2.7\n", "section": "model:\n  lr: 1.0\n",
               "bf16": "bf16: true\n", "mixed": "mixed_precision:\n  precision: bf16\n",
               "capacity": "num_experts: 4\nmoe_expert_capacity_factor: .inf\n",
               "range": "block: gpt2\nmodel:\n  ffn_hidden_size: -8\n",
               "lrs": "lr: 1.0e-4\noptim:\n  min_lr: 1.0e-3\n", "grid": "seed: 3\ntp: 2\n"}
    for name, text in recipes.items():
        (root / f"{name}.yaml").write_text(text)
    (root / "latin1.yaml").write_bytes(b"num_layers: 2\n# r\xe9glage\nlr: 1.0e-3\n")
    (root / "t.txt").write_text("some text for the byte tokenizer " * 200)
    (root / "hi.txt").write_text("hi")
    data = root / "data"
    prepare([str(root / "t.txt")], str(data / "good"), tokenizer="byte")
    prepare([str(root / "hi.txt")], str(data / "tiny"), tokenizer="byte")
    write_documents(str(data / "corrupt"), [[97 + d] * 39 for d in range(5)], ByteTokenizer())
    tokens = np.memmap(str(data / "corrupt.bin"), dtype=np.uint16, mode="r+")
    tokens[3 * 40 + 5] = 60000  # document 3
    tokens.flush()
    for name in ("garbled", "lacking", "badtok"):
        prepare([str(root / "t.txt")], str(data / name), tokenizer="byte")
    (data / "garbled.json").write_text("{not json")
    (data / "lacking.json").write_text(json.dumps({"format": "gridtron-data-v2"}))
    meta = json.loads((data / "badtok.json").read_text())
    (data / "badtok.json").write_text(json.dumps({**meta, "tokenizer": "hf"}))
    (data / "badtok.tokenizer.json").write_text("garbage{")
    (root / "tok.json").write_text("{\"model\": 3")
    open(data / "empty.bin", "wb").close()
    write_index(str(data / "empty.idx"), np.uint16, np.zeros(0), np.arange(1))
    (data / "empty.json").write_text(json.dumps({"format": "gridtron-data-v2", "tokenizer": "byte",
                                                 "vocab_size": 257, "eot_id": 256}))
    return str(root)


def tree_digest(root: str) -> dict[str, str]:
    """sha256 of every file under ``root`` (and every directory, as "dir")."""
    out = {}
    for top, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.join(top, d)] = "dir"
        for f in files:
            with open(os.path.join(top, f), "rb") as fh:
                out[os.path.join(top, f)] = hashlib.sha256(fh.read()).hexdigest()
    return out


R = "{root}"
D = "{root}/data"
CASES = [  # (id, argv, the line after its prefix, exit code)
    # -- flags
    ("unknown-flag", MOCK + ["--bogus"], CONFIG + "unknown argument '--bogus' (python -m engine.train "
                                                  "--help lists every flag)", 2),
    ("megatron-flag", MOCK + ["--use-flash-attn"], CONFIG + "--use-flash-attn: kernels are chosen "
                                                            "per device (kernels/); drop the flag", 2),
    ("not-an-int", MOCK + ["--num-layers", "abc"], CONFIG + "argument --num-layers: invalid int value: "
                                                            "'abc' (python -m engine.train --help lists "
                                                            "every flag)", 2),
    ("fp16-bf16", MOCK + ["--fp16", "--bf16"], CONFIG + "--fp16 and --bf16 contradict each other "
                                                        "(both set --precision); give one", 2),
    ("precision-bf16", MOCK + ["--precision", "fp32", "--bf16"],
     CONFIG + "--precision fp32 and --bf16 contradict each other (both set --precision); give one", 2),
    ("fp16-precision", MOCK + ["--fp16", "--precision", "bf16"],
     CONFIG + "--fp16 and --precision bf16 contradict each other (both set --precision); give one", 2),
    ("compile-recompute-dropout", MOCK + ["--compile", "--recompute", "selective", "--dropout", "0.1"],
     CONFIG + "--compile with --recompute selective and dropout (--dropout 0.1, --attention-dropout "
              "0.1) is not supported: the recomputation replays each dropout mask by restoring the "
              "dropout streams' generator states, which a compiled graph cannot do; drop --compile, "
              "use --recompute none, or set both dropouts to 0", 2),
    ("recompute", MOCK + ["--recompute", "full", "--recompute-activations"],
     CONFIG + "--recompute full and --recompute-activations contradict each other (both set "
              "--recompute); give one", 2),
    ("finetune-no-load", MOCK + ["--finetune"],
     CONFIG + "--finetune reads the checkpoint given by --load, and there is none: add --load DIR, "
              "or drop --finetune", 2),
    ("checkpoint-args-no-load", MOCK + ["--use-checkpoint-args"],
     CONFIG + "--use-checkpoint-args reads the checkpoint given by --load, and there is none: add "
              "--load DIR, or drop --use-checkpoint-args", 2),
    ("tp-zero", MOCK + ["--tp", "0"], CONFIG + "--tp must be >= 1, got 0", 2),
    ("rope-odd-head-dim", MOCK + ["--block", "llama", "--hidden-size", "36",
                                  "--num-attention-heads", "12"],
     CONFIG + "--hidden-size 36 / --num-attention-heads 12 gives a head dimension of 3, which is "
              "odd: rotary embeddings turn pairs of channels; choose sizes with an even head "
              "dimension", 2),
    ("ffn-zero", MOCK + ["--ffn-hidden-size", "0"],
     CONFIG + "--ffn-hidden-size must be >= 1, got 0 (leave it out for the block's default width)", 2),
    ("ffn-negative", MOCK + ["--ffn-hidden-size=-8"],
     CONFIG + "--ffn-hidden-size must be >= 1, got -8 (leave it out for the block's default width)", 2),
    ("capacity-inf", MOCK + ["--num-experts", "4", "--moe-expert-capacity-factor", "inf"],
     CONFIG + "--moe-expert-capacity-factor inf must be a finite number > 0 (leave it unset for "
              "dropless routing)", 2),
    ("lr-nan", MOCK + ["--lr", "nan"], CONFIG + "--lr must be a finite number, got nan", 2),
    ("megatron-fp8", MOCK + ["--bf16", "--fp8", "hybrid"],
     CONFIG + "--fp8: gridtron spells it --fp8-format e4m3|hybrid (FP8 GEMMs on top of --bf16)", 2),
    ("world-size", MOCK + ["--tp", "2"], CONFIG + "world size 1 != tp*pp*dp = 2*1*?; launch that many "
                                                  "processes or change --tp/--cp/--pp/--dp", 2),
    # -- recipes
    ("recipe-duplicate", MOCK + ["--config", R + "/dup.yaml"],
     CONFIG + "--config {root}/dup.yaml:3: lr is given twice (lines 1 and 3); keep one", 2),
    ("recipe-duplicate-section", MOCK + ["--config", R + "/dup2.yaml"],
     CONFIG + "--config {root}/dup2.yaml:3: lr is given twice (lr on line 1, optim.lr on line 3); "
              "keep one", 2),
    ("recipe-duplicate-mapping", MOCK + ["--config", R + "/dup3.yaml"],
     CONFIG + "--config {root}/dup3.yaml:3: model is given twice (lines 1 and 3); keep one", 2),
    ("recipe-malformed", MOCK + ["--config", R + "/malformed.yaml"],
     CONFIG + "--config {root}/malformed.yaml:2:1: malformed YAML: expected ',' or ']', but got "
              "'<stream end>'", 2),
    ("recipe-unknown", MOCK + ["--config", R + "/unknown.yaml"],
     CONFIG + "--config {root}/unknown.yaml: unknown key 'num_layer'; did you mean 'num_layers'?", 2),
    ("recipe-type", MOCK + ["--config", R + "/float.yaml"],
     CONFIG + "--config {root}/float.yaml: num_layers: 2.7 is not an integer (int expected)", 2),
    ("recipe-section", MOCK + ["--config", R + "/section.yaml"],
     CONFIG + "--config {root}/section.yaml: 'lr' is not a model key; it belongs under optim:", 2),
    ("recipe-bf16", MOCK + ["--config", R + "/bf16.yaml"],
     CONFIG + "--config {root}/bf16.yaml: unknown key 'bf16': write precision: bf16 (--bf16 is the "
              "command line's switch for it)", 2),
    ("recipe-mixed-precision", MOCK + ["--config", R + "/mixed.yaml"],
     CONFIG + "--config {root}/mixed.yaml: unknown key 'mixed_precision': that is a group of "
              "--help; the recipe's section is precision: (or write its keys flat)", 2),
    ("recipe-capacity-inf", MOCK + ["--config", R + "/capacity.yaml"],
     CONFIG + "--moe-expert-capacity-factor inf must be a finite number > 0 (leave it unset for "
              "dropless routing) (set in --config {root}/capacity.yaml: moe_expert_capacity_factor "
              "on line 2)", 2),
    ("recipe-range", MOCK + ["--config", R + "/range.yaml"],
     CONFIG + "--ffn-hidden-size must be >= 1, got -8 (leave it out for the block's default "
              "width) (set in --config {root}/range.yaml: model.ffn_hidden_size on line 3)", 2),
    ("recipe-two-keys", MOCK + ["--config", R + "/lrs.yaml"],
     CONFIG + "need 0 <= --min-lr <= --lr and --lr > 0, got lr=0.0001 min_lr=0.001 (set in "
              "--config {root}/lrs.yaml: optim.min_lr on line 3, lr on line 1)", 2),
    ("recipe-key-and-flag", MOCK + ["--config", R + "/lrs.yaml", "--lr", "1.0e-5"],
     CONFIG + "need 0 <= --min-lr <= --lr and --lr > 0, got lr=1e-05 min_lr=0.001 (set in "
              "--config {root}/lrs.yaml: optim.min_lr on line 3)", 2),
    ("recipe-grid", MOCK + ["--config", R + "/grid.yaml"],
     CONFIG + "world size 1 != tp*pp*dp = 2*1*?; launch that many processes or change "
              "--tp/--cp/--pp/--dp (set in --config {root}/grid.yaml: tp on line 2)", 2),
    ("recipe-missing", MOCK + ["--config", R + "/none.yaml"],
     CONFIG + "--config {root}/none.yaml: no such file", 2),
    ("recipe-directory", MOCK + ["--config", R + "/outdir"],
     CONFIG + "--config {root}/outdir is a directory; give the recipe's YAML file", 2),
    ("recipe-not-utf8", MOCK + ["--config", R + "/latin1.yaml"],
     CONFIG + "--config {root}/latin1.yaml:2: not UTF-8 text (byte 0xe9 at offset 17); save the "
              "recipe as UTF-8", 2),
    # -- sizes against memory (each within seconds: refused before anything is built)
    ("num-layers-1e9", MOCK + ["--num-layers", "1000000000"], CONFIG + MEMORY, 2),
    ("hidden-size-1e12", MOCK + ["--hidden-size", "1000000000000"], CONFIG + MEMORY, 2),
    ("micro-batch-1e9", MOCK + ["--micro-batch-size", "1000000000", "--global-batch-size", "1000000000"],
     CONFIG + MEMORY, 2),
    ("seq-length-1e8", MOCK + ["--seq-length", "100000000", "--max-position-embeddings", "100000000"],
     CONFIG + MEMORY, 2),
    # -- output paths, checked at start
    ("metrics-file-is-dir", MOCK + ["--metrics-file", R + "/outdir"],
     CONFIG + "--metrics-file {root}/outdir is a directory; give a file name (e.g. "
              "{root}/outdir/metrics.jsonl)", 2),
    ("timeline-under-file", MOCK + ["--timeline", R + "/afile/t.json"],
     CONFIG + "--timeline {root}/afile/t.json: {root}/afile is a file, not a directory; choose a "
              "path you can write to", 2),
    ("plot-is-dir", MOCK + ["--plot", R + "/outdir"],
     CONFIG + "--plot {root}/outdir is a directory; give a file name (e.g. {root}/outdir/loss.png)", 2),
    ("same-file", MOCK + ["--metrics-file", R + "/outdir/m", "--timeline", R + "/outdir/m"],
     CONFIG + "--metrics-file and --timeline are both {root}/outdir/m: each output needs a file of "
              "its own", 2),
    ("save-is-file", MOCK + ["--save", R + "/afile"],
     CONFIG + "--save {root}/afile: {root}/afile is a file, not a directory; choose a directory you "
              "can write to", 2),
    ("run-dir-under-file", MOCK + ["--run-dir", R + "/afile/run"],
     CONFIG + "--save {root}/afile/run/checkpoints: {root}/afile is a file, not a directory; choose a "
              "directory you can write to", 2),
    ("tensorboard-under-file", MOCK + ["--tensorboard-dir", R + "/afile/tb"],
     CONFIG + "--tensorboard-dir {root}/afile/tb: {root}/afile is a file, not a directory; choose a "
              "directory you can write to", 2),
    # -- data checked against the model
    ("token-out-of-vocab", DATA + ["--data-path", D + "/corrupt", "--split", "1,0,0"],
     CONFIG + "data: {root}/data/corrupt.bin: document 3 holds token id 60000, outside the "
              "257-token vocabulary (a corrupt file, or data made with another tokenizer): "
     + PREPARE + ", or pass the tokenizer it was made with", 2),
    ("garbled-sidecar", DATA + ["--data-path", D + "/garbled"],
     CONFIG + "data: {root}/data/garbled.json is not valid JSON (Expecting property name enclosed in "
              "double quotes at line 1 column 2): " + PREPARE, 2),
    ("sidecar-lacks-keys", DATA + ["--data-path", D + "/lacking"],
     CONFIG + "data: {root}/data/lacking.json lacks tokenizer, vocab_size, eot_id: " + PREPARE, 2),
    ("garbled-tokenizer", DATA + ["--data-path", D + "/badtok"],
     CONFIG + "data: {root}/data/badtok.tokenizer.json is not a readable tokenizer file (expected "
              "value at line 1 column 1): " + PREPARE, 2),
    ("garbled-tokenizer-model", DATA + ["--data-path", D + "/good", "--tokenizer-model", R + "/tok.json"],
     CONFIG + "data: {root}/tok.json is not a readable tokenizer file (data did not match any "
              "variant of untagged enum ModelUntagged at line 1 column 11): pass a tokenizer.json that HF tokenizers can read", 2),
    ("empty-data", DATA + ["--data-path", D + "/empty"],
     CONFIG + "data: {root}/data/empty.bin holds no tokens (0 sequences in {root}/data/empty.idx): "
     + PREPARE + " from non-empty text", 2),
    ("no-data", DATA + ["--data-path", D + "/nothing"],
     CONFIG + "--data-path {root}/data/nothing: no prepared data there (expected PREFIX.bin and "
              "PREFIX.idx); run python -m engine.data prepare first", 2),
    ("corpus-too-small", DATA + ["--data-path", D + "/tiny"],
     CONFIG + "data: {root}/data/tiny: the training split (1 of 1 documents, 3 tokens) holds no "
              "sample of seq_length+1 = 33 tokens: use a smaller --seq-length or more data", 2),
    ("vocab-disagrees", DATA + ["--data-path", D + "/good", "--vocab-size", "300"],
     CONFIG + "data: vocab size 300 does not match the data at {root}/data/good, tokenized with byte "
              "(257 tokens): drop --vocab-size or set it to 257", 2),
    ("mock-and-data", MOCK + ["--data-path", D + "/good"],
     CONFIG + "data: mock data and a data path exclude each other: drop --mock-data or --data-path", 2),
    # -- checkpoints
    ("load-missing", MOCK + ["--load", R + "/nothing"], CONFIG + "--load {root}/nothing: no such "
                                                                 "directory", 2),
    ("load-empty", MOCK + ["--load", R + "/emptyck"],
     CHECKPOINT + "{root}/emptyck holds no checkpoint (neither index.json nor latest); pass a "
                  "directory written by --save, or one of its iter_* directories", 2),
]


@pytest.mark.parametrize("argv,line,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_table(bad, capsys, argv, line, code):
    argv = [a.format(root=bad) for a in argv]
    before = tree_digest(bad)
    start = time.monotonic()
    assert train_main(argv) == code
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    expected = line.format(root=bad)
    if line.endswith(MEMORY):  # the figures depend on this host's memory
        assert err.startswith(expected) and "the largest part is" in err, err
        assert elapsed < 10, f"refused after {elapsed:.1f} s"
    else:
        assert err.rstrip("\n") == expected
    assert tree_digest(bad) == before  # nothing on disk changed, nothing created


def test_the_table_covers_every_class():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 40
    lines = [c[2] for c in CASES]
    for what in ("contradict", "is given twice", MEMORY, "is a directory", "not a directory",
                 "token id", "not valid JSON", "tokenizer file", "holds no tokens", "checkpoint error",
                 "(set in --config"):
        assert any(what in line for line in lines), what


# ---- sizes against memory: the check with given numbers ------------------------------------

def test_memory_check_with_given_numbers():
    cfg = parse_args(MOCK + ["--pp", "2", "--num-layers", "4"])
    grid = cfg.parallel.grid(2)
    shape, layout = planner_inputs(cfg, grid)
    for rank in (0, 1):
        terms = stage_memory(shape, layout, rank, "gloo")
        assert memory_problem(cfg, grid, rank, int(terms.total) + 1, "test", "gloo") is None
        parts = {k: v for k, v in terms.as_dict().items() if k not in ("total", "stage")}
        largest = max(parts, key=parts.get)
        problem = memory_problem(cfg, grid, rank, 1000, "of test memory", "gloo")
        assert problem.startswith(f"this run needs about {size_text(terms.total)} of memory on rank "
                                  f"{rank} (pipeline stage {rank}), more than the 1e+03 B of test "
                                  f"memory; the largest part is "), problem
        assert f"({size_text(parts[largest])}, engine/plan/memory.py's estimate): choose " in problem
    assert memory_problem(cfg, grid, 0, None, "unreadable", "gloo") is None  # nothing to refuse by
    # before the data is read the vocabulary counts as one token: a lower bound
    data_cfg = parse_args(TINY + ["--data-path", "x"])
    low, _ = planner_inputs(data_cfg, data_cfg.parallel.grid(1), 1)
    assert low.vocab_size == 1
    with pytest.raises(ConfigError, match="more than the 1e\\+03 B given"):
        validate_run(parse_args(MOCK), LaunchEnv(), memory=(1000, "given"))


def test_normal_runs_fit(tmp_path):
    """make train's recipe on its 8 processes and the suite's small models are not refused."""
    from engine.device.runtime import available_memory
    recipe = os.path.join(ROOT, "configs", "train_3d.yaml")
    cfg = parse_args(["--config", recipe, "--run-dir", str(tmp_path / "3d")])
    for rank in range(8):
        validate_run(cfg, LaunchEnv(rank, 8, rank, 8))
    assert available_memory("cpu", 0, 8)[0] is not None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4000 kB\nMemAvailable:    1000 kB\n")
    assert available_memory("cpu", 0, 2, str(meminfo)) == (512000, "host memory available "
                                                           "(MemAvailable, shared by 2 processes on "
                                                           "this node)")
    meminfo.write_text("MemTotal: 4000 kB\n")
    assert available_memory("cpu", 0, 1, str(meminfo))[0] is None


def test_warm_up_longer_than_the_run_is_a_warning():
    _, notes = validate_run(parse_args(MOCK + ["--lr-warmup-iters", "50", "--train-iters", "20",
                                               "--lr", "0.001"]), LaunchEnv())
    assert notes == ["--lr-warmup-iters 50 is longer than the run (--train-iters 20): the learning "
                     "rate ends at 0.0004 and never reaches --lr 0.001; shorten the warm-up or "
                     "train longer"]
    assert validate_run(parse_args(MOCK), LaunchEnv())[1] == []  # the default warm-up says nothing


def test_compile_with_dropout_is_said_to_break_the_graph():
    _, notes = validate_run(parse_args(MOCK + ["--compile", "--dropout", "0.1"]), LaunchEnv())
    assert notes == ["--compile with dropout (--dropout 0.1, --attention-dropout 0.1): each dropout "
                     "site breaks the compiled graph (the dropout streams save and restore the "
                     "generator's state there, which Dynamo does not trace), so a chunk compiles in "
                     "pieces that nothing fuses across (a 2-layer gpt2 chunk: 10 graphs); set both "
                     "dropouts to 0 for one graph"]
    assert validate_run(parse_args(MOCK + ["--compile"]), LaunchEnv())[1] == []


def test_compile_with_moe_experts_in_a_loop_is_said():
    """The experts' loop reads their row counts on the host: fp16 on the CPU (torch._grouped_mm
    takes fp32 and bf16 there), fp32 on CUDA (bf16 only), and --no-moe-grouped-gemm anywhere."""
    from engine.training.validate import _experts_loop
    moe = MOCK + ["--compile", "--num-experts", "4"]
    _, notes = validate_run(parse_args(moe + ["--precision", "fp16"]), LaunchEnv())
    assert notes == ["--compile with MoE: torch._grouped_mm takes float32, bfloat16 on cpu, not "
                     "--precision fp16: the experts run as a loop, which reads the experts' row "
                     "counts on the host: the compiled chunk breaks at every expert projection (a "
                     "2-layer MoE chunk: 14 graphs over 3 steps where the grouped GEMM gives 1)"]
    assert validate_run(parse_args(moe), LaunchEnv())[1] == []
    assert _experts_loop(parse_args(moe), "cuda") == ("torch._grouped_mm takes bfloat16 on cuda, "
                                                      "not --precision fp32: the experts run as a "
                                                      "loop")
    assert _experts_loop(parse_args(moe + ["--precision", "bf16"]), "cuda") is None
    assert _experts_loop(parse_args(moe + ["--no-moe-grouped-gemm"]), "cpu") == \
        "--no-moe-grouped-gemm runs the experts as a loop"


# ---- two ranks -------------------------------------------------------------------------------

def build_each(ps, cases):
    """Per case, this rank's Trainer from its own argv: the Disagreement it raised, or "built"."""
    out = []
    for argvs in cases:
        try:
            trainer = Trainer(parse_args(argvs[ps.rank]))
        except Disagreement as exc:
            out.append(str(exc))
            continue
        trainer.close()
        out.append("built")
    return out


def test_ranks_that_disagree_stop_on_every_rank():
    same = MOCK + ["--lr", "0.001"]
    cases = [(same, MOCK + ["--lr", "0.002", "--seed", "7"]), (same, same),
             (MOCK + ["--run-dir", "a"], MOCK + ["--run-dir", "b"])]
    results = run_distributed(build_each, grid=RankGrid(dp=2), args=(cases,), timeout_s=60)
    assert results[0] == results[1]  # every rank raises the same line
    lr, agreed, paths = results[0]
    assert lr == ("ranks started with different configurations: rank 1 has --lr 0.002 (rank 0: "
                  "0.001), --seed 7 (rank 0: 1234); start every rank with the same flags and recipe")
    assert agreed == "built"
    assert paths.startswith("ranks started with different configurations: rank 1 has --metrics-file "
                            "b/metrics.jsonl (rank 0: a/metrics.jsonl), --plot b/loss.png")


def launch_ranks(port: int, per_rank: dict[int, list[str]], timeout_s: float = 5) -> dict:
    """Start ``python -m engine.train`` as the given ranks of a world of 2 (the others never come);
    returns {rank: (exit code, stderr lines that are not Python warnings)}."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = {r: subprocess.Popen([sys.executable, "-m", "engine.train", *argv, "--timeout-s",
                                  str(timeout_s)], cwd=ROOT, env={**env, "RANK": str(r),
                                                                  "LOCAL_RANK": str(r)},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r, argv in per_rank.items()}
    return procs


def finish(procs) -> dict:
    out = {}
    for r, p in procs.items():
        err = p.communicate(timeout=120)[1]
        out[r] = (p.returncode, [ln for ln in err.splitlines()
                                 if ln.startswith("gridtron:") or "Error" in ln or "frame #" in ln])
    return out


def test_one_line_once_and_a_missing_peer_named(bad):
    """Two ranks under a launch: a mistake is printed once, by the lowest rank that found it, and
    every rank exits 2 (ranks that disagree: by every rank); a rank that never comes is named
    within --timeout-s (exit 1)."""
    empty = os.path.join(bad, "emptyck")
    runs = {  # every launch at once: they share the start-up time
        "disagree": {0: MOCK + ["--lr", "0.001"], 1: MOCK + ["--lr", "0.002"]},
        "rank1-only": {0: MOCK, 1: MOCK + ["--bogus"]},
        "after-the-group": {0: MOCK + ["--load", empty], 1: MOCK + ["--load", empty]},
        "missing-rank1": {0: MOCK},
        "missing-rank0": {1: MOCK},
    }
    start = time.monotonic()
    procs = {name: launch_ranks(free_port(), per_rank, timeout_s=3 if "missing" in name else 30)
             for name, per_rank in runs.items()}
    got = {name: finish(p) for name, p in procs.items()}
    assert time.monotonic() - start < 90
    disagree = ["gridtron: configuration error: ranks started with different configurations: rank 1 "
                "has --lr 0.002 (rank 0: 0.001); start every rank with the same flags and recipe"]
    assert got["disagree"] == {0: (2, disagree), 1: (2, disagree)}  # each rank's log says it
    assert got["rank1-only"] == {0: (2, []), 1: (2, ["gridtron: configuration error: unknown argument "
                                                     "'--bogus' (python -m engine.train --help lists "
                                                     "every flag)"])}
    assert got["after-the-group"] == {0: (2, [f"gridtron: checkpoint error: {empty} holds no "
                                              f"checkpoint (neither index.json nor latest); pass a "
                                              f"directory written by --save, or one of its iter_* "
                                              f"directories"]), 1: (2, [])}
    (code, lines), = got["missing-rank1"].values()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(
        "gridtron: rank 1 of 2 did not arrive at the rendezvous (127.0.0.1:"), lines
    assert lines[0].endswith("within --timeout-s 3 s: start it (or check its logs), or raise "
                             "--timeout-s")
    (code, lines), = got["missing-rank0"].values()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(
        "gridtron: rank 1 found no rendezvous store at 127.0.0.1:"), lines
    assert "within --timeout-s 3 s: rank 0, which serves it, did not arrive" in lines[0]


# ---- a checkpoint of another model ------------------------------------------------------------

def test_checkpoint_of_another_model_names_what_differs(saved, tmp_path, capsys):
    """A mixture-of-experts checkpoint into a dense run, another expert count, other MoE layers or
    expert width, a dense checkpoint into an MoE run: one line naming the flag and both values
    (--load); the same checkpoint in --save is another run's, named by its recipe."""
    from tests.fixtures.make_moe_ckpt_v1 import COMMON, HERE
    fix = os.path.join(HERE, "gpt2", "iter_0000002")  # 4 experts of width 8, top-2, MoE layers 0, 1
    dense = COMMON[:COMMON.index("--num-experts")]
    dense = dense[:dense.index("--timeout-s")] + ["--train-iters", "4"]  # (a note in one process)
    fix_flags = ["--num-experts", "4", "--moe-ffn-hidden-size", "8"]
    fix_use = "use the checkpoint's model shape (--use-checkpoint-args) or start without --load"
    cases = [
        (dense + ["--load", fix], f"checkpoint {fix} was saved with --num-experts 4 but this run "
                                  f"has no --num-experts (a dense model): {fix_use}"),
        (dense + ["--num-experts", "8", "--moe-ffn-hidden-size", "8", "--load", fix],
         f"checkpoint {fix} was saved with --num-experts 4 but this run has --num-experts 8: "
         f"{fix_use}"),
        (dense + fix_flags + ["--moe-layer-freq", "[0,1]", "--load", fix],
         f"checkpoint {fix} was saved with --moe-layer-freq 1 (MoE layers [0, 1]) but this run has "
         f"--moe-layer-freq [0,1] (MoE layers [1]): {fix_use}"),
        (dense + ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--load", fix],
         f"checkpoint {fix} was saved with --moe-ffn-hidden-size 8 but this run has "
         f"--moe-ffn-hidden-size 16: {fix_use}"),
        (TINY + ["--mock-data", "--vocab-size", "300", "--train-iters", "3", "--num-experts", "4",
                 "--load", saved],
         f"checkpoint {os.path.join(saved, 'iter_0000001')} was saved without --num-experts (a dense "
         f"model) but this run has --num-experts 4: use the checkpoint's model shape "
         f"(--use-checkpoint-args) or start without --load"),
    ]
    for argv, line in cases:
        assert train_main(argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert err == [f"{CHECKPOINT}{line}"], err
    run = tmp_path / "ck"  # the same checkpoint in --save: another run, by its recipe
    os.makedirs(run)
    os.symlink(fix, run / "iter_0000002")
    os.symlink("iter_0000002", run / "latest")
    assert train_main(dense + ["--save", str(run)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"{CHECKPOINT}--save {run} holds the checkpoints of another run (step 2, gpt2 layers=2 "
        f"hidden=16 heads=2 experts=4 top-2; another recipe: --num-experts 4 there, unset here; "
        f"--moe-ffn-hidden-size 8 there, unset here): pass --load {run} --use-checkpoint-args to "
        f"continue it"), err
