"""What every rank of a job must agree on: its resolved configuration, flag by flag.

``resolved_flags(cfg)`` is every user-settable field (engine/config/fields.py) of a ``RunConfig``
after parsing (recipe, flags, derived defaults such as ``--save`` under ``--run-dir``), keyed by
its flag and written as JSON text: the ranks compare a digest of it through the rendezvous store
before the first collective (parallel/grid/rendezvous.py ``Rendezvous.agree``) and name the flags
that differ.
Which keys a user typed (``RunConfig.explicit``) is not part of it: a recipe and the same values
as flags agree.
"""
from __future__ import annotations

import json

from engine.config.fields import field_table


def resolved_flags(cfg) -> dict[str, str]:
    """{"--flag-name": JSON of its value} for every user-settable field of ``cfg``."""
    out = {}
    for name, info in field_table().items():
        owner = getattr(cfg, info.section) if info.section else cfg
        out[f"--{name.replace('_', '-')}"] = json.dumps(getattr(owner, name), sort_keys=True,
                                                        default=str)
    return out

