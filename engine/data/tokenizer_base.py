"""What the two tokenizer modules share: encoding and decoding through a HF ``tokenizers.Tokenizer``
(``HFBacked``, the base of the byte-level BPE tokenizer in tokenizer.py and of the Hugging Face
tokenizers in hf_tokenizer.py) and an atomic text write. Imports neither of them."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


class HFBacked:
    """Encoding and decoding through a HF ``tokenizers.Tokenizer`` held as ``_tok``."""

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many documents at once; HF parallelizes this across cores."""
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary sibling, then rename: readers never see a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
