"""Shared exceptions and small types of the engine. Imports nothing of the engine, so that every
package (configuration, checkpoints, data, the loop, the tools) can raise and read them without an
import circle."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable


class ConfigError(ValueError):
    """A bad flag, recipe key or value; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One user-settable config field, as the command line and YAML recipes see it."""
    section: str | None  # None: a RunConfig field
    type: type           # int, float, str, bool, dict or list
    optional: bool
    default: object


class ToolParser(argparse.ArgumentParser):
    """argparse for the command-line tools: no abbreviated flags (a prefix one tool accepted and
    another refused), and a bad argument raises ConfigError (one line, printed by the tool's main)
    instead of usage text and exit 2. Subparsers are ToolParsers too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise ConfigError(f"{message} ({self.prog} --help lists its arguments)")


def unwritable(path: str) -> str | None:
    """Why a directory cannot be created or written at ``path`` (None when it can). Looks at the
    nearest existing ancestor; creates nothing."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def os_error_text(exc: OSError, fallback: str | None = None) -> str:
    """'PATH: reason' of an OSError (the path it names, else ``fallback``)."""
    where = exc.filename or fallback
    why = exc.strerror or str(exc)
    return f"{where}: {why}" if where else why


def run_tool(body: Callable[[], int], *errors: tuple[type[BaseException], Callable, int]) -> int:
    """Run a side tool's ``body`` so that a user's mistake ends with one line on stderr and an exit
    code, never a traceback: a ConfigError (a bad argument) prints ``gridtron: MESSAGE`` and
    returns 2; each ``(kind, text, code)`` in ``errors`` turns an exception of that kind into
    ``gridtron: text(exc)`` and ``code``, the first match winning. Anything else propagates."""
    try:
        return body()
    except ConfigError as exc:
        print(f"gridtron: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - matched against the tool's own kinds, else re-raised
        for kind, text, code in errors:
            if isinstance(exc, kind):
                print(f"gridtron: {text(exc)}", file=sys.stderr)
                return code
        raise
