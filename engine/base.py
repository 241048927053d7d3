"""Shared exceptions and small types of the engine. Imports nothing of the engine, so that every
package (configuration, checkpoints, data, the loop, the tools) can raise and read them without an
import circle."""
from __future__ import annotations

import argparse
import dataclasses
import os


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
