"""Checkpoint format and exact resumption on the same layout: the region reader, atomic saves,
--keep-last, auto-resume from --save, inspect, and per-rank state (RNG, compression residuals,
bf16 masters under ZeRO-1)."""
import io
import json
import math
import os

import pytest
import torch

import engine.checkpoint as ckpt_mod
import engine.checkpoint.writer as ckpt_writer
from engine.checkpoint import main as checkpoint_main
from engine.checkpoint.index import FORMAT, write_shard
from engine.checkpoint.tensor_reader import TensorReader
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1"]


def losses(argv: list[str]) -> list[float]:
    trainer = Trainer(parse_args(TINY + argv))
    try:
        return [r["loss"] for r in trainer.train().records]
    finally:
        trainer.close()


def test_reader_reads_boxes_and_flat_ranges(tmp_path):
    """A (10, 6) tensor stored as one box (rows 0-3) and two flat ranges of the box rows 4-9; any
    box or flat range reads back exactly, rows past the logical shape read as zero padding."""
    full = torch.randn(10, 6)
    rest = full[4:].reshape(-1)
    info = write_shard({"a": full[:4], "b": rest[:17], "c": rest[17:]}, str(tmp_path / "f.safetensors"))
    pieces = [{"file": "f.safetensors", "key": "a", "offsets": [0, 0], "shape": [4, 6]},
              {"file": "f.safetensors", "key": "b", "offsets": [4, 0], "shape": [6, 6], "flat": [0, 17]},
              {"file": "f.safetensors", "key": "c", "offsets": [4, 0], "shape": [6, 6], "flat": [17, 36]}]
    index = {"format": FORMAT, "files": {"f.safetensors": info},
             "tensors": {"t": {"shape": [10, 6], "dtype": "float32", "pieces": pieces}}}
    reader = TensorReader(str(tmp_path), index)
    padded = torch.cat([full, torch.zeros(6, 6)])  # (16, 6), as a vocab shard past the end
    for off, shape in [((0, 0), (10, 6)), ((2, 1), (5, 4)), ((5, 3), (3, 2)), ((8, 0), (8, 6)), ((3, 0), (1, 6))]:
        want = padded[off[0]:off[0] + shape[0], off[1]:off[1] + shape[1]]
        assert torch.equal(reader.read("t", off, shape), want), (off, shape)
    for off, shape, flat in [((0, 0), (10, 6), (13, 47)), ((4, 2), (6, 3), (1, 17)), ((8, 0), (8, 6), (5, 40))]:
        box = padded[off[0]:off[0] + shape[0], off[1]:off[1] + shape[1]].reshape(-1)
        assert torch.equal(reader.read("t", off, shape, flat=flat), box[flat[0]:flat[1]]), (off, flat)
    index["tensors"]["t"]["pieces"] = pieces[:2]  # elements 17.. of rows 4-9 now missing
    with pytest.raises(ckpt_mod.CheckpointError, match="does not cover t"):
        TensorReader(str(tmp_path), index).read("t", (0, 0), (10, 6))


def test_crash_mid_save_keep_last_and_auto_resume(tmp_path, monkeypatch):
    args = ["--train-iters", "6", "--save-interval", "2", "--keep-last", "2", "--dropout", "0.1"]
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = losses(args + ["--save", ref_dir])
    assert sorted(os.listdir(ref_dir)) == ["iter_0000004", "iter_0000006", "latest"]
    assert os.readlink(os.path.join(ref_dir, "latest")) == "iter_0000006"
    for root, _, files in os.walk(ref_dir):
        assert all(f.endswith((".json", ".safetensors")) for f in files), files  # no pickle anywhere
    # resuming from step 4 repeats steps 5-6 bit for bit (dropout on: the RNG state is restored)
    assert losses(args + ["--load", os.path.join(ref_dir, "iter_0000004")]) == ref[4:]

    calls = {"n": 0}
    real_write = ckpt_writer.write_shard

    def failing_write(tensors, path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")  # the save at step 4 dies half-way
        return real_write(tensors, path)

    monkeypatch.setattr(ckpt_writer, "write_shard", failing_write)
    with pytest.raises(ckpt_mod.CheckpointError, match="OSError: disk full; latest still names"):
        losses(args + ["--save", run_dir])
    monkeypatch.setattr(ckpt_writer, "write_shard", real_write)
    assert sorted(os.listdir(run_dir)) == ["iter_0000002", "iter_0000004.tmp", "latest"]
    assert os.readlink(os.path.join(run_dir, "latest")) == "iter_0000002"
    # no --load: the run resumes from --save's latest checkpoint and finishes like the reference
    assert losses(args + ["--save", run_dir]) == ref[2:]
    assert sorted(os.listdir(run_dir)) == ["iter_0000004", "iter_0000006", "latest"]
    # a finished run is neither resumed nor replaced (tests/engine/checkpoint/test_overwrite.py)
    trainer = Trainer(parse_args(TINY + args + ["--save", run_dir]))
    with pytest.raises(ckpt_mod.CheckpointError, match="holds the checkpoints of another run"):
        trainer.maybe_load()
    trainer.close()


def test_inspect(tmp_path):
    save = str(tmp_path / "ck")
    losses(["--train-iters", "2", "--save", save, "--use-distributed-optimizer"])
    out = io.StringIO()
    assert ckpt_mod.inspect(save, out=out) == 0
    text = out.getvalue()
    assert "step 2" in text and "tp=1 pp=1 dp=1" in text and "zero1=True" in text
    assert "model/layers.1.mlp.fc2.weight" in text and "[64, 256]" in text
    assert "optim/exp_avg_sq/embedding.word.weight" in text and "[300, 64]" in text
    assert "checksums: all files verified" in text
    assert checkpoint_main(["inspect", save]) == 0
    index = json.load(open(os.path.join(save, "iter_0000002", "index.json")))
    assert index["sampler"]["next_step"] == 2 and index["optimizer"]["step"] == 2
    assert index["model"]["hidden_size"] == 64 and index["data"]["vocab_size"] == 300


TOPK = ["--grad-compression", "topk", "--grad-compression-ratio", "0.1", "--grad-compression-warmup-steps", "1"]


def same_layout_resumes(ps, root):
    """dp=2 runs whose per-rank state matters, each resumed from step 2 of a 4-step run; then a
    compressed ZeRO-2 checkpoint resumed without ZeRO (another layout: residuals are folded, the
    velocities start from their mean)."""
    out = {}
    for tag, extra in [("topk", TOPK),
                       ("topk-fp16-zero2", TOPK + ["--precision", "fp16", "--initial-loss-scale", "4096",
                                                   "--use-distributed-optimizer", "--zero-stage", "2"]),
                       ("bf16-zero", ["--precision", "bf16", "--use-distributed-optimizer"]),
                       ("fp16", ["--precision", "fp16", "--initial-loss-scale", "4096",
                                 "--loss-scale-window", "2"])]:
        save = os.path.join(root, tag)
        full = losses(extra + ["--train-iters", "4", "--save", save, "--save-interval", "2"])
        resumed = losses(extra + ["--train-iters", "4", "--load", os.path.join(save, "iter_0000002")])
        out[tag] = (full, resumed)
    topk2 = ["--train-iters", "4", "--load", os.path.join(root, "topk", "iter_0000002")]
    # other buckets on the same grid: the residuals are folded from their logical tensors (laid
    # out as saved they raised a shape error, a traceback on every rank)
    int8 = ["--grad-compression", "int8", "--grad-compression-warmup-steps", "1"]
    save = os.path.join(root, "int8")
    int8_full = losses(int8 + ["--train-iters", "4", "--save", save, "--save-interval", "2"])
    out["int8 other buckets"] = (int8_full, losses(int8 + ["--train-iters", "4", "--bucket-size-mb", "0.001",
                                                      "--load", os.path.join(save, "iter_0000002")]))
    # fresh AdamW moments: the compression warm-up (1 step) starts again, so the first resumed
    # step is plain AdamW as without compression (at the saved step, the frozen-variance update
    # divided by a second moment of zeros)
    out["topk no-load-optim"] = (losses(TOPK + topk2 + ["--no-load-optim"]),
                                 losses(topk2 + ["--no-load-optim"]))
    # ZeRO-2 -> stage 0: the summed residuals are what the checkpoint holds, nothing lost
    ckpt = os.path.join(root, "topk-zero2")
    full = losses(TOPK + ["--use-distributed-optimizer", "--zero-stage", "2", "--train-iters", "4",
                          "--save", ckpt, "--save-interval", "2"])
    trainer = Trainer(parse_args(TINY + TOPK + ["--train-iters", "4", "--load", os.path.join(ckpt, "iter_0000002")]))
    trainer.maybe_load()
    from engine.checkpoint import param_specs, read_index
    from parallel.dp.residuals import logical_residual_pieces
    path = os.path.join(ckpt, "iter_0000002")
    reader = TensorReader(path, read_index(path))
    specs = {sp.name: sp for sp in param_specs(trainer.chunks, ps, trainer.cfg.model.vocab_size)}
    pieces = logical_residual_pieces(trainer.reducer, ps)
    for name, param, a, b, t in pieces:
        saved = reader.read(f"optim/grad_residual/{name}", specs[name].offsets, list(param.shape), flat=(a, b))
        torch.testing.assert_close(t, saved, rtol=1e-6, atol=1e-9)
    held = sum(float(t.abs().sum()) for *_, t in pieces)
    # top-k's per-rank velocities: every rank of the new layout starts from their DP mean
    moments = logical_residual_pieces(trainer.reducer, ps, "momentum")
    assert moments
    for name, param, a, b, t in moments:
        saved = reader.read(f"optim/grad_momentum/{name}", specs[name].offsets, list(param.shape), flat=(a, b))
        torch.testing.assert_close(t, saved, rtol=1e-6, atol=1e-9)
    trainer.close()
    out["zero2->stage0"] = (full, losses(TOPK + ["--train-iters", "4", "--load", path]), held)
    return out


def test_same_layout_per_rank_state(tmp_path):
    results = run_distributed(same_layout_resumes, grid=RankGrid(dp=2), args=(str(tmp_path),))
    full, resumed, held = results[0].pop("zero2->stage0")
    int8, other_buckets = results[0].pop("int8 other buckets")   # step 3 from the same weights
    assert len(other_buckets) == 2 and other_buckets[0] == int8[2]
    assert other_buckets[1] == pytest.approx(int8[3], rel=1e-4)
    fresh_topk, fresh_plain = results[0].pop("topk no-load-optim")
    assert fresh_topk == fresh_plain       # (2 steps: the first resumed one is the warm-up's)
    # step 3 is trained from the same parameters. From step 4 on the runs differ: the stage-0
    # exchange (two phases) delivers another sparse sum than ZeRO-2's (one phase), and each rank
    # selects its top-k from the mean velocity instead of its own; what carries over exactly, the
    # pending residual mass and the mean velocity, is checked against the checkpoint above
    assert held > 0 and resumed[0] == pytest.approx(full[2], rel=1e-6)
    assert len(resumed) == 2 and all(math.isfinite(x) for x in resumed)
    for tag, (full, resumed) in results[0].items():
        assert resumed == full[2:], tag
    index = json.load(open(tmp_path / "topk" / "iter_0000002" / "index.json"))
    assert any(k.startswith("residual/") for k in index["ranks"]["1"]["own"])  # error feedback kept
    bf16 = json.load(open(tmp_path / "bf16-zero" / "iter_0000002" / "index.json"))["tensors"]
    assert bf16["model/layers.0.attn.qkv.weight"]["dtype"] == "bfloat16"
    assert bf16["optim/master/layers.0.attn.qkv.weight"]["dtype"] == "float32"
    fp16 = json.load(open(tmp_path / "fp16" / "iter_0000002" / "index.json"))
    assert fp16["scaler"]["scale"] == 4096 * 2  # grew once after its window of 2 clean steps


def one_rank_cannot_read_its_part(ps, root):
    """pp=2: a checkpoint whose index lacks a tensor only the second stage reads (it verifies:
    the files are intact). That rank's read fails; every rank must say so in the same line."""
    save = os.path.join(root, "pp2")
    losses(["--pp", "2", "--train-iters", "2", "--save", save, "--save-interval", "2"])
    ckpt = os.path.join(save, "iter_0000002")
    if ps.rank == 0:
        path = os.path.join(ckpt, "index.json")
        index = json.load(open(path))
        del index["tensors"]["model/layers.1.mlp.fc2.weight"]   # stage 1's layer
        json.dump(index, open(path, "w"))
    ps.world_group.barrier()
    try:
        losses(["--pp", "2", "--train-iters", "4", "--load", ckpt])
    except ckpt_mod.CheckpointError as exc:
        return str(exc)
    return None


def test_a_rank_that_cannot_read_its_part_stops_every_rank_with_one_line(tmp_path):
    """Without the agreement rank 0 would train on into its first transfer from rank 1 and wait
    there for the communication timeout (here 20 s, then a gloo error, not this line)."""
    lines = run_distributed(one_rank_cannot_read_its_part, grid=RankGrid(pp=2),
                            args=(str(tmp_path),), timeout_s=20.0)
    want = (f"rank 1: checkpoint {tmp_path}/pp2/iter_0000002 has no tensor layers.1.mlp.fc2.weight: "
            f"it was saved from a different model (block or layer count)")
    assert lines == [want, want]


def test_a_reducer_step_that_counted_skipped_steps_is_bounded_on_resume(tmp_path):
    """A checkpoint written before skipped steps left the compression warm-up uncounted may hold a
    reducer step above its applied updates + 1; resumed, the step is the applied updates + 1, so
    compression does not start early (the bound is what GradReducer.step_skipped keeps)."""
    base = TINY + ["--micro-batch-size", "2", "--global-batch-size", "4"]
    trainer = Trainer(parse_args(base + ["--train-iters", "2", "--save", str(tmp_path / "ck"),
                                         "--save-interval", "2"]))
    trainer.train()
    trainer.close()
    path = tmp_path / "ck" / "iter_0000002" / "index.json"
    index = json.loads(path.read_text())
    assert index["reducer"]["step"] == index["schedule_step"] + 1 == 3
    index["reducer"]["step"] = 5     # as if two skipped steps had been counted
    path.write_text(json.dumps(index))
    trainer = Trainer(parse_args(base + ["--train-iters", "3", "--load", str(path.parent)]))
    trainer.train()
    assert trainer.reducer.step == 4   # 3 loaded, then step 3 applied
    trainer.close()
