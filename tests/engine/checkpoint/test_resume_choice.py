"""Which checkpoint a run starts from when its --load lies inside its --save, and what its saves
keep: a rollback (--load SAVE/iter_X of an earlier step) starts from X and keeps it while the run
goes on, and only the restart of that job (the same launcher job identity, TORCHELASTIC_RUN_ID or
SLURM_JOB_ID) continues from the newer checkpoints it saved itself, wherever it is launched from; a
new submission, a plain process or --overwrite rolls back again; --overwrite moves nothing aside
for it; --finetune there is refused (its step-0 saves would replace the loaded run's) unless it
continues its own progress; --load SAVE/overwritten continues what --overwrite moved aside,
restarts included. And a synchronous save whose write fails on one rank fails every rank with the
same line; a resume under another layout draws new dropout masks. Single-process mock-data runs of
2-6 steps, and one 2-rank gloo run."""
import os
import shutil

import pytest
import torch

import engine.checkpoint.writer as writer
from engine.checkpoint.index import CheckpointError, read_index, resolve
from engine.checkpoint.resume import move_aside, plan_start
from engine.config.cli import parse_args
from engine.training.launch import main as train_main
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.helpers.training import train_records

# a constant learning rate after warm-up: a run's steps do not depend on its --train-iters
TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--lr-decay-style", "constant"]


@pytest.fixture(autouse=True)
def job(monkeypatch):
    """No launcher's job identity unless a test sets one: ``job("a")`` is torchrun's run "a"."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    return lambda run: monkeypatch.setenv("TORCHELASTIC_RUN_ID", run)


def plan(argv, job_id=None):
    """(source, step, resumed) of ``plan_start`` for ``argv`` in a job of identity ``job_id``."""
    start = plan_start(parse_args(TINY + argv), LaunchEnv(job_id=job_id))
    return start.source, start.step, start.resumed


def records(argv, cls=Trainer) -> list[dict]:
    return train_records(TINY + argv, cls)


def losses(argv, cls=Trainer) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(argv, cls)}


class Crash(Trainer):
    """Dies before step ``at`` (a worker lost), keeping the losses of the steps it trained."""
    at, seen = 0, {}

    def train_one(self, step):
        if step + 1 == self.at:
            raise RuntimeError("worker lost")
        record = super().train_one(step)
        Crash.seen[step + 1] = record["loss"]
        return record


def crashing(argv, at: int) -> dict[int, float]:
    Crash.at, Crash.seen = at, {}
    with pytest.raises(RuntimeError, match="worker lost"):
        records(argv, cls=Crash)
    return dict(Crash.seen)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """A finished 4-step run in ``s`` with checkpoints at steps 2 and 4, and its losses."""
    s = str(tmp_path_factory.mktemp("four") / "s")
    return s, losses(["--train-iters", "4", "--save", s, "--save-interval", "2"])


def copy(src: str, dst) -> str:
    shutil.copytree(src, str(dst), symlinks=True)
    return str(dst)


def test_a_rollback_inside_save_starts_from_load_and_its_restart_continues(four, tmp_path, capsys, job):
    s, first = copy(four[0], tmp_path / "s"), four[1]
    load = f"{s}/iter_0000002"
    argv = ["--train-iters", "6", "--load", load, "--save", s, "--save-interval", "2"]
    job("a")
    capsys.readouterr()
    rolled = crashing(argv, at=5)  # the rollback saves its step 4, then its worker dies
    out = capsys.readouterr().out.splitlines()
    assert f"gridtron: loaded {load} at step 2" in out and not any("resuming" in x for x in out)
    assert rolled == {3: first[3], 4: first[4]}  # the first run's steps 3-4 again
    assert os.readlink(os.path.join(s, "latest")) == "iter_0000004"
    assert read_index(resolve(s))["run"] == {"job_id": "torchrun:a", "load": os.path.realpath(load)}
    # torchrun restarts the job with the same flags: it continues from its own step 4
    assert sorted(losses(argv)) == [5, 6]
    assert f"gridtron: resuming from {s} (step 4): this job's own progress since --load {load}" \
        in capsys.readouterr().out.splitlines()
    # --keep-last 2 keeps the newest two and, while the run goes on, the checkpoint --load names
    assert sorted(os.listdir(s)) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]


def test_a_new_submission_of_a_rollback_rolls_back_again(four, tmp_path, capsys, job):
    """The rollback saves step 4 and diverges again; the user submits the same rollback with a
    lower --lr: a new job (or a plain process, or --overwrite), which starts from --load again
    instead of continuing the diverged step 4; only the same job's restart continues it."""
    s, first = copy(four[0], tmp_path / "s"), four[1]
    load = f"{s}/iter_0000002"
    argv = ["--train-iters", "6", "--load", load, "--save", s, "--save-interval", "2"]
    job("a")
    crashing(argv, at=5)
    assert plan(argv, "torchrun:a") == (s, 4, True)                   # its restart
    assert plan(argv, "torchrun:b") == (load, 2, False)               # another job
    assert plan(argv, None) == (load, 2, False)                       # no launcher restarts it
    assert plan(argv + ["--overwrite"], "torchrun:a") == (load, 2, False)
    job("b")
    capsys.readouterr()
    got = losses(argv + ["--lr", "1e-3"])
    assert f"gridtron: loaded {load} at step 2" in capsys.readouterr().out.splitlines()
    assert sorted(got) == [3, 4, 5, 6] and got[3] == first[3]


def test_job_identity_of_a_launch():
    assert LaunchEnv.from_env({"TORCHELASTIC_RUN_ID": "e1f2", "SLURM_JOB_ID": "7"}).job_id == "torchrun:e1f2"
    # torchrun's default --rdzv-id "none" is every launch's: Slurm's job id, if any
    assert LaunchEnv.from_env({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
                               "SLURM_NTASKS": "1"}).job_id == "slurm:7"
    assert LaunchEnv.from_env({"RANK": "0", "WORLD_SIZE": "1"}).job_id is None


def test_a_restart_from_another_directory_finds_its_own_progress(four, tmp_path, monkeypatch, job):
    """A relative --load: the index records its real path (the saved config keeps it as typed),
    so the restart launched from another directory, with --load written from there, continues."""
    copy(four[0], tmp_path / "s")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    job("a")
    crashing(["--train-iters", "6", "--load", "s/iter_0000002", "--save", "s", "--save-interval", "2"],
             at=5)
    assert read_index(resolve("s"))["config"]["checkpoint"]["load"] == "s/iter_0000002"
    monkeypatch.chdir(tmp_path / "sub")
    argv = ["--train-iters", "6", "--load", "../s/iter_0000002", "--save", "../s"]
    assert plan(argv, "torchrun:a") == ("../s", 4, True)


def test_overwrite_with_a_load_inside_save_moves_nothing_aside(four, tmp_path, capsys):
    """The --save holds a finished run (which alone --overwrite would move aside): its own
    checkpoint given to --load is where the run starts, and nothing is moved."""
    s, first = copy(four[0], tmp_path / "s"), four[1]
    load = f"{s}/iter_0000002"
    capsys.readouterr()
    got = losses(["--train-iters", "4", "--load", load, "--save", s, "--save-interval", "2",
                  "--overwrite"])
    out = capsys.readouterr().out
    assert got == {3: first[3], 4: first[4]} and f"gridtron: loaded {load} at step 2" in out
    assert "--overwrite: moved" not in out
    assert sorted(os.listdir(s)) == ["iter_0000002", "iter_0000004", "latest"]


def test_a_finetune_into_the_directory_of_its_load_is_refused(four, tmp_path, capsys):
    """A fine-tune counts its steps from 0: into its --load's own directory its saves would replace
    that run's checkpoints and latest, at step 2 the very checkpoint --load names. One line on
    every rank, before anything is built; the directory stays as it was."""
    d = copy(four[0], tmp_path / "d")
    for load, where in ((d, "is"), (f"{d}/iter_0000002", "lies in")):
        argv = TINY + ["--train-iters", "2", "--load", load, "--save", d, "--finetune"]
        assert train_main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.splitlines()[-1] == (
            f"gridtron: checkpoint error: --finetune with --load {load}, which {where} --save {d}: a "
            f"fine-tune counts its steps from 0, so its checkpoints would replace the loaded run's "
            f"(and latest), the one --load names included; give the fine-tune its own --save "
            f"(--load {load} --save FINETUNE_DIR --finetune)")
        with pytest.raises(CheckpointError, match="give the fine-tune its own --save"):
            plan_start(parse_args(argv + ["--overwrite"]), LaunchEnv(job_id="torchrun:a"))
    assert sorted(os.listdir(d)) == ["iter_0000002", "iter_0000004", "latest"]
    assert os.readlink(os.path.join(d, "latest")) == "iter_0000004"


def test_a_finetune_on_an_empty_directory_continues_only_its_own_job(tmp_path, capsys, job):
    """--load DIR --save DIR --finetune on an empty DIR starts afresh; its job restarted continues
    its own progress in full (not starting over), another job is refused like any fine-tune into
    a run's directory."""
    reference, d = str(tmp_path / "reference"), str(tmp_path / "d")
    tune = ["--finetune", "--save-interval", "1"]
    whole = losses(["--load", reference, "--save", reference, "--train-iters", "4"] + tune)
    argv = ["--load", d, "--save", d] + tune
    job("a")
    assert losses(argv + ["--train-iters", "2"]) == {1: whole[1], 2: whole[2]}
    capsys.readouterr()
    # again with a larger --train-iters: it continues its own step 2 (optimizer, data position)
    assert losses(argv + ["--train-iters", "4"]) == {3: whole[3], 4: whole[4]}
    assert f"gridtron: resuming from {d} (step 2): this job's own progress since --load {d}" \
        in capsys.readouterr().out.splitlines()
    with pytest.raises(CheckpointError, match="give the fine-tune its own --save"):
        plan(argv + ["--train-iters", "6"], "torchrun:b")


def test_load_of_what_overwrite_moved_aside_continues_it_restarts_included(four, tmp_path, capsys, job):
    """--load SAVE/overwritten, the refusal's own suggestion, is accepted; the run's checkpoints
    leave it in place (its --load), so the job restarted with the same flags still finds it."""
    s = copy(four[0], tmp_path / "s")
    aside, _ = move_aside(s)  # as an --overwrite run that died before its first checkpoint left it
    job("a")
    argv = ["--train-iters", "7", "--load", aside, "--save", s, "--save-interval", "1"]
    capsys.readouterr()
    assert sorted(crashing(argv, at=6)) == [5]
    assert f"gridtron: loaded {aside}/iter_0000004 at step 4" in capsys.readouterr().out.splitlines()
    assert os.path.isdir(aside) and os.readlink(os.path.join(s, "latest")) == "iter_0000005"
    assert train_main(TINY + argv) == 0  # (it checks that --load exists)
    out = capsys.readouterr().out.splitlines()
    assert f"gridtron: resuming from {s} (step 5): this job's own progress since --load {aside}" in out
    assert sorted(os.listdir(s)) == ["iter_0000006", "iter_0000007", "latest", "overwritten"]


def test_a_failed_synchronous_write_is_one_line(tmp_path, monkeypatch, capsys):
    def full(tensors, path):
        raise OSError("No space left on device")

    monkeypatch.setattr(writer, "write_shard", full)
    s = str(tmp_path / "s")
    assert train_main(TINY + ["--train-iters", "2", "--save", s, "--save-interval", "1"]) == 2
    err = capsys.readouterr().err  # (after the run's banner lines)
    assert "Traceback" not in err and err.splitlines()[-1] == (
        f"gridtron: checkpoint error: writing the shards of {s}/iter_0000001.tmp failed: OSError: No "
        f"space left on device; latest still names the previous checkpoint")


def rank1_disk_full(ps, root):
    """Rank 1's write of the step-1 save fails; what each rank raises."""
    real = writer.write_shard

    def full(tensors, path):
        if ps.rank == 1:
            raise OSError("No space left on device")
        return real(tensors, path)

    writer.write_shard = full
    try:
        records(["--train-iters", "2", "--save", os.path.join(root, "s"), "--save-interval", "1"])
    except Exception as exc:  # noqa: BLE001 - the test compares the message
        return f"{type(exc).__name__}: {exc}"
    finally:
        writer.write_shard = real
    return None


def test_a_write_failing_on_one_rank_fails_every_rank_alike(tmp_path):
    got = run_distributed(rank1_disk_full, grid=RankGrid(dp=2), args=(str(tmp_path),), timeout_s=60)
    want = (f"CheckpointError: rank 1: writing the shards of {tmp_path}/s/iter_0000001.tmp failed: "
            f"OSError: No space left on device; latest still names the previous checkpoint")
    assert got == [want, want]
    assert sorted(os.listdir(tmp_path / "s")) == ["iter_0000001.tmp"]


def streams(argv) -> tuple[dict, torch.Tensor]:
    """The dropout streams and the CPU generator of a trainer once it has loaded."""
    trainer = Trainer(parse_args(TINY + ["--train-iters", "4", "--dropout", "0.1"] + argv))
    try:
        trainer.maybe_load()
        return trainer.rng.state_tensors(), torch.get_rng_state()
    finally:
        trainer.close()


def test_a_resume_under_another_layout_draws_new_dropout_masks(tmp_path):
    """The per-rank random states are restored on the same layout only; elsewhere (here ZeRO-1
    on, a choice that changes what each rank holds) the streams start from the seeds mixed with
    the loaded step: not the step-0 streams, whose masks steps 1, 2, ... drew already."""
    s = str(tmp_path / "s")
    records(["--train-iters", "2", "--save", s, "--dropout", "0.1"])
    same = lambda a, b: a[0].keys() == b[0].keys() and all(  # noqa: E731
        torch.equal(a[0][k], b[0][k]) for k in a[0]) and torch.equal(a[1], b[1])
    fresh, other = streams([]), streams(["--load", s, "--use-distributed-optimizer"])
    assert not any(torch.equal(fresh[0][k], other[0][k]) for k in fresh[0])
    assert not torch.equal(fresh[1], other[1])
    assert same(other, streams(["--load", s, "--use-distributed-optimizer"]))  # the same on a restart
    assert same(streams(["--load", s, "--use-distributed-optimizer", "--no-load-rng"]), fresh)
    assert not same(streams(["--load", s]), fresh)  # the same layout: the saved states


def test_a_crash_while_a_resave_is_swapped_in_resumes_from_it(tmp_path, monkeypatch):
    """A rollback re-saves the step ``latest`` names: promote moves the old copy aside, then the
    new one in. A crash between the two renames leaves ``latest`` naming neither; the complete
    new copy is what resolves (it used to be an error, and no checkpoint was listed)."""
    root = tmp_path / "ck"
    for name in ("iter_0000002", "iter_0000004", "iter_0000004.tmp"):
        (root / name).mkdir(parents=True)
        (root / name / "index.json").write_text(name)
    os.symlink("iter_0000004", root / "latest")
    real, calls = os.rename, []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("killed")
        real(src, dst)

    monkeypatch.setattr(writer.os, "rename", crash_on_second)
    with pytest.raises(OSError, match="killed"):
        writer.promote(str(root / "iter_0000004.tmp"), str(root / "iter_0000004"))
    monkeypatch.setattr(writer.os, "rename", real)
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004.old", "iter_0000004.tmp",
                                        "latest"]
    assert resolve(str(root)) == str(root / "iter_0000004.tmp")
    shutil.rmtree(root / "iter_0000004.tmp")       # the new copy gone too: the old one
    assert resolve(str(root)) == str(root / "iter_0000004.old")
    shutil.rmtree(root / "iter_0000004.old")
    with pytest.raises(CheckpointError, match="which does not exist"):
        resolve(str(root))
