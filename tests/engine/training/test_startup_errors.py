"""Mistakes found while the run starts that arrive as OS or device errors: each ends with one
``gridtron: configuration error:`` line and exit 2 on every rank, no traceback, and no rank left
waiting in a collective."""
import types

import pytest
import torch

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.device import runtime
from engine.training import validate
from engine.training.launch import main as train_main
from engine.training.run_data import build_run_data

ARGS = ["--no-progress", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_ERROR_FILE", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture
def launch_env(monkeypatch):
    """This process's launch variables, none set by the caller's shell."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))
    return set_


def test_more_processes_than_visible_devices_is_one_line(monkeypatch, launch_env, capsys):
    """16 processes on a node whose processes see 8 GPUs: the memory check, which binds the
    device first, stops the rank with the device binding's sentence (no ValueError traceback)."""
    monkeypatch.setattr(validate, "detect_device_type", lambda requested="auto": "cuda")
    monkeypatch.setattr(runtime, "device_count", lambda kind: 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (80 * 2 ** 30, 96 * 2 ** 30))
    launch_env(RANK=3, WORLD_SIZE=16, LOCAL_RANK=3, LOCAL_WORLD_SIZE=16)
    assert train_main(ARGS + ["--mock-data", "--vocab-size", "64", "--global-batch-size", "16"]) == 2
    assert capsys.readouterr().err == (
        "gridtron: configuration error: 16 processes on this node (LOCAL_WORLD_SIZE) but only 8 "
        "visible devices: two processes would share one; give each process its own device or "
        "start 8 per node\n")


def test_a_cache_dir_under_a_file_is_one_line(tmp_path, launch_env, capsys):
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"
    assert train_main(ARGS + ["--global-batch-size", "1", "--cache-dir", str(cache)]) == 2
    assert capsys.readouterr().err == (
        f"gridtron: configuration error: data: {cache}: Not a directory; check the paths of "
        f"--data-path, --cache-dir and the tokenizer files: data and tokenizer files readable, "
        f"the cache a directory you can write to\n")


def _trainer(cfg, rank, sent):
    """What build_run_data reads of a two-rank trainer; the world group's broadcast records what
    rank 0 sends and gives the other rank ``sent``."""
    def broadcast_object(obj, src=0):
        if rank == 0:
            sent.append(obj)
            return obj
        return sent[0]
    ps = types.SimpleNamespace(rank=rank, world_size=2,
                               world_group=types.SimpleNamespace(broadcast_object=broadcast_object))
    return types.SimpleNamespace(cfg=cfg, ps=ps, progress=False)


def test_rank_0_that_cannot_prepare_the_corpus_tells_every_rank(tmp_path):
    """With two ranks rank 0 alone prepares the built-in corpus: an OS error there goes into the
    broadcast every rank waits in, and both stop on the same line, instead of rank 0 raising
    before it and the other rank waiting out --timeout-s."""
    (tmp_path / "file").write_text("")
    cfg = parse_args(ARGS + ["--global-batch-size", "2", "--cache-dir",
                             str(tmp_path / "file" / "cache")])
    sent = []
    with pytest.raises(ConfigError) as first:
        build_run_data(_trainer(cfg, 0, sent))
    assert sent == [("config", str(first.value))] and str(first.value).startswith(
        f"data: {tmp_path / 'file' / 'cache'}: Not a directory; check the paths of --data-path")
    with pytest.raises(ConfigError) as other:
        build_run_data(_trainer(cfg, 1, sent))
    assert str(other.value) == str(first.value)


def test_a_defect_on_rank_0_preparing_the_corpus_ends_every_rank(monkeypatch):
    """An exception that is not the user's mistake (here a RuntimeError from the corpus build on
    rank 0) also goes into the broadcast: rank 0 raises it with its traceback, the other rank a
    RuntimeError naming it, instead of waiting in the broadcast for --timeout-s."""
    import engine.training.run_data as run_data

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer training failed")
    monkeypatch.setattr(run_data, "build_data", broken)
    cfg = parse_args(ARGS + ["--global-batch-size", "2"])
    sent = []
    with pytest.raises(RuntimeError, match="^tokenizer training failed$"):
        build_run_data(_trainer(cfg, 0, sent))
    assert sent == [("error", "RuntimeError: tokenizer training failed")]
    with pytest.raises(RuntimeError) as other:
        build_run_data(_trainer(cfg, 1, sent))
    assert str(other.value) == ("rank 0 failed to prepare the built-in corpus (RuntimeError: "
                                "tokenizer training failed); its traceback is in rank 0's output")
