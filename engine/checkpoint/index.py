"""The on-disk checkpoint format: shard files, the JSON index, checksums (reading slices back:
tensor_reader.py).

A checkpoint is a directory ``iter_0000005/`` holding one safetensors file per rank and an
``index.json`` that maps every logical tensor to its pieces::

    "tensors": {"model/layers.0.attn.qkv.weight": {"shape": [192, 64], "dtype": "float32",
                    "pieces": [{"file": "rank_00000.safetensors", "key": "...",
                                "offsets": [0, 0], "shape": [96, 64]},          # a box
                               {"file": ..., "key": ..., "offsets": [96, 0], "shape": [96, 64],
                                "flat": [0, 3072]}]}}                           # a flat range of a box
    "files": {"rank_00000.safetensors": {"sha256", "bytes", "header_bytes", "header_crc32",
                                         "tensors": {key: [begin, end, crc32]}}}

A box piece stores the sub-tensor ``global[offsets : offsets + shape]``. A flat piece stores elements
[start, end) of that box flattened in row-major order (a ZeRO-1 rank owns such a range of its local
shard). Byte ranges and CRCs of every stored tensor are recorded in the index itself, so damage is
located to the tensor even when the file's own header is the damaged part.

Everything here is pure file I/O: no process groups, no model. Metadata is JSON; there is no pickle.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import sys
import zlib

import torch

FORMAT = "gridtron-checkpoint-v1"
INDEX_NAME = "index.json"
LATEST = "latest"
ASIDE = "overwritten"  # where --overwrite keeps a replaced run's checkpoints until the first save
_STEP_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or does not fit this run; the message says what to do."""


def step_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoint directories under ``root`` as (step, path), oldest first (``.tmp``
    directories of interrupted saves are not listed)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root)
             if (m := _STEP_DIR.match(n)) and os.path.isdir(os.path.join(root, n))]
    return sorted(found)


def resolve(path: str) -> str:
    """The checkpoint directory meant by ``path``: itself when it holds an index, else what
    ``path/latest`` points at (a symlink, or a small file naming the directory; when a crash
    came while a re-save of that step was swapped in, the complete new copy, else the old one),
    else the newest complete ``iter_*`` directory under it."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist: pass a directory written by --save, or one "
                              f"of its iter_* directories")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory: pass a directory "
                              f"written by --save, or one of its iter_* directories")
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.islink(latest) or os.path.isfile(latest):
        target = os.readlink(latest) if os.path.islink(latest) else open(latest).read().strip()
        target = os.path.join(path, target)
        if not os.path.isdir(target):
            # a re-save of that step (a rollback's) swaps the complete new copy in by two renames,
            # the old one aside first (writer.py ``promote``): a crash between them leaves both
            for left in (f"{target}.tmp", f"{target}.old"):
                if os.path.isfile(os.path.join(left, INDEX_NAME)):
                    return left
            raise CheckpointError(f"{latest} points at {target}, which does not exist"
                                  + intact_hint(path, exclude=target))
        return target
    complete = [p for _, p in list_checkpoints(path) if os.path.isfile(os.path.join(p, INDEX_NAME))]
    if complete:  # saved, but the crash came before latest was repointed
        return complete[-1]
    raise CheckpointError(f"{path} holds no checkpoint (neither {INDEX_NAME} nor {LATEST}); pass a "
                          f"directory written by --save, or one of its iter_* directories")


def read_index(ckpt: str, hint: bool = True) -> dict:
    """The parsed and checked ``index.json`` of checkpoint directory ``ckpt``; a missing, garbled or
    incomplete index is a CheckpointError (naming, with ``hint``, the newest intact earlier
    checkpoint)."""
    path = os.path.join(ckpt, INDEX_NAME)
    where = (lambda: intact_hint(os.path.dirname(ckpt), exclude=ckpt)) if hint else (lambda: "")
    try:
        with open(path, encoding="utf-8") as fh:
            index = json.load(fh)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing: the save did not finish" + where()) from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is damaged ({exc})" + where()) from exc
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc})") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        what = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(f"{path} is not a gridtron checkpoint index (format {what!r}, "
                              f"expected {FORMAT!r})")
    if (problem := index_problem(index)):
        raise CheckpointError(f"{path} is damaged: {problem}" + where())
    return index


def _count(value, least: int = 0) -> bool:
    return type(value) is int and value >= least


# what every reader of an index (the loader, resume, inspect, export, generate) relies on
_MODEL_COUNTS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
_LAYOUT_COUNTS = ("tp", "pp", "dp", "virtual_pipeline_size", "world_size")
_DATA_KEYS = ("tokenizer", "vocab_size", "mock", "prefix", "tokenizer_sha256")


def index_problem(index: dict) -> str | None:
    """Why a parsed index cannot be read as the loader reads it (None when it can): a step that is
    not a count, a section missing or of the wrong kind, a tensor, file or rank entry without the
    fields that locate and check its bytes. Pure."""
    step = index.get("step")
    if not _count(step):
        return f"its step is {step!r}, not a number of optimizer steps"
    for key in ("layout", "model", "data", "tensors", "files", "ranks"):
        if not isinstance(index.get(key), dict):
            return f"its {key!r} section is missing or not a JSON object"
    model, layout, data = index["model"], index["layout"], index["data"]
    if not isinstance(model.get("block"), str):
        return f"model.block is {model.get('block')!r}, not a block name"
    for section, name, keys in (("model", model, _MODEL_COUNTS), ("layout", layout, _LAYOUT_COUNTS)):
        for key in keys:
            if not _count(name.get(key), 1):
                return f"{section}.{key} is {name.get(key)!r}, not a positive integer"
    if not isinstance(layout.get("precision"), str) or \
            not isinstance(layout.get("use_distributed_optimizer"), bool):
        return "layout.precision or layout.use_distributed_optimizer is missing"
    if (missing := [k for k in _DATA_KEYS if k not in data]):
        return f"data.{missing[0]} is missing"
    for name, f in index["files"].items():
        if not isinstance(f, dict) or not isinstance(f.get("sha256"), str) or not all(
                _count(f.get(k)) for k in ("bytes", "header_bytes", "header_crc32")) or \
                not isinstance(f.get("tensors"), dict) or not all(
                isinstance(r, list) and len(r) == 3 and all(_count(v) for v in r)
                for r in f["tensors"].values()):
            return f"the entry of file {name!r} lacks its size, sha256 or byte ranges"
    for name, entry in index["tensors"].items():
        ok = isinstance(entry, dict) and isinstance(entry.get("shape"), list) and \
            all(_count(v) for v in entry["shape"]) and isinstance(entry.get("dtype"), str) and \
            isinstance(entry.get("pieces"), list)
        for piece in entry.get("pieces", []) if ok else []:
            ok = ok and isinstance(piece, dict) and piece.get("file") in index["files"] and \
                isinstance(piece.get("key"), str) and all(
                    isinstance(piece.get(k), list) and len(piece[k]) == len(entry["shape"])
                    and all(_count(v) for v in piece[k]) for k in ("offsets", "shape"))
        if not ok:
            return f"the entry of tensor {name!r} lacks its shape, dtype or pieces"
    for rank, r in index["ranks"].items():
        if not (isinstance(r, dict) and r.get("file") in index["files"] and isinstance(r.get("coord"), list)
                and len(r["coord"]) == 3 and isinstance(r.get("own"), list)):
            return f"the entry of rank {rank!r} lacks its file, coordinates or keys"
    return None


def write_json(path: str, data: dict) -> None:
    """Write via a temporary sibling and rename, with fsync: readers see all of it or none."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# ---- writing and checking shard files -------------------------------------------------------
# safetensors' dtype names (its format's spec)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                      torch.int16: "I16", torch.int8: "I8", torch.uint64: "U64",
                      torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
                      torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0"}


def _host_bytes(t: torch.Tensor):
    """A tensor's bytes as a host buffer: a view of a contiguous host tensor (no copy), else one
    tensor's copy (made contiguous where it is, then a device tensor comes to the host alone,
    never the whole file at once)."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8).numpy()


def write_shard(tensors: dict[str, torch.Tensor], path: str) -> dict:
    """Write one safetensors file and return its index entry (size, sha256, per-tensor CRCs).

    Streamed: the header (safetensors' format: its length as 8 little-endian bytes, the JSON table
    padded with spaces to 8 bytes, then the data in table order, larger elements first so every
    tensor starts aligned to its element size) and then each tensor's bytes, hashed as they are
    written. Host memory beyond the tensors themselves is one tensor's copy where it comes from a
    device (safetensors' own ``save`` builds the whole file in memory, twice: one rank's file of
    an 8B model with its optimizer state is about 105 GiB); the file writes, sha256 and crc32 of
    large buffers release the GIL, so a background save leaves the training thread running."""
    if sys.byteorder != "little":   # the format is little-endian; the bytes go out as they are
        raise RuntimeError("write_shard writes a little-endian host's bytes; this host is "
                           f"{sys.byteorder}-endian")
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    table, at = {}, 0
    for key, t in items:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"write_shard: {key!r} has dtype {t.dtype}, which this writer does "
                            f"not write")
        size = t.numel() * t.element_size()
        table[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    start, sha, entries = len(head), hashlib.sha256(head), {}
    with open(path, "wb") as fh:
        fh.write(head)
        for key, t in items:
            data = _host_bytes(t)
            sha.update(data)
            b, e = (start + o for o in table[key]["data_offsets"])
            entries[key] = [b, e, zlib.crc32(data)]
            fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"sha256": sha.hexdigest(), "bytes": start + at, "header_bytes": start,
            "header_crc32": zlib.crc32(head), "tensors": entries}


def sha256_file(path: str, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def file_damage(path: str, info: dict, keys=None) -> str | None:
    """None when the file matches its recorded sha256, else a sentence naming the damaged tensors.
    ``keys``: a predicate on tensor keys; then only those tensors' bytes and the header are checked,
    each range against its CRC32 (a load of the weights alone need not read the optimizer state:
    2 of 16 bytes a parameter with bf16 weights and AdamW)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    if keys is None and size == info["bytes"] and sha256_file(path) == info["sha256"]:
        return None
    bad = []
    with open(path, "rb") as fh:   # each recorded range alone: never the whole file in memory
        for key, (b, e, crc) in info["tensors"].items():
            if keys is not None and not keys(key):
                continue
            fh.seek(b)
            if e > size or zlib.crc32(fh.read(e - b)) != crc:
                bad.append(key)
        fh.seek(0)
        head = fh.read(info["header_bytes"])
    head_bad = zlib.crc32(head) != info["header_crc32"]
    if keys is not None and not bad and not head_bad and size == info["bytes"]:
        return None   # what is read is intact (the rest was not asked about; safetensors opens
        #               a file only at its full size)
    what = f"truncated ({size} of {info['bytes']} bytes)" if size < info["bytes"] else \
        f"corrupted ({size} bytes, checksum mismatch)"
    if bad:
        if len(bad) == 1:
            return f"{name} is {what}: tensor {bad[0]!r} does not match its checksum"
        shown = ", ".join(repr(k) for k in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return f"{name} is {what}: tensors {shown} do not match their checksums"
    if head_bad:
        return f"{name} is {what}: its safetensors header (tensor table) is damaged"
    if keys is not None:    # the tensors asked about are intact, the file is not
        return f"{name} is {what}"
    return f"{name} is {what}: bytes after the last tensor differ"


def is_weight_key(key: str) -> bool:
    """The tensor keys a load of the model's weights reads (``file_damage``'s ``keys``)."""
    return key.startswith("model/")


def verify(ckpt: str, index: dict, files: list[str] | None = None, keys=None) -> list[str]:
    """Check ``files`` (default: all) of a checkpoint against the index; one sentence per problem.
    ``keys``: only the tensors it accepts (``file_damage``)."""
    problems = []
    for name in files if files is not None else sorted(index["files"]):
        msg = file_damage(os.path.join(ckpt, name), index["files"][name], keys)
        if msg:
            problems.append(msg)
    return problems


def find_intact(root: str, exclude: str | None = None) -> str | None:
    """The newest checkpoint under ``root`` (other than ``exclude``) whose every file verifies."""
    skip = os.path.realpath(exclude) if exclude else None
    for _, path in reversed(list_checkpoints(root)):
        if os.path.realpath(path) == skip:
            continue
        try:
            index = read_index(path, hint=False)
        except CheckpointError:
            continue
        if not verify(path, index):
            return path
    return None


def intact_hint(root: str, exclude: str | None) -> str:
    intact = find_intact(root, exclude)
    if intact is None:
        return "; no earlier intact checkpoint was found there"
    return f"; the earlier checkpoint {intact} is intact: resume with --load {intact}"


def has_checkpoint(root: str | None) -> bool:
    return bool(root) and (os.path.lexists(os.path.join(root, LATEST))
                           or os.path.isfile(os.path.join(root, INDEX_NAME))
                           or any(os.path.isfile(os.path.join(p, INDEX_NAME))
                                  for _, p in list_checkpoints(root)))


def saved_step(root: str) -> int | None:
    """The step of the checkpoint ``root`` resolves to (None when it cannot be read)."""
    try:
        return int(read_index(resolve(root))["step"])
    except (CheckpointError, KeyError, ValueError, OSError):
        return None


def inspect(path: str, out=None) -> int:
    out = out or sys.stdout
    ckpt = resolve(path)
    index = read_index(ckpt)
    lay, m = index["layout"], index["model"]
    print(f"checkpoint {ckpt}: step {index['step']}", file=out)
    experts = f"ep={lay['ep']} etp={lay.get('etp', 1)} " if lay.get("ep", 1) > 1 or lay.get("etp", 1) > 1 else ""
    print(f"layout: tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} {experts}vp={lay['virtual_pipeline_size']} "
          f"zero1={lay['use_distributed_optimizer']} "
          f"zero_stage={lay.get('zero_stage', 1) if lay['use_distributed_optimizer'] else 0} "
          f"precision={lay['precision']} "
          f"world={lay['world_size']}", file=out)
    print(f"model: {m['block']} layers={m['num_layers']} hidden={m['hidden_size']} "
          f"heads={m['num_attention_heads']} ffn={m['ffn_hidden_size']} vocab={m['vocab_size']}; "
          f"data: {index['data']['tokenizer'] or 'mock'}", file=out)
    total = 0
    for name, entry in sorted(index["tensors"].items()):
        n = math.prod(entry["shape"])
        total += n
        print(f"  {name:<52} {str(entry['shape']):<14} {entry['dtype']:<9} "
              f"{len(entry['pieces'])} piece(s)", file=out)
    owner = {r["file"]: (rank, r["coord"]) for rank, r in index["ranks"].items()}
    for fname, f in sorted(index["files"].items()):
        rank, (tp, pp, dp) = owner.get(fname, ("?", ("?", "?", "?")))
        print(f"  {fname}: {f['bytes'] / 2**10:,.1f} KiB, {len(f['tensors'])} tensors "
              f"(rank {rank}: tp {tp}, pp {pp}, dp {dp})", file=out)
    size = sum(f["bytes"] for f in index["files"].values())
    print(f"{len(index['tensors'])} tensors, {total:,} elements, {len(index['files'])} files, "
          f"{size / 2**20:.2f} MiB", file=out)
    problems = verify(ckpt, index)
    for p in problems:
        print(f"DAMAGED: {p}", file=out)
    print("checksums: " + ("all files verified" if not problems else f"{len(problems)} damaged"), file=out)
    return 1 if problems else 0
