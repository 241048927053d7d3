"""Turn text files into a prepared token corpus: Megatron's PREFIX.bin/.idx plus PREFIX.json (see
``indexed.py`` for the format).

One input file is one document; in a ``.jsonl`` file each line's ``"text"`` is one document. Directories
are searched recursively, in sorted path order so the corpus (and a size cap over it) is reproducible.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from engine.base import unwritable
from engine.data.hf_tokenizer import HFTokenizer, resolve_tokenizer
from engine.data.indexed import write_documents
from engine.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, parse_spec, train_bpe

TEXT_EXTENSIONS = (".txt", ".text", ".md", ".rst", ".py", ".jsonl")
ENCODE_BATCH_DOCS = 256  # documents per batch-encoder call: keeps all cores busy, memory bounded


def collect_files(inputs: Iterable[str | os.PathLike], extensions: Iterable[str] = TEXT_EXTENSIONS,
                  skip_dirs: Iterable[str] = ()) -> list[Path]:
    """Files named directly, plus files with a text extension under named directories (sorted, deduped).

    ``skip_dirs`` are directory names (any depth below an input directory) whose contents are left out.
    """
    extensions, skip_dirs = tuple(extensions), set(skip_dirs)
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"input path {str(item)!r} does not exist: pass existing files or "
                                    f"directories to --input")
        if path.is_file():
            files.append(path)
            continue
        found = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if d not in skip_dirs]  # prune: never walk into skipped trees
            found += [Path(root, n) for n in names if Path(n).suffix in extensions]
        files += sorted(found)
    return list(dict.fromkeys(files))


def cap_files(files: list[Path], max_bytes: int | None) -> list[Path]:
    """The longest prefix of ``files`` whose sizes sum to at most ``max_bytes`` (always the first file)."""
    if max_bytes is None:
        return files
    kept, total = [], 0
    for f in files:
        total += f.stat().st_size
        if kept and total > max_bytes:
            break
        kept.append(f)
    return kept


def read_documents(files: Iterable[Path], progress=None) -> Iterator[str]:
    """Yield each non-empty document's text unchanged; bytes that are not UTF-8 become U+FFFD.
    ``progress`` (a tqdm bar) advances by one per file."""
    for f in files:
        if progress is not None:
            progress.update(1)
        if f.suffix == ".jsonl":
            with open(f, encoding="utf-8", errors="replace") as lines:
                for lineno, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as exc:
                        raise ValueError(f"{f}:{lineno}: not a JSON line ({exc})") from exc
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"{f}:{lineno}: a .jsonl line must be an object with a string "
                                         f"'text' field")
                    if record["text"]:
                        yield record["text"]
        else:
            with open(f, encoding="utf-8", errors="replace", newline="") as fh:  # keep \r\n as is
                text = fh.read()
            if text:
                yield text


def take_chars(texts: Iterable[str], max_chars: int | None) -> Iterator[str]:
    """Leading documents up to about ``max_chars`` characters in total (at least one)."""
    total = 0
    for t in texts:
        if total and max_chars is not None and total + len(t) > max_chars:
            return
        total += len(t)
        yield t


def make_tokenizer(spec: str, documents: Callable[[], Iterable[str]], train_chars: int | None,
                   hf: HFTokenizer | None = None):
    """A spec ('byte', 'bpe:N') builds a tokenizer, training BPE on the leading documents; anything else
    is taken as the prefix of prepared data whose tokenizer is reused (so splits share one vocabulary).
    A Hugging Face tokenizer (``hf``, from --tokenizer-model) is used as it is."""
    if hf is not None:
        return hf
    if spec != "byte" and not spec.startswith("bpe:"):
        return load_tokenizer(spec)
    kind, size = parse_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    return train_bpe(take_chars(documents(), train_chars), size)


def encode_documents(tokenizer, texts: Iterable[str]) -> Iterator[list[int]]:
    it = iter(texts)
    while batch := list(itertools.islice(it, ENCODE_BATCH_DOCS)):
        yield from tokenizer.encode_batch(batch)


OUTPUT_SUFFIXES = (".bin", ".idx", ".json", ".tokenizer.json")  # what prepare writes per prefix


def check_output(output: str | os.PathLike, overwrite: bool = False) -> None:
    """``output`` is a prefix prepare may write: not a directory, in a directory that can be
    written, and (unless ``overwrite``) holding no prepared data yet. ValueError otherwise; creates
    nothing."""
    out = str(output)
    if not out or out.endswith(os.sep) or os.path.isdir(out):
        raise ValueError(f"--output {out!r} is a directory: give a prefix inside it (e.g. "
                         f"{os.path.join(out or '.', 'corpus')}), which names PREFIX.bin, .idx and .json")
    if (problem := unwritable(os.path.dirname(os.path.abspath(out)))):
        raise ValueError(f"--output {out}: {problem}; choose a prefix in a directory you can write to")
    held = [f"{out}{s}" for s in OUTPUT_SUFFIXES if os.path.lexists(f"{out}{s}")]
    if (odd := [p for p in held if not os.path.isfile(p)]):
        raise ValueError(f"--output {out}: {odd[0]} is not a file; choose another prefix")
    if held and not overwrite:
        raise ValueError(f"--output {out} already holds prepared data ({', '.join(held)}): choose "
                         f"another prefix, or add --overwrite to replace it")


def prepare(inputs: Iterable[str | os.PathLike], output: str | os.PathLike, tokenizer: str = "bpe:8192",
            max_bytes: int | None = None, train_chars: int | None = None,
            extensions: Iterable[str] = TEXT_EXTENSIONS, skip_dirs: Iterable[str] = (),
            tokenizer_model: str | None = None, tokenizer_type: str | None = None,
            vocab_file: str | None = None, merge_file: str | None = None,
            progress: bool = False, overwrite: bool = False) -> dict:
    """Tokenize ``inputs`` into ``output``.bin/.idx/.json (+ .tokenizer.json for BPE and HF
    tokenizers) and return the description.

    ``max_bytes`` caps the input (whole files, in sorted order); ``train_chars`` caps the text BPE is
    trained on (the leading documents), since training on a sample is much faster and nearly as good.
    ``tokenizer_model`` / ``tokenizer_type`` / ``vocab_file`` + ``merge_file`` name a tokenizer from
    the ecosystem (hf_tokenizer.py) and then replace ``tokenizer``. ``progress`` shows a bar.
    An ``output`` that already holds prepared data is refused unless ``overwrite``; nothing is
    written there until every document is tokenized (a failure leaves it as it was, or empty).
    """
    check_output(output, overwrite)
    for name, value in (("--max-bytes", max_bytes), ("--train-chars", train_chars)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    hf = resolve_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    if hf is None and tokenizer_type == "NullTokenizer":
        raise ValueError("--tokenizer-type NullTokenizer cannot tokenize text: name a tokenizer")
    inputs, extensions = [str(p) for p in inputs], tuple(extensions)
    if not inputs:
        raise ValueError("no inputs given: pass files or directories with text to --input")
    files = cap_files(collect_files(inputs, extensions, skip_dirs), max_bytes)
    documents = lambda: read_documents(files)  # noqa: E731 - re-readable: BPE training needs a first pass
    if next(iter(documents()), None) is None:
        raise ValueError(f"empty corpus: found {len(files)} file(s) under {inputs} and no text in them; "
                         f"directories are searched for {' '.join(extensions)} files: pass non-empty "
                         f"text files or directories that hold them")
    tok = make_tokenizer(tokenizer, documents, train_chars, hf)
    parent = Path(output).parent
    made = [p for p in (parent, *parent.parents) if not p.exists()]  # removed again on failure
    parent.mkdir(parents=True, exist_ok=True)
    tok_path = Path(f"{output}.tokenizer.json")
    tok_tmp = tok_path.with_name(f".{tok_path.name}.tmp-{os.getpid()}")
    extra = {"inputs": inputs, "num_files": len(files)}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(files), desc=f"tokenizing {Path(output).name}", unit="file",
                   dynamic_ncols=True, file=sys.stderr)
    try:
        if isinstance(tok, (BPETokenizer, HFTokenizer)):
            tok.save(tok_tmp)  # beside the data once the data is complete
        meta = write_documents(output, encode_documents(tok, read_documents(files, bar)), tok, extra)
        if tok_tmp.exists():
            os.replace(tok_tmp, tok_path)
        else:
            tok_path.unlink(missing_ok=True)  # (--overwrite) not the previous data's tokenizer
        return meta
    except BaseException:
        tok_tmp.unlink(missing_ok=True)
        for d in made:  # directories this call created, innermost first, if still empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
    finally:
        tok_tmp.unlink(missing_ok=True)
        if bar is not None:
            bar.close()
