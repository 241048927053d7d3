"""Command line for data preparation.

  python -m engine.data prepare --input PATHS... --output PREFIX [--tokenizer bpe:8192|byte|PREFIX]
  python -m engine.data corpus [--tokenizer bpe:8192] [--cache-dir DIR]   # build the built-in corpus now
  python -m engine.data info PREFIX
"""
from __future__ import annotations

import argparse
import sys

from engine.data.corpus import builtin_corpus
from engine.data.indexed import read_index
from engine.data.prepare import TEXT_EXTENSIONS, prepare


def summary(prefix: str, index: dict) -> str:
    return (f"{prefix}: {index['num_tokens']} tokens in {index['num_docs']} documents, tokenizer "
            f"{index['tokenizer']} (vocab {index['vocab_size']}, eot {index['eot_id']}), {index['dtype']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text files into PREFIX.bin / PREFIX.json")
    p.add_argument("--input", nargs="+", required=True, help="files or directories (searched recursively)")
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.json")
    p.add_argument("--tokenizer", default="bpe:8192",
                   help="'byte', 'bpe:N' (trained here) or the prefix of prepared data to reuse its tokenizer")
    p.add_argument("--max-bytes", type=int, default=None, help="use only the first files up to this size")
    p.add_argument("--train-chars", type=int, default=None, help="train BPE on the leading text only")
    p.add_argument("--ext", nargs="+", default=list(TEXT_EXTENSIONS),
                   help=f"extensions searched in directories (default: {' '.join(TEXT_EXTENSIONS)})")
    c = sub.add_parser("corpus", help="prepare the built-in standard-library corpus into the cache")
    c.add_argument("--tokenizer", default="bpe:8192")
    c.add_argument("--cache-dir", default=None)
    i = sub.add_parser("info", help="describe prepared data")
    i.add_argument("prefix")
    args = parser.parse_args(argv)

    try:
        if args.command == "prepare":
            index = prepare(args.input, args.output, args.tokenizer, max_bytes=args.max_bytes,
                            train_chars=args.train_chars,
                            extensions=[e if e.startswith(".") else f".{e}" for e in args.ext])
            print(summary(args.output, index))
        elif args.command == "corpus":
            prefix = builtin_corpus(args.tokenizer, args.cache_dir)
            print(summary(prefix, read_index(prefix)))
        else:
            print(summary(args.prefix, read_index(args.prefix)))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
