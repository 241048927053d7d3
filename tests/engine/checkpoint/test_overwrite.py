"""Nothing is lost: a run never replaces another run's checkpoints. A fresh run whose --save (or
--run-dir/checkpoints) holds another run's stops before training with one line, every file as it
was (sha256 before and after); --overwrite moves them aside until the new run's first checkpoint is
published, and a crash before that leaves them loadable; a run whose recipe matches the directory's
unfinished run resumes. On 1 rank through engine.training.launch.main and the Trainer, and on 2
gloo ranks. Also: --load's "loaded" line, --use-checkpoint-args against an explicit size."""
import json
import os
import shutil

import pytest

import engine.checkpoint.writer as writer
from engine.base import ConfigError
from engine.checkpoint import CheckpointError, read_index, resolve, saved_step
from engine.training.launch import main as train_main
from engine.training.launch import run_config
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.helpers.training import train_records
from tests.helpers.files import tree_digests

TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1", "--log-interval", "1"]
SHAPE = "gpt2 layers=2 hidden=64 heads=4"


def records(argv, cls=Trainer) -> list[dict]:
    return train_records(TINY + argv, cls)


class CrashAtStep3(Trainer):
    """Dies before step 3 (a worker lost after the checkpoint of step 2)."""

    def train_one(self, step):
        if step == 2:
            raise RuntimeError("worker lost")
        return super().train_one(step)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run in ``ck`` (--save) and one in ``run`` (--run-dir), both 2 layers."""
    root = tmp_path_factory.mktemp("finished")
    ck, run = str(root / "ck"), str(root / "run")
    records(["--train-iters", "2", "--save", ck, "--save-interval", "1"])
    records(["--train-iters", "2", "--run-dir", run])
    return {"ck": ck, "run": run, "root": str(root)}


def refusal(ck: str, what: str, cont: str, flag: str | None = None) -> str:
    return (f"gridtron: checkpoint error: {flag or f'--save {ck}'} holds the checkpoints of another "
            f"run (step 2, {SHAPE}; {what}): pass --load {ck}{cont}, give this run a new --run-dir or "
            f"--save, or add --overwrite to replace them (they are moved to {ck}/overwritten and "
            f"deleted once this run's first checkpoint is saved)")


def test_another_runs_checkpoints_are_refused_untouched(finished, capsys):
    ck, run = finished["ck"], finished["run"]
    finished_run = refusal(ck, "a finished run: step 2, and this run's --train-iters is 2",
                           " to continue it (with a --train-iters above 2)")
    cases = [
        (["--train-iters", "2", "--save", ck], finished_run),
        (["--train-iters", "2", "--save", ck, "--save-interval", "1", "--lr", "1e-3"], finished_run),
        (["--train-iters", "4", "--save", ck, "--num-layers", "1"],
         refusal(ck, "another recipe: --num-layers 2 there, 1 here",
                 " --use-checkpoint-args to continue it")),
        (["--train-iters", "4", "--save", ck, "--vocab-size", "256", "--seed", "7"],
         refusal(ck, "another recipe: --seed 1234 there, 7 here; --vocab-size 300 there, 256 here",
                 " to continue it")),
        (["--train-iters", "4", "--save", ck, "--load", run + "/checkpoints", "--global-batch-size", "8"],
         refusal(ck, "another recipe: --global-batch-size 4 there, 8 here", " to continue it")),
        (["--train-iters", "4", "--run-dir", run, "--hidden-size", "32"],
         refusal(f"{run}/checkpoints", "another recipe: --hidden-size 64 there, 32 here; "
                 "--ffn-hidden-size 256 there, 128 here",
                 " --use-checkpoint-args to continue it", flag=f"--run-dir {run}: {run}/checkpoints")),
        (["--train-iters", "4", "--save", f"{ck}/iter_0000002"],
         f"gridtron: checkpoint error: --save {ck}/iter_0000002 is one checkpoint (it holds index.json), "
         f"not a directory of them: save into {ck} or a new directory (and --load {ck}/iter_0000002 to "
         f"start from it)"),
    ]
    capsys.readouterr()
    for argv, line in cases:
        before = tree_digests(finished["root"])
        assert train_main(TINY + argv) == 2, argv
        out = capsys.readouterr()
        assert out.err.splitlines() == [line], argv
        assert "Traceback" not in out.err and "gridtron: tp=" not in out.out, argv  # never started
        assert tree_digests(finished["root"]) == before, argv  # metrics, timeline, checkpoints alike


def test_a_damaged_save_directory_is_named_not_replaced(finished, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(finished["ck"], ck, symlinks=True)
    with open(os.path.join(ck, "iter_0000002", "index.json"), "w") as fh:
        fh.write('{"format": "gridtron-checkpoint-v1", "step": "two"}')
    before = tree_digests(ck)
    capsys.readouterr()
    for extra in ([], ["--overwrite"]):
        assert train_main(TINY + ["--train-iters", "4", "--num-layers", "1", "--save", ck] + extra) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and f"{ck}/iter_0000002/index.json is damaged: its step is 'two', not a " \
            f"number of optimizer steps; the earlier checkpoint {ck}/iter_0000001 is intact" in err[0]
        assert tree_digests(ck) == before


def test_overwrite_moves_aside_until_the_first_checkpoint(finished, tmp_path, monkeypatch, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(finished["ck"], ck, symlinks=True)
    before = tree_digests(ck)
    seen = []
    real_publish = writer.publish

    def publish(snap):  # the state of the directory as the new run's first checkpoint is published
        seen.append((sorted(os.listdir(ck)), tree_digests(os.path.join(ck, "overwritten"))))
        real_publish(snap)

    monkeypatch.setattr(writer, "publish", publish)
    capsys.readouterr()
    argv = ["--train-iters", "2", "--num-layers", "1", "--save", ck, "--save-interval", "1", "--overwrite"]
    assert [r["step"] for r in records(argv)] == [1, 2]
    out = capsys.readouterr().out
    assert (f"gridtron: --overwrite: moved the checkpoints in {ck} (step 2, {SHAPE}) to {ck}/overwritten; "
            f"they are deleted once this run's first checkpoint is saved (until then --load "
            f"{ck}/overwritten continues that run)") in out.splitlines()
    listing, aside = seen[0]
    assert listing == ["iter_0000001.tmp", "overwritten"]  # nothing of the old run left in place
    assert aside == before  # moved, byte for byte (latest still names its iter_0000002)
    assert seen[1][1] == {}  # the first publish removed them
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000002", "latest"]
    assert read_index(resolve(ck))["model"]["num_layers"] == 1


def test_a_crash_before_the_first_checkpoint_keeps_them(finished, tmp_path, monkeypatch, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(finished["ck"], ck, symlinks=True)
    before = tree_digests(ck)
    real_write = writer.write_shard

    def failing_write(tensors, path):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "write_shard", failing_write)
    argv = ["--train-iters", "2", "--num-layers", "1", "--save", ck, "--save-interval", "1"]
    with pytest.raises(CheckpointError, match="OSError: disk full"):
        records(argv + ["--overwrite"])
    monkeypatch.setattr(writer, "write_shard", real_write)
    aside = os.path.join(ck, "overwritten")
    assert tree_digests(aside) == before and saved_step(aside) == 2
    # without --overwrite, nothing may replace them; --load continues them
    kept = tree_digests(ck)
    capsys.readouterr()
    assert train_main(TINY + argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"gridtron: checkpoint error: --save {ck}: {aside} holds the checkpoints (step 2, "
                   f"{SHAPE}) that an --overwrite run moved aside and that no checkpoint of it has "
                   f"replaced yet: pass --load {aside} to continue them, move them back into {ck}, give "
                   f"this run a new --run-dir or --save, or add --overwrite to replace them"]
    assert tree_digests(ck) == kept
    assert [r["step"] for r in records(["--train-iters", "3", "--load", aside])] == [3]
    assert tree_digests(ck) == kept
    # the job restarted with --overwrite starts afresh and, once it has saved, removes them
    assert [r["step"] for r in records(argv + ["--overwrite"])] == [1, 2]
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000002", "latest"]


def test_the_unfinished_run_of_this_recipe_resumes(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    argv = ["--train-iters", "4", "--save", ck, "--save-interval", "1", "--overwrite"]
    with pytest.raises(RuntimeError, match="worker lost"):
        records(argv, cls=CrashAtStep3)
    capsys.readouterr()
    # the restarted job (same flags, --overwrite included, the learning rate changed) continues
    assert [r["step"] for r in records(argv + ["--lr", "1e-3"])] == [3, 4]
    out = capsys.readouterr().out
    assert f"gridtron: resuming from {ck} (step 2); pass --load to choose another checkpoint" in out
    assert "--overwrite: moved" not in out and not os.path.exists(os.path.join(ck, "overwritten"))


def test_load_says_what_it_loaded(finished, capsys):
    ck = finished["ck"]
    capsys.readouterr()
    assert [r["step"] for r in records(["--train-iters", "3", "--load", ck])] == [3]
    lines = capsys.readouterr().out.splitlines()
    assert lines.count(f"gridtron: loaded {ck}/iter_0000002 at step 2") == 1
    records(["--train-iters", "1", "--load", ck, "--finetune"])
    assert f"gridtron: loaded {ck}/iter_0000002 at step 2 (weights only: training starts at step 0)" \
        in capsys.readouterr().out.splitlines()


def test_checkpoint_args_against_an_explicit_size(finished, capsys):
    ck = finished["ck"]
    argv = TINY + ["--train-iters", "3", "--load", ck, "--use-checkpoint-args"]
    with pytest.raises(ConfigError) as err:
        run_config(argv + ["--hidden-size", "32"])
    assert str(err.value) == (f"--use-checkpoint-args takes --hidden-size 64 from the checkpoint {ck}, "
                              f"but --hidden-size 32 was given: drop --hidden-size (or "
                              f"--use-checkpoint-args to choose the model shape yourself)")
    assert run_config(argv).model.num_layers == 2  # TINY's explicit --num-layers 2 agrees
    assert train_main(argv + ["--num-layers", "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["gridtron: configuration error: --use-checkpoint-args takes --num-layers 2 from the "
                   f"checkpoint {ck}, but --num-layers 3 was given: drop --num-layers (or "
                   f"--use-checkpoint-args to choose the model shape yourself)"]


def two_ranks(ps, root):
    """On 2 gloo ranks: a refused run (the same message on both, nothing changed), --overwrite
    (aside until the first publish, then gone) and a matching unfinished run that resumes."""
    ck, out = os.path.join(root, "ck"), {}
    records(["--train-iters", "2", "--save", ck, "--save-interval", "1"])
    before = tree_digests(ck) if ps.rank == 0 else None
    try:
        records(["--train-iters", "4", "--num-layers", "1", "--save", ck])
    except CheckpointError as exc:
        out["refused"] = str(exc)
    out["unchanged"] = tree_digests(ck) == before if ps.rank == 0 else None
    seen = []
    if ps.rank == 0:  # rank 0 publishes
        real_publish = writer.publish

        def publish(snap):
            seen.append(tree_digests(os.path.join(ck, "overwritten")))
            real_publish(snap)
        writer.publish = publish
    out["overwrite"] = [r["step"] for r in records(["--train-iters", "2", "--num-layers", "1", "--save",
                                                    ck, "--save-interval", "1", "--overwrite"])]
    if ps.rank == 0:
        writer.publish = real_publish
        out["aside"] = (seen[0] == before, seen[1], sorted(os.listdir(ck)))
    again = os.path.join(root, "again")
    try:
        records(["--train-iters", "4", "--save", again, "--save-interval", "1"], cls=CrashAtStep3)
    except RuntimeError as exc:
        out["crash"] = str(exc)
    out["resumed"] = [r["step"] for r in records(["--train-iters", "4", "--save", again])]
    return out


def test_two_ranks(tmp_path):
    results = run_distributed(two_ranks, grid=RankGrid(dp=2), args=(str(tmp_path),))
    ck = str(tmp_path / "ck")
    want = refusal(ck, "another recipe: --num-layers 2 there, 1 here",
                   " --use-checkpoint-args to continue it")[len("gridtron: checkpoint error: "):]
    for r in results:
        assert r["refused"] == want
        assert r["overwrite"] == [1, 2] and r["crash"] == "worker lost" and r["resumed"] == [3, 4]
    assert results[0]["unchanged"] is True
    assert results[0]["aside"] == (True, {}, ["iter_0000001", "iter_0000002", "latest"])


def test_overwrite_moves_the_old_runs_metrics_timeline_and_plot_with_its_checkpoints(finished,
                                                                                      tmp_path,
                                                                                      monkeypatch,
                                                                                      capsys):
    """--run-dir: the replaced run's metrics.jsonl, timeline.json and loss.png go to
    checkpoints/overwritten beside its checkpoints (the new run would replace them at its first
    step, long before its first checkpoint), and go with them once that checkpoint is saved."""
    run = str(tmp_path / "run")
    shutil.copytree(finished["run"], run, symlinks=True)
    ck, aside = os.path.join(run, "checkpoints"), os.path.join(run, "checkpoints", "overwritten")
    old = tree_digests(run)
    outputs = {name: old[name] for name in ("metrics.jsonl", "timeline.json", "loss.png")}
    seen = []
    real_publish = writer.publish

    def publish(snap):  # the run directory as the new run's first checkpoint is published
        seen.append(tree_digests(aside))
        real_publish(snap)

    monkeypatch.setattr(writer, "publish", publish)
    capsys.readouterr()
    argv = ["--train-iters", "2", "--num-layers", "1", "--run-dir", run, "--save-interval", "1",
            "--overwrite"]
    assert [r["step"] for r in records(argv)] == [1, 2]
    assert (f"gridtron: --overwrite: moved the checkpoints in {ck} (step 2, {SHAPE}) and its "
            f"metrics.jsonl, timeline.json, loss.png to {aside}; they are deleted once this run's "
            f"first checkpoint is saved (until then --load {aside} continues that run)") \
        in capsys.readouterr().out.splitlines()
    moved = seen[0]  # (paths relative to the aside directory, the run directory)
    assert {name: moved.get(name) for name in outputs} == outputs  # byte for byte
    assert {k: v for k, v in moved.items() if k not in outputs} == \
        {k[len("checkpoints/"):]: v for k, v in old.items() if k.startswith("checkpoints/")}
    assert seen[1] == {} and not os.path.exists(aside)  # gone with the checkpoints
    assert [json.loads(line)["step"] for line in open(os.path.join(run, "metrics.jsonl"))] == [1, 2]
