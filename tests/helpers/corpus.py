"""A small byte-level corpus of real text (Python's json and email packages), for tests whose
losses must fall, as a module-scoped fixture's body."""
from __future__ import annotations

from engine.data.corpus import stdlib_dir
from engine.data.prepare import prepare


def real_text_corpus(tmp_path_factory, name: str) -> str:
    """Prepare the corpus under a fresh temporary folder ``name``; returns its prefix."""
    prefix = tmp_path_factory.mktemp(name) / "corpus"
    prepare([stdlib_dir() / "json", stdlib_dir() / "email"], prefix, "byte", max_bytes=400_000,
            extensions=(".py",))
    return str(prefix)
