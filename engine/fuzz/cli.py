"""The fuzzer's command line: draw, train, compare, stop at the first case that differs.

    python -m engine.fuzz --minutes 30                 # as many cases as fit, on up to 8 ranks
    python -m engine.fuzz --seed 7 --cases 20 --ranks 4
    python -m engine.fuzz --case tp=2,pp=2,dp=2,schedule=zb-v,zero=1,block=llama
    python -m engine.fuzz --screen --minutes 8 --ranks 4   # plus bf16, fp16, FP8, dropout, ...
    python -m engine.fuzz --screen --case dp=2,zero=1,precision=fp16,overflow=1,compression=int8

Each case prints one line. The first case that fails (a rank's error, a stream-order violation,
or a loss or gradient norm off the serial run's by more than docs/design.md's relative 1e-4) prints
why and the one-line command that reruns exactly that case, and the fuzzer exits with 1.
``--screen`` draws the features that do not train the serial model exactly (screen.py) and holds
each case to the screening verdict instead (compare.py ``judge_screen``: the ranks agree, every
figure is finite, the losses are within a loose bound of the serial run's).
"""
from __future__ import annotations

import contextlib
import io
import random
import sys
import time
import warnings
from typing import Iterable

from engine.base import ConfigError, ToolParser, run_tool
from engine.fuzz.compare import LOSS_REL, NORM_REL, judge, judge_screen, train_serial
from engine.fuzz.pool import Pool
from engine.fuzz.screen import SCREEN_FIELDS, ScreenCase, draw_screen
from engine.fuzz.space import Case, draw

RANKS = (2, 4, 8)


def parser() -> ToolParser:
    p = ToolParser(prog="python -m engine.fuzz",
                   description="Train random valid layouts against the serial run, under the "
                               "stream-order checker; stop at the first that differs.")
    p.add_argument("--seed", type=int, default=None,
                   help="the draw's seed (default: from the clock, printed)")
    p.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    p.add_argument("--minutes", type=float, default=None,
                   help="start no case after this many minutes (default 10 without --cases)")
    p.add_argument("--ranks", type=int, default=8, choices=RANKS,
                   help="the most processes a case uses")
    p.add_argument("--steps", type=int, default=4, help="training steps per case")
    p.add_argument("--case", default=None,
                   help="run only this case (field=value,...: the spec a failure prints)")
    p.add_argument("--deadline-s", type=float, default=300.0, help="a case running longer has hung")
    p.add_argument("--screen", action="store_true",
                   help="also draw bf16, fp16 (and its overflow skip), FP8, dropout, an MoE "
                        "capacity factor, the global aux loss and gradient compression, and judge "
                        "each case by agreement, finite figures and a loose bound, not equality")
    return p


def check(args) -> None:
    if args.cases is not None and args.cases < 1:
        raise ConfigError(f"--cases {args.cases}: give at least 1")
    if args.minutes is not None and not args.minutes > 0:
        raise ConfigError(f"--minutes {args.minutes}: give a positive number")
    if args.steps < 2:
        raise ConfigError(f"--steps {args.steps}: give at least 2 (the second step reads what the "
                          f"first update gathered)")
    if not args.deadline_s > 0:
        raise ConfigError(f"--deadline-s {args.deadline_s}: give a positive number")
    if args.case is not None:
        try:
            case = (ScreenCase if args.screen else Case).parse(args.case)
        except (TypeError, ValueError) as exc:
            keys = [item.partition("=")[0].strip() for item in args.case.split(",")]
            screening = [key for key in keys if key in SCREEN_FIELDS]
            if screening and not args.screen:
                raise ConfigError(f"--case {args.case}: {screening[0]} is a screening field: add "
                                  f"--screen") from None
            raise ConfigError(str(exc)) from None
        problem = case.problem()
        if problem:
            raise ConfigError(f"--case {args.case}: {problem}")
        if case.world > max(RANKS):
            raise ConfigError(f"--case {args.case} needs {case.world} ranks, more than the "
                              f"{max(RANKS)} the fuzzer runs: choose a smaller case")
        if case.world > args.ranks:
            raise ConfigError(f"--case {args.case} needs {case.world} ranks, more than --ranks "
                              f"{args.ranks}: raise --ranks or choose a smaller case")
        problem = invalid(case, args.steps)
        if problem:
            raise ConfigError(f"--case {args.case}: {problem}")
        args.parsed_case = case  # what run() trains


def invalid(case: Case, steps: int) -> str | None:
    """Why the trainer would refuse ``case`` (None: it trains), by the trainer's own checks."""
    from engine.config.cli import parse_args
    from engine.training.validate import validate_run
    from parallel.grid.launch import LaunchEnv
    try:
        validate_run(parse_args(case.argv(steps)), LaunchEnv(0, case.world, 0, case.world))
    except (ConfigError, ValueError) as exc:
        return str(exc)
    return None


def seeded(seed: int, ranks: int, screen: bool = False) -> Iterable[Case]:
    rng = random.Random(seed)
    while True:
        yield (draw_screen if screen else draw)(rng, ranks)


def serial_quietly(case: Case, steps: int) -> dict:
    """The serial reference, its start line and notes kept off the fuzzer's output."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train_serial(case, steps)


def fuzz(cases: Iterable[Case], steps: int, deadline_s: float, limit: int | None = None,
         end: float | None = None, setup=None, say=print) -> tuple[int, tuple[Case, str] | None]:
    """Run ``cases`` until ``limit`` cases, the monotonic time ``end`` or the first failure;
    returns (cases run, (the failed case, why) or None). ``setup``: see ``Pool``."""
    pools: dict[int, Pool] = {}
    serial: dict[tuple, dict] = {}
    done = 0
    try:
        for case in cases:
            if (limit is not None and done >= limit) or (end is not None and time.monotonic() > end):
                break
            t0 = time.monotonic()
            key = case.model_key()
            if key not in serial:
                serial[key] = serial_quietly(case, steps)
            pool = pools.get(case.world)
            if pool is None or pool.broken:
                if pool is not None:
                    pool.close()
                pool = pools[case.world] = Pool(case.world, setup)
            ranks = pool.run(done, case.argv(steps), deadline_s)
            verdict = judge_screen(case, ranks, serial[key]) if isinstance(case, ScreenCase) \
                else judge(ranks, serial[key])
            done += 1
            say(f"case {done}: {'ok' if verdict.ok else 'FAILED'} {case.spec()} "
                f"({time.monotonic() - t0:.1f} s)")
            if not verdict.ok:
                return done, (case, verdict.why)
    finally:
        for pool in pools.values():
            pool.close()
    return done, None


def run(args) -> int:
    check(args)
    say = lambda line: print(line, flush=True)  # noqa: E731
    mode = " --screen" if args.screen else ""
    if args.case is not None:
        cases, limit, end = [args.parsed_case], 1, None
        say(f"gridtron fuzz{mode}: the case {args.case}, {args.steps} steps")
    else:
        if args.seed is None:
            args.seed = random.SystemRandom().randrange(1 << 30)
        minutes = args.minutes if args.minutes is not None or args.cases is not None else 10.0
        cases, limit = seeded(args.seed, args.ranks, args.screen), args.cases
        end = time.monotonic() + 60 * minutes if minutes is not None else None
        say(f"gridtron fuzz{mode}: seed {args.seed}, up to {args.ranks} ranks, {args.steps} steps per "
            f"case" + (f", {args.cases} cases" if args.cases else "")
            + (f", {minutes:g} minutes" if minutes else ""))
    start = time.monotonic()
    done, failed = fuzz(cases, args.steps, args.deadline_s, limit, end, say=say)
    if failed is not None:
        case, why = failed
        say(f"gridtron fuzz: {why}\n"
            f"reproduce: python -m engine.fuzz{mode} --case {case.spec()} --steps {args.steps}\n"
            f"the run alone: {case.command(args.steps)}")
        return 1
    what = (f"screened: no stream-order violation, one collective order, the ranks agreeing, "
            f"finite figures, losses within {LOSS_REL:g} and gradient norms within {NORM_REL:g} "
            f"of the serial run" if args.screen else
            "equal to the serial run with no stream-order violation")
    say(f"gridtron fuzz: {done} combination(s) {what}, in {(time.monotonic() - start) / 60:.1f} min"
        + (f" (seed {args.seed})" if args.case is None else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool(lambda: run(parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
