"""``python -m engine.train``'s main (engine/train.py calls ``run_and_exit``): one training job, a
single process or one rank under torchrun/Slurm.

Failures end the process with one line on stderr instead of a hang or a bare traceback: a bad
configuration or checkpoint (exit 2), a diverged loss or a persistent bad step (exit 1, naming the
last good checkpoint; engine/observe/anomaly.py) and a collective that timed out or lost a peer (exit 1,
naming the operation, its process group, this rank, and from the peers' heartbeats the members that
entered it and those that did not; parallel/runtime/heartbeat.py), so that torchrun stops, or
restarts, the whole job.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass

from engine.base import ConfigError
from engine.config.cli import parse_args, with_recipe_lines
from engine.training.run_events import INTERRUPTED  # 128 + SIGINT: a run stopped by Ctrl-C

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the communication layer's own frames: a failure names the engine code that called it
_COMM_FILES = tuple(os.path.join("parallel", "runtime", f) for f in ("comm.py", "comm_monitor.py"))
_COMM = re.compile(r"timed out|timeout|connection (reset|closed)|closed by peer|broken pipe|"
                   r"NCCL|HCCL|gloo", re.IGNORECASE)


def describe_comm_failure(exc: BaseException, ps, timeout_s: float | None = None) -> str | None:
    """Name the collective, its process group and the code that issued it for a communication
    error (from the CommGroup call in the traceback); None when ``exc`` is not one."""
    from parallel.runtime.comm import CommGroup
    from parallel.runtime.comm_monitor import group_kind
    from parallel.pipeline.p2p import PipelineCommError
    if isinstance(exc, PipelineCommError):
        peers = _peers(ps)
        return str(exc) + (f" Heartbeats: {peers}" if peers else "")
    if not isinstance(exc, RuntimeError) or not _COMM.search(str(exc)):
        return None
    peers = _peers(ps)
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    op = where = group = None
    for frame in reversed(frames):  # innermost first
        path, code = frame.f_code.co_filename, frame.f_code
        owner = frame.f_locals.get("self")
        if group is None and isinstance(owner, CommGroup) and not code.co_name.startswith("_"):
            group, op = owner, code.co_name
        if group is None:  # e.g. waiting on an asynchronous collective's handle
            for value in frame.f_locals.values():
                cand = value if isinstance(value, CommGroup) else getattr(value, "group", None)
                if isinstance(cand, CommGroup):
                    group = cand
                    break
        if where is None and path.startswith(_REPO) and "site-packages" not in path \
                and not path.endswith(_COMM_FILES):
            where = f"{code.co_qualname} ({os.path.relpath(path, _REPO)}:{frame.f_lineno})"
    failed = getattr(getattr(ps, "comm", None), "activity", None)
    failed = failed.failed if failed is not None else None
    if op is None and failed is not None and (group is None or group_kind(failed[1]) == group.kind):
        op = failed[0] if failed[0] != "p2p" else "a point-to-point transfer"
    what = f"{op or 'a collective'}"
    if group is not None:
        what += f" over the {group.kind} group (ranks {list(group.ranks)})"
    if where:
        what += f" in {where}"
    timed_out = re.search(r"timed out|timeout", str(exc), re.IGNORECASE)
    why = f"timed out after {timeout_s:g} s (--timeout-s)" if timed_out and timeout_s else \
        ("timed out" if timed_out else "failed")
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"communication failure: {what} {why} on {ps.describe()}: a peer rank died, hangs or "
            f"runs a different configuration; check the other ranks' logs. [{cause}]"
            + (f" Heartbeats: {peers}" if peers else ""))


def _peers(ps) -> str | None:
    """The failed collective's group members that entered it and those that did not, from their
    heartbeats (None without a heartbeat, or when no collective of this rank failed)."""
    monitor = getattr(ps, "comm", None)
    heartbeat = getattr(monitor, "heartbeat", None)
    failed = monitor.activity.failed if monitor is not None else None
    if heartbeat is None or failed is None:
        return None
    from parallel.runtime.comm_monitor import group_kind
    group = getattr(ps, f"{group_kind(failed[1])}_group", None)
    return heartbeat.describe(failed, group.ranks if group is not None else ())


def run_config(argv: list[str] | None = None):
    """The run's configuration from its command line: flags over the YAML recipe, then, with
    ``--use-checkpoint-args``, the model shape saved in the ``--load`` checkpoint."""
    from engine.checkpoint.reader import with_checkpoint_args
    cfg = parse_args(argv)
    if cfg.checkpoint.use_checkpoint_args and cfg.checkpoint.load:
        cfg = with_checkpoint_args(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    from engine.checkpoint import CheckpointError
    from engine.config.parallel import ParallelConfig
    from parallel.grid.launch import LaunchEnv
    launch, timeout_s = LaunchEnv.from_env(), ParallelConfig().timeout_s
    try:
        cfg = run_config(argv)
        timeout_s = cfg.parallel.timeout_s
        from engine.training.validate import validate_run
        validate_run(cfg, launch)  # pure, before any process group exists
        from engine.checkpoint.resume import plan_start
        plan_start(cfg)  # --save holds no other run's checkpoints (pure, the same on every rank)
    except ConfigError as exc:
        return stop(f"configuration error: {with_recipe_lines(str(exc), argv)}", launch, timeout_s)
    except CheckpointError as exc:  # --use-checkpoint-args reads --load
        return stop(f"checkpoint error: {exc}", launch, timeout_s)
    if not cfg.parallel.stream_check:
        return train(cfg, launch, timeout_s)
    from parallel.runtime.stream_check import StreamChecker
    checker = StreamChecker()
    with checker.installed():  # before the trainer starts a thread or a communicator
        code = train(cfg, launch, timeout_s)
    if checker.violations:
        print(f"gridtron: stream-order check: {len(checker.violations)} violation(s) on rank "
              f"{launch.rank}:", file=sys.stderr)
        for line in checker.violations:
            print(f"gridtron:   {line}", file=sys.stderr)
        return code or 1
    return code


def train(cfg, launch, timeout_s: float) -> int:
    """Build the trainer, train, print the summary; the exit code."""
    from engine.checkpoint import CheckpointError
    from parallel.grid.rendezvous import Disagreement, PeerStopped, RendezvousError
    from engine.observe.anomaly import PersistentAnomaly
    from engine.training.trainer import Trainer, TrainingDiverged
    try:
        trainer = Trainer(cfg)  # meets the other ranks first (parallel/grid/rendezvous.py Rendezvous)
    except PeerStopped as exc:  # the lowest rank that stopped says why
        return stop(exc.message, launch, timeout_s, Report.of(exc.meeting, exc.rank))
    except Disagreement as exc:  # every rank found it, and every rank says it (its log may be
        # the only one its operator reads: another node's)
        return stop(f"configuration error: {exc}", launch, timeout_s,
                    Report.of(exc.meeting, launch.rank, everyone=True))
    except RendezvousError as exc:
        if launch.rank == min(exc.arrived or (launch.rank,)):
            print(f"gridtron: {exc}", file=sys.stderr)
        write_error_file(str(exc))
        return 1
    except (ConfigError, ValueError) as exc:  # e.g. data too small for --seq-length
        return stop(f"configuration error: {exc}", launch, timeout_s)
    try:
        result = trainer.train()
    except CheckpointError as exc:
        return stop(f"checkpoint error: {exc}", launch, timeout_s)
    except ConfigError as exc:  # e.g. a token id outside the vocabulary, found as it is read
        from engine.data.errors import DataError
        data = "data: " if isinstance(exc, DataError) else ""
        return stop(f"configuration error: {data}{exc}", launch, timeout_s)
    except (TrainingDiverged, PersistentAnomaly) as exc:
        # every rank raised it from the same all-reduced numbers, with the same text: rank 0
        # says it; every rank leaves it in torchrun's error file, as stop() does
        write_error_file(f"training diverged: {exc}")
        if trainer.is_main:
            print(f"gridtron: training diverged: {exc}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as exc:
        message = describe_comm_failure(exc, trainer.ps, cfg.parallel.timeout_s)
        if message is None:
            raise
        write_error_file(message)
        print(f"gridtron: {message}", file=sys.stderr)  # each rank's own view of the failure
        return 1  # no teardown barrier: a peer is gone
    try:
        if trainer.is_main and result.summary:
            print(result.summary)
    finally:
        trainer.close()
    return INTERRUPTED if result.interrupted else 0


FAILED = "gridtron/failed"  # where ranks that stop once the process group exists say so
SETTLE_S = 2.0  # how long such a rank waits for lower ranks that may have stopped on the same error


@dataclass
class Report:
    """Who prints a mistake found by several ranks, and how they leave: ``rank`` prints and then
    sets ``prefix``/said; the others wait for it (under torchrun the first worker to exit gets
    the rest terminated, the printer included), then add themselves to ``prefix``/gone; the
    store's host leaves last (a store call after its host is gone logs C++ stacks). With
    ``everyone`` (ranks that disagree with each other) every rank prints, and none leaves before
    all have said it."""
    rank: int
    store: object = None
    prefix: str = ""
    hosts: bool = False
    ranks: int = 1  # ranks taking part
    everyone: bool = False

    @classmethod
    def of(cls, meeting, rank: int, everyone: bool = False) -> "Report":
        """The report of a failed rendezvous meeting (parallel/grid/rendezvous.py ``Rendezvous``)."""
        return cls(rank, meeting.store, meeting.name, meeting.hosts, meeting.arrived, everyone)

    def says(self, me: int) -> bool:
        return self.everyone or me == self.rank

    def close(self, me: int) -> None:
        if self.store is None:
            return
        end = time.monotonic() + SETTLE_S
        if self.everyone:
            said = _quietly(self.store.add, f"{self.prefix}/said_by", 1)
            while time.monotonic() < end and said is not True and said < self.ranks:
                time.sleep(0.01)
                said = _quietly(self.store.add, f"{self.prefix}/said_by", 0)
        elif me == self.rank:
            _quietly(self.store.set, f"{self.prefix}/said", "1")
        while not self.everyone and me != self.rank and time.monotonic() < end and \
                not _quietly(self.store.check, [f"{self.prefix}/said"]):
            time.sleep(0.01)
        gone = _quietly(self.store.add, f"{self.prefix}/gone", 1)
        while self.hosts and time.monotonic() < end and gone is not True and gone < self.ranks:
            time.sleep(0.01)
            gone = _quietly(self.store.add, f"{self.prefix}/gone", 0)


def stop(line: str, launch, timeout_s: float, report: Report | None = None) -> int:
    """End this rank on a user's mistake (exit 2) with ``line`` printed once for the whole job,
    by the lowest rank that found it (by every rank when ``report.everyone``: ranks that disagree),
    whichever phase found it: before the process group the
    ranks compare notes at the rendezvous (parallel/grid/rendezvous.py ``Rendezvous.stop``), after
    it through the process group's store. ``report``: who says it, when already known.

    torchrun's agent restarts the workers after any non-zero exit while --max-restarts allows
    (torch/distributed/elastic/agent/server/api.py): no exit code stops it, so every attempt
    ends the same way within seconds, and each rank leaves the line in torchrun's error file
    (TORCHELASTIC_ERROR_FILE), which the agent shows as the failure's root cause.
    """
    report = report or first_to_report(line, launch, timeout_s)
    write_error_file(line)
    if report.says(launch.rank):
        print(f"gridtron: {line}", file=sys.stderr, flush=True)
    report.close(launch.rank)
    return 2


def _quietly(call, *args):
    """A store call whose failure (its host gone) means there is no one left to wait for."""
    try:
        return call(*args)
    except RuntimeError:
        return True


def first_to_report(line: str, launch, timeout_s: float) -> Report:
    """Who reports the error this rank stopped on: the lowest rank that stopped (this one when
    no other rank can be asked)."""
    import torch.distributed as dist

    from parallel.grid.launch import LayoutError
    from parallel.grid.rendezvous import Rendezvous, RendezvousError
    if launch.world_size == 1:
        return Report(launch.rank)
    try:
        if not dist.is_initialized():
            meeting = Rendezvous.open(launch, timeout_s)
            return Report.of(meeting, meeting.stop(line))
        store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        store.set(f"{FAILED}/{rank}", line)
        count = store.add(f"{FAILED}/count", 1)
        end = time.monotonic() + min(SETTLE_S, timeout_s)
        while count < world and time.monotonic() < end:  # the others failing alike report at once
            time.sleep(0.01)
            count = store.add(f"{FAILED}/count", 0)
        lower = [r for r in range(rank) if store.check([f"{FAILED}/{r}"])]
        hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        return Report(lower[0] if lower else rank, store, FAILED, hosts, count)
    except (RendezvousError, LayoutError, RuntimeError):
        return Report(launch.rank)  # no one to ask: say it here


def write_error_file(line: str) -> None:
    """torchrun's error file (TORCHELASTIC_ERROR_FILE, set by its agent for each worker), in the
    format its ProcessFailure reads: the one line instead of "To enable traceback see ...".
    Written whole or not at all (a file beside it, renamed over it): the agent reads the file of
    every failed worker, including one it stopped while writing, and an empty or half-written file
    ended the agent itself with a JSONDecodeError (the job then stopped, restarts unused)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        part = f"{path}.{os.getpid()}.part"
        try:
            with open(part, "w") as fh:
                json.dump({"message": f"gridtron: {line}", "timestamp": str(int(time.time()))}, fh)
            os.replace(part, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(part)


def run_and_exit(argv: list[str] | None = None) -> None:
    """The command line's entry: ``main``, then an exit that skips interpreter teardown once
    everything is written. Tearing down the interpreter while a communication backend's worker
    thread still releases the last reference to a collective's tensors aborts the process
    (pytorch/pytorch#179291), which would turn a finished run into a failed one under torchrun.
    Ctrl-C while training stops the run cleanly (engine/training/trainer.py); before or after the
    steps it ends here, with one line and INTERRUPTED."""
    try:
        code = main(argv)
    except KeyboardInterrupt:
        from parallel.grid.launch import LaunchEnv
        if LaunchEnv.from_env().rank == 0:
            print("gridtron: interrupted (SIGINT) outside the training steps; nothing was saved "
                  "by this run after its last checkpoint", file=sys.stderr)
        code = INTERRUPTED
    exit_now(code)


def exit_now(code: int) -> None:
    """Flush what was printed and leave with ``code``, skipping interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
