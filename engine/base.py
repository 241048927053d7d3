"""Shared exceptions and small types of the engine. Imports nothing of the engine, so that every
package (configuration, checkpoints, data, the loop, the tools) can raise and read them without an
import circle."""
from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    """A bad flag, recipe key or value; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One user-settable config field, as the command line and YAML recipes see it."""
    section: str | None  # None: a RunConfig field
    type: type           # int, float, str, bool, dict or list
    optional: bool
    default: object
