"""Data that cannot be used, said in one line naming the file and what is wrong with it.

``DataError`` is a ``ConfigError`` (the run stops with exit 2 and no traceback); ``read_json`` and
``tokenizer_from_file`` read a prepared corpus' sidecar files (PREFIX.json, PREFIX.tokenizer.json,
a Hugging Face tokenizer.json) and turn a garbled one into a DataError; ``bad_token`` is the error
of a token id outside the vocabulary. Imports nothing of the data package.
"""
from __future__ import annotations

import json
import os

from engine.base import ConfigError

PREPARE_AGAIN = "prepare the data again (python -m engine.data prepare)"


class DataError(ConfigError):
    """A data file that is empty, garbled or does not fit the model; the message names it."""


def read_json(path: str | os.PathLike, fix: str = PREPARE_AGAIN) -> dict:
    """A JSON object from ``path``, or a DataError naming the file, the line and the column."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}): {fix}") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                        f"{exc.colno}): {fix}") from exc
    if not isinstance(value, dict):
        raise DataError(f"{path} holds a JSON {type(value).__name__}, not an object: {fix}")
    return value


def tokenizer_from_file(path: str | os.PathLike, fix: str = PREPARE_AGAIN):
    """A HF ``tokenizers.Tokenizer`` from ``path``, or a DataError naming the file."""
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path} is not a readable tokenizer file ({first}): {fix}") from exc


def bad_token(bin_path: str, document: int, token: int, vocab_size: int) -> DataError:
    return DataError(f"{bin_path}: document {document} holds token id {token}, outside the "
                     f"{vocab_size}-token vocabulary (a corrupt file, or data made with another "
                     f"tokenizer): {PREPARE_AGAIN}, or pass the tokenizer it was made with")
