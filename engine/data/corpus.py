"""The built-in corpus: the running interpreter's Python standard library, tokenized once and cached.

It makes ``python -m engine.train`` work out of the box with real text and no download. The stdlib's
non-test ``.py`` files are about 12 MB; the default cap (16 MB in sorted path order) keeps the first
preparation to seconds. The cache key holds the Python version, the tokenizer spec and the cap, because
each changes the tokens (``-v2``: the Megatron indexed layout). An entry is built in a temporary directory and renamed into place, so ranks
that build it at the same time never see a partial entry: the first rename wins, the others discard
their copy.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import uuid
from pathlib import Path

from engine.data.prepare import prepare
from engine.data.tokenizer import parse_spec

DEFAULT_CACHE_DIR = "~/.cache/gridtron/corpus"
BUILTIN_MAX_BYTES = 16 * 2**20
BUILTIN_TRAIN_CHARS = 8 * 2**20  # BPE is trained on the leading half: the merges barely change
SKIP_DIRS = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def cache_key(tokenizer: str, max_bytes: int) -> str:
    impl, (major, minor) = sys.implementation.name, sys.version_info[:2]
    return f"stdlib-{impl}{major}.{minor}-{tokenizer.replace(':', '')}-{max_bytes}-v2"


def builtin_corpus(tokenizer: str = "bpe:8192", cache_dir: str | os.PathLike | None = None,
                   max_bytes: int = BUILTIN_MAX_BYTES, progress: bool = False) -> str:
    """Return the prefix of the prepared stdlib corpus, preparing it on first use (with a progress
    bar on stderr when ``progress``)."""
    parse_spec(tokenizer)  # the built-in corpus trains its own tokenizer: a spec, not a prefix
    cache = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
    key = cache_key(tokenizer, max_bytes)
    final = cache / key
    if (final / "corpus.json").is_file():
        return str(final / "corpus")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if progress:
        print(f"gridtron: building the built-in corpus (first run only; {tokenizer}, up to "
              f"{max_bytes / 2**20:.0f} MB of {stdlib_dir()}) into {final}", file=sys.stderr, flush=True)
    try:
        prepare([stdlib_dir()], tmp / "corpus", tokenizer, max_bytes=max_bytes,
                train_chars=BUILTIN_TRAIN_CHARS, extensions=(".py",), skip_dirs=SKIP_DIRS,
                progress=progress)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if not (final / "corpus.json").is_file():  # not a lost race: a real failure
                raise OSError(f"cannot move the prepared corpus into {final}: {e}; remove that "
                              f"directory (or pass another cache_dir) and retry") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final / "corpus")
