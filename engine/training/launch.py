"""``python -m engine.train``'s main (engine/train.py calls ``run_and_exit``): one training job, a
single process or one rank under torchrun/Slurm.

Failures end the process with one line on stderr instead of a hang or a bare traceback: a bad
configuration or checkpoint (exit 2), a diverged loss or a persistent bad step (exit 1, naming the
last good checkpoint; engine/observe/anomaly.py) and a collective that timed out or lost a peer (exit 1,
naming the operation, its process group, this rank, and from the peers' heartbeats the members that
entered it and those that did not; parallel/heartbeat.py), so that torchrun stops, or restarts, the
whole job.
"""
from __future__ import annotations

import os
import re
import sys

from engine.base import ConfigError
from engine.config.cli import parse_args

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_COMM = re.compile(r"timed out|timeout|connection (reset|closed)|closed by peer|broken pipe|"
                   r"NCCL|HCCL|gloo", re.IGNORECASE)


def describe_comm_failure(exc: BaseException, ps, timeout_s: float | None = None) -> str | None:
    """Name the collective, its process group and the code that issued it for a communication
    error (from the CommGroup call in the traceback); None when ``exc`` is not one."""
    from parallel.comm import CommGroup
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
                and not path.endswith(os.path.join("parallel", "comm.py")):
            where = f"{code.co_qualname} ({os.path.relpath(path, _REPO)}:{frame.f_lineno})"
    failed = getattr(getattr(ps, "comm", None), "activity", None)
    failed = failed.failed if failed is not None else None
    if op is None and failed is not None and (group is None or failed[1] == group.kind):
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
    group = getattr(ps, f"{failed[1]}_group", None)
    return heartbeat.describe(failed, group.ranks if group is not None else ())


def isolate_restart_attempt(cfg) -> bool:
    """Under torchrun, start the default process group on a store namespace of its own attempt.

    torchrun lets workers share its rendezvous TCPStore, which outlives a restart: the keys a dead
    attempt's workers wrote (their gloo addresses, NCCL ids) are still there, and a restarted worker
    can read a dead peer's entry before the live one overwrites it (connection refused, or a hang).
    Prefixing the store with TORCHELASTIC_RESTART_COUNT gives every attempt a clean namespace.
    ParallelState then reuses this group. Returns whether a group was created here.
    """
    import datetime

    import torch.distributed as dist

    from engine.device.runtime import BACKENDS, detect_device_type
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("WORLD_SIZE", "1")) < 2 \
            or dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"gridtron/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(BACKENDS[detect_device_type(cfg.device)], store=store,
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), timeout=timeout)
    return True


def run_config(argv: list[str] | None = None):
    """The run's configuration from its command line: flags over the YAML recipe, then, with
    ``--use-checkpoint-args``, the model shape saved in the ``--load`` checkpoint."""
    from engine.checkpoint.reader import with_checkpoint_args
    cfg = parse_args(argv)
    if cfg.checkpoint.use_checkpoint_args and cfg.checkpoint.load:
        cfg = with_checkpoint_args(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = run_config(argv)
    except ConfigError as exc:
        print(f"gridtron: configuration error: {exc}", file=sys.stderr)
        return 2
    from engine.observe.anomaly import PersistentAnomaly
    from engine.checkpoint import CheckpointError
    from engine.training.trainer import Trainer, TrainingDiverged
    from engine.training.validate import validate_run
    from parallel.state import LaunchEnv
    try:
        validate_run(cfg, LaunchEnv.from_env())  # pure, before any process group exists
        own_group = isolate_restart_attempt(cfg)
        trainer = Trainer(cfg)
    except (ConfigError, ValueError) as exc:  # e.g. data too small for --seq-length
        print(f"gridtron: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        result = trainer.train()
    except CheckpointError as exc:
        print(f"gridtron: checkpoint error: {exc}", file=sys.stderr)
        return 2
    except (TrainingDiverged, PersistentAnomaly) as exc:
        print(f"gridtron: training diverged: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        message = describe_comm_failure(exc, trainer.ps, cfg.parallel.timeout_s)
        if message is None:
            raise
        print(f"gridtron: {message}", file=sys.stderr)
        return 1  # no teardown barrier: a peer is gone
    try:
        if trainer.is_main and result.summary:
            print(result.summary)
            if getattr(trainer, "sample_text", None):
                print(trainer.sample_text)
    finally:
        trainer.close()
        if own_group:
            import torch.distributed as dist
            dist.destroy_process_group()
    return 0


def run_and_exit(argv: list[str] | None = None) -> None:
    """The command line's entry: ``main``, then an exit that skips interpreter teardown once
    everything is written. Tearing down the interpreter while a communication backend's worker
    thread still releases the last reference to a collective's tensors aborts the process
    (pytorch/pytorch#179291), which would turn a finished run into a failed one under torchrun."""
    exit_now(main(argv))


def exit_now(code: int) -> None:
    """Flush what was printed and leave with ``code``, skipping interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
