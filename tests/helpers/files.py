"""What a directory tree holds, for tests that prove a tool or a run left it untouched."""
from __future__ import annotations

import hashlib
import os


def tree_digests(root: str | os.PathLike) -> dict[str, str]:
    """Every directory ("dir"), file (its sha256) and symlink ("-> target") under ``root``, by
    relative path."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                with open(path, "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out
