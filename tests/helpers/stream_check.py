"""Turning the stream-order checker (parallel/runtime/stream_check.py) on in a test.

In the test's own process, take the ``stream_checker`` fixture (tests/conftest.py): the checker is
installed and active on the test's thread for the whole test, and the test fails at teardown if it
recorded a violation. On spawned gloo ranks, wrap the rank function::

    run_distributed(stream_checked, world_size=2, args=(_my_checks, arg1, arg2))

``stream_checked(ps, fn, *args)`` runs ``fn(ps, *args)`` under a fresh checker on every rank and
raises ``StreamOrderError`` on a rank whose run had a violation (run_distributed then fails naming
that rank). Nothing is read from the environment.
"""
from __future__ import annotations

from parallel.runtime.stream_check import StreamChecker


def stream_checked(ps, fn, *args):
    """``fn(ps, *args)`` under a stream-order checker; its result, or the violations raised."""
    checker = StreamChecker()
    with checker.installed():
        result = fn(ps, *args)
    checker.check()
    return result
