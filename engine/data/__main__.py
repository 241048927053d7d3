"""Command line for data preparation.

  python -m engine.data prepare --input PATHS... --output PREFIX [--tokenizer bpe:8192|byte|PREFIX]
                                [--tokenizer-model HF_DIR_OR_TOKENIZER_JSON] [--tokenizer-type TYPE]
                                [--overwrite]   # a PREFIX that holds data is refused without it
  python -m engine.data corpus [--tokenizer bpe:8192] [--cache-dir DIR]   # build the built-in corpus now
  python -m engine.data info PREFIX
  python -m engine.data convert PREFIX [--output NEW_PREFIX]   # old gridtron layout -> Megatron's

``prepare`` writes Megatron-LM's indexed format (PREFIX.bin + PREFIX.idx) with PREFIX.json beside it;
Megatron's own preprocessed data trains as it is (``--data-path PREFIX``).
"""
from __future__ import annotations

import argparse
import sys

from engine.base import ToolParser, os_error_text, run_tool
from engine.data.corpus import builtin_corpus
from engine.data.hf_tokenizer import TOKENIZER_TYPES
from engine.data.indexed import convert_legacy, read_index
from engine.data.prepare import TEXT_EXTENSIONS, prepare


def summary(prefix: str, index: dict) -> str:
    tok = "no tokenizer recorded (Megatron data)" if index["tokenizer"] is None else \
        f"tokenizer {index['tokenizer']} (vocab {index['vocab_size']}, eot {index['eot_id']})"
    return f"{prefix}: {index['num_tokens']} tokens in {index['num_docs']} documents, {tok}, {index['dtype']}"


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m engine.data", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text files into PREFIX.bin / .idx / .json")
    p.add_argument("--input", nargs="+", required=True, help="files or directories (searched recursively)")
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin, .idx and .json")
    p.add_argument("--tokenizer", default="bpe:8192",
                   help="'byte', 'bpe:N' (trained here) or the prefix of prepared data to reuse its tokenizer")
    p.add_argument("--tokenizer-model", default=None,
                   help="a tokenizer.json or a Hugging Face tokenizer directory (replaces --tokenizer)")
    p.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="Megatron's tokenizer type, with --tokenizer-model or --vocab-file/--merge-file")
    p.add_argument("--vocab-file", default=None, help="GPT-2's vocab.json (GPT2BPETokenizer)")
    p.add_argument("--merge-file", default=None, help="GPT-2's merges.txt (GPT2BPETokenizer)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--max-bytes", type=int, default=None, help="use only the first files up to this size")
    p.add_argument("--train-chars", type=int, default=None, help="train BPE on the leading text only")
    p.add_argument("--ext", nargs="+", default=list(TEXT_EXTENSIONS),
                   help=f"extensions searched in directories (default: {' '.join(TEXT_EXTENSIONS)})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the prepared data already at --output")
    c = sub.add_parser("corpus", help="prepare the built-in standard-library corpus into the cache")
    c.add_argument("--tokenizer", default="bpe:8192")
    c.add_argument("--cache-dir", default=None)
    i = sub.add_parser("info", help="describe prepared data")
    i.add_argument("prefix")
    v = sub.add_parser("convert", help="write the Megatron index for data in the old gridtron layout")
    v.add_argument("prefix")
    v.add_argument("--output", default=None, help="new prefix (default: convert in place)")
    def body() -> int:
        args = parser.parse_args(argv)
        if args.command == "prepare":
            index = prepare(args.input, args.output, args.tokenizer, max_bytes=args.max_bytes,
                            train_chars=args.train_chars,
                            extensions=[e if e.startswith(".") else f".{e}" for e in args.ext],
                            tokenizer_model=args.tokenizer_model, tokenizer_type=args.tokenizer_type,
                            vocab_file=args.vocab_file, merge_file=args.merge_file,
                            progress=args.progress, overwrite=args.overwrite)
            print(summary(args.output, index))
        elif args.command == "convert":
            out = args.output or args.prefix
            convert_legacy(args.prefix, args.output)
            print(summary(out, read_index(out)))
        elif args.command == "corpus":
            prefix = builtin_corpus(args.tokenizer, args.cache_dir, progress=True)
            print(summary(prefix, read_index(prefix)))
        else:
            print(summary(args.prefix, read_index(args.prefix)))
        return 0

    return run_tool(body, (OSError, lambda e: f"data error: {os_error_text(e)}", 2),
                    (ValueError, lambda e: f"data error: {e}", 2))


if __name__ == "__main__":
    sys.exit(main())
