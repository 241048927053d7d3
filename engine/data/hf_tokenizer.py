"""Tokenizers from the ecosystem: a ``tokenizer.json`` or a Hugging Face tokenizer directory.

``--tokenizer-model PATH`` names either a ``tokenizer.json`` file or a directory written by
transformers' ``save_pretrained`` (GPT-2's, Llama's, ...): its ``tokenizer.json`` is loaded with HF
``tokenizers``; a directory holding only GPT-2's ``vocab.json`` + ``merges.txt`` becomes the same
byte-level BPE. The end-of-text id is the ``eos_token`` of ``tokenizer_config.json`` (or
``special_tokens_map.json``), else a well-known end token in the vocabulary.

``--tokenizer-type`` takes Megatron-LM's names where they map onto this: ``HuggingFaceTokenizer``
and the Llama / SentencePiece / TikToken types with a Hugging Face directory, ``GPT2BPETokenizer``
with ``--vocab-file`` and ``--merge-file`` (or a directory), ``NullTokenizer`` for data used with
``--vocab-size`` and no text at all.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from engine.data.errors import read_json, tokenizer_from_file
from engine.data.tokenizer_base import HFBacked, atomic_write_text

# Megatron-LM's --tokenizer-type values; the ones without a Hugging Face file are refused by name
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "Llama2Tokenizer", "Llama3Tokenizer",
                   "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "TikTokenizer",
                   "NullTokenizer")
END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>", "<eos>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special(directory: Path, key: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / name
        if path.is_file():
            text = _token_text(read_json(path, "repair or remove it").get(key))
            if text:
                return text
    return None


class HFTokenizer(HFBacked):
    """A HF ``tokenizers.Tokenizer`` with the interface of the built-in ones (spec "hf")."""

    spec = "hf"

    def __init__(self, tok, eot_id: int, bos_id: int | None = None, file: str | None = None):
        self._tok, self.eot_id, self.bos_id, self.file = tok, eot_id, bos_id, file
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eot_id: int | None = None,
                  eos: str | None = None, bos: str | None = None,
                  fix: str = "pass a tokenizer.json that HF tokenizers can read") -> "HFTokenizer":
        tok = tokenizer_from_file(path, fix)  # ``fix``: what the error tells the user to do
        return cls._finish(tok, str(path), eot_id, eos, bos)

    @classmethod
    def _finish(cls, tok, file, eot_id, eos, bos) -> "HFTokenizer":
        if eot_id is None:
            for text in ([eos] if eos else []) + list(END_TOKENS):
                if (found := tok.token_to_id(text)) is not None:
                    eot_id = found
                    break
        if eot_id is None:
            raise ValueError(f"tokenizer {file} has no end-of-text token: name it as eos_token in "
                             f"tokenizer_config.json next to it")
        bos_id = tok.token_to_id(bos) if bos else None
        return cls(tok, eot_id, bos_id, file)

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json; a byte copy of the source file, so checksums still match."""
        if self.file and os.path.isfile(self.file):
            tmp = f"{path}.tmp-{os.getpid()}"
            shutil.copyfile(self.file, tmp)
            os.replace(tmp, path)
        else:
            atomic_write_text(path, self._tok.to_str())


def _gpt2_files(vocab_file: str, merge_file: str, eos: str | None = None) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    for f in (vocab_file, merge_file):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"GPT2BPETokenizer: {f} does not exist (pass GPT-2's vocab.json as "
                                    f"--vocab-file and merges.txt as --merge-file)")
    tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return HFTokenizer._finish(tok, None, None, eos, None)


def load_hf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """A ``tokenizer.json`` file or a Hugging Face tokenizer directory."""
    p = Path(path)
    if p.is_file():
        if p.suffix == ".model":
            raise ValueError(f"{p} is a SentencePiece model; pass the Hugging Face tokenizer directory "
                             f"that holds its tokenizer.json instead (transformers' save_pretrained "
                             f"of the tokenizer writes one)")
        return HFTokenizer.from_file(p, eos=_special(p.parent, "eos_token"),
                                     bos=_special(p.parent, "bos_token"))
    if not p.is_dir():
        raise FileNotFoundError(f"--tokenizer-model {p}: no such file or directory (pass a tokenizer.json "
                                f"or a Hugging Face tokenizer directory)")
    eos, bos = _special(p, "eos_token"), _special(p, "bos_token")
    if (p / "tokenizer.json").is_file():
        return HFTokenizer.from_file(p / "tokenizer.json", eos=eos, bos=bos)
    if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
        return _gpt2_files(str(p / "vocab.json"), str(p / "merges.txt"), eos)
    raise FileNotFoundError(f"--tokenizer-model {p}: the directory holds no tokenizer.json (nor GPT-2's "
                            f"vocab.json + merges.txt); save the tokenizer with transformers' "
                            f"save_pretrained")


def resolve_tokenizer(tokenizer_type: str | None = None, tokenizer_model: str | None = None,
                      vocab_file: str | None = None, merge_file: str | None = None) -> HFTokenizer | None:
    """The tokenizer named by Megatron-style flags, or None when they name none (NullTokenizer,
    or no flag at all: the data's own tokenizer applies)."""
    if tokenizer_type is not None and tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; use one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "NullTokenizer":
        if tokenizer_model or vocab_file:
            raise ValueError("--tokenizer-type NullTokenizer takes no --tokenizer-model or --vocab-file; "
                             "give --vocab-size instead")
        return None
    if tokenizer_type == "GPT2BPETokenizer" and not tokenizer_model:
        if not (vocab_file and merge_file):
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file "
                             "(or --tokenizer-model DIR)")
        return _gpt2_files(vocab_file, merge_file)
    if tokenizer_model:
        return load_hf_tokenizer(tokenizer_model)
    if vocab_file and merge_file:
        return _gpt2_files(vocab_file, merge_file)
    if tokenizer_type is not None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (a Hugging Face "
                         f"tokenizer directory or tokenizer.json)")
    if vocab_file or merge_file:
        raise ValueError("--vocab-file and --merge-file go together (GPT-2's vocab.json and merges.txt)")
    return None
