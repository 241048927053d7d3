"""Sharded, resharding checkpoints: every rank writes the slices it owns, any layout reads them back.

Save (``--save DIR``): each rank writes ``DIR/iter_X.tmp/rank_NNNNN.safetensors`` with its model
slices, its optimizer state (ZeRO-1: its flat range of each local shard), RNG states and compression
residuals, plus a small JSON describing them; after a barrier rank 0 merges those into ``index.json``,
renames the directory to ``iter_X`` and repoints ``DIR/latest``. A crash before the rename leaves the
previous checkpoint and ``latest`` untouched. Replicated tensors are written once: TP-replicated
ones by tp rank 0, DP-replicated ones by dp rank 0, a tied output embedding by the first stage only.

Load (``--load DIR``, or automatically from ``--save DIR`` when it holds an unfinished run): the
files are verified against their sha256 (each rank hashes a share, the verdict is all-reduced), the
run's model shape and vocabulary are checked against the checkpoint's, and each rank reads only the
boxes of the global tensors that its own shards cover. See docs/checkpoints.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open

from engine.checkpoint_index import (FORMAT, INDEX_NAME, LATEST, CheckpointError, TensorReader,
                                     has_checkpoint, inspect, intact_hint, list_checkpoints,
                                     read_index, resolve, saved_step, step_dir_name, verify,
                                     write_json, write_shard)
from models.gpt import GPTChunk
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["save_checkpoint", "load_checkpoint", "has_checkpoint", "saved_step", "CheckpointError",
           "ParamSpec", "param_specs", "load_model_params", "inspect"]
LAYOUT_KEYS = ("tp", "pp", "dp", "virtual_pipeline_size", "order")


@dataclass
class ParamSpec:
    """Where this rank's tensor of a logical parameter sits in the global tensor."""
    name: str
    param: torch.nn.Parameter
    global_shape: list[int]
    offsets: list[int]       # of the local tensor inside the global one
    valid_shape: list[int]   # the local part inside the global shape (vocab padding rows dropped)
    writer: bool             # the copy that saves it (before the DP rule)


def param_specs(chunks, ps, vocab_size: int) -> list[ParamSpec]:
    """One spec per local parameter, under its layout-independent logical name."""
    shard: dict[int, tuple[int, bool]] = {}  # id(param) -> (shard dim, vocab-padded)
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, ColumnParallelLinear):
                shard.update({id(p): (0, False) for p in (m.weight, m.bias) if p is not None})
            elif isinstance(m, RowParallelLinear):
                shard[id(m.weight)] = (1, False)
            elif isinstance(m, VocabParallelEmbedding):
                shard[id(m.weight)] = (0, True)
            if isinstance(m, GPTChunk) and hasattr(m, "output_weight"):
                shard[id(m.output_weight)] = (0, True)
    specs = []
    for chunk in chunks:
        for name, p in chunk.logical_named_parameters():
            local = list(p.shape)
            gshape, offsets, valid = list(local), [0] * len(local), list(local)
            sharded = getattr(p, "tp_sharded", False)
            if sharded or id(p) in shard:
                dim, vocab = shard.get(id(p), (getattr(p, "tp_shard_dim", None), False))
                if dim is None:
                    raise CheckpointError(f"parameter {name} is TP-sharded along an unknown dim: "
                                          f"set p.tp_shard_dim on it")
                offsets[dim] = ps.tp_rank * local[dim]
                gshape[dim] = local[dim] * ps.tp_size
                if vocab:
                    gshape[0] = vocab_size
                    valid[0] = max(0, min(local[0], vocab_size - offsets[0]))
            copy = getattr(p, "shared_embedding", False) and not chunk.pre_process
            writer = not copy and (sharded or ps.tp_rank == 0)
            specs.append(ParamSpec(name, p, gshape, offsets, valid, writer))
    return specs


class _Shard:
    """What one rank writes: tensors for its file and the pieces for the index."""

    def __init__(self, fname: str):
        self.fname, self.tensors, self.entries = fname, {}, {}

    def add(self, name: str, spec: ParamSpec, t: torch.Tensor, flat=None) -> None:
        if flat is None:
            t = t.reshape(spec.param.shape)[tuple(slice(0, v) for v in spec.valid_shape)]
            piece = {"offsets": spec.offsets, "shape": spec.valid_shape}
        else:  # a ZeRO rank's range of the flattened local shard; padding rows are trailing
            end = min(flat[1], math.prod(spec.valid_shape))
            if end <= flat[0]:
                return
            t = t.reshape(-1)[:end - flat[0]]
            piece = {"offsets": spec.offsets, "shape": spec.valid_shape, "flat": [flat[0], end]}
        if t.numel() == 0:
            return
        self.tensors[name] = t
        entry = self.entries.setdefault(name, {"shape": spec.global_shape, "dtype": str(t.dtype)[6:],
                                               "pieces": []})
        entry["pieces"].append({"file": self.fname, "key": name, **piece})


def _barrier(ps, what: str) -> None:
    if ps.world_size == 1 or not dist.is_initialized():
        return
    try:
        dist.barrier()
    except RuntimeError as exc:
        raise CheckpointError(f"barrier over all {ps.world_size} ranks {what} failed on "
                              f"{ps.describe()}: a rank did not arrive (check its log): {exc}") from exc


def _device_rng(dev) -> torch.Tensor | None:
    return dev.get_rng_state()


def _layout(trainer) -> dict:
    cfg, g = trainer.cfg, trainer.grid
    return {"tp": g.tp, "pp": g.pp, "dp": g.dp, "order": cfg.parallel.order,
            "virtual_pipeline_size": cfg.parallel.virtual_pipeline_size,
            "use_distributed_optimizer": cfg.parallel.use_distributed_optimizer,
            "sequence_parallel": cfg.parallel.sequence_parallel, "world_size": g.world_size,
            "precision": cfg.precision.precision, "compression": dataclasses.asdict(cfg.compression)}


def _data_info(trainer) -> dict:
    data = trainer.data
    tok = f"{data.prefix}.tokenizer.json" if data.prefix else None
    sha = None
    if tok and os.path.isfile(tok):
        with open(tok, "rb") as fh:
            sha = hashlib.sha256(fh.read()).hexdigest()
    return {"tokenizer": getattr(data.train, "tokenizer_spec", None), "vocab_size": data.vocab_size,
            "eot_id": getattr(data.train, "eot_id", None), "mock": data.prefix is None,
            "prefix": data.prefix, "tokenizer_sha256": sha}


# ---- save -------------------------------------------------------------------------------------
def save_checkpoint(trainer, step: int) -> str:
    cfg, ps = trainer.cfg, trainer.ps
    root = cfg.checkpoint.save
    final = os.path.join(root, step_dir_name(step))
    loaded = getattr(trainer, "loaded_checkpoint", None)
    if getattr(trainer, "loaded_step", None) == step and loaded and \
            os.path.realpath(loaded) == os.path.realpath(final):
        return final  # nothing trained since this checkpoint was loaded
    tmp = final + ".tmp"
    if ps.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        os.makedirs(tmp)
    _barrier(ps, f"before writing {tmp}")
    shard = _Shard(f"rank_{ps.rank:05d}.safetensors")
    specs = {s.name: s for s in param_specs(trainer.chunks, ps, cfg.model.vocab_size)}
    for s in specs.values():
        if s.writer and ps.dp_rank == 0:
            shard.add(f"model/{s.name}", s, s.param.detach())
    sd = trainer.optimizer.state_dict()
    zero = sd["kind"] == "distributed"
    for piece in sd["pieces"]:
        s = specs[piece["name"]]
        if not s.writer or not (zero or ps.dp_rank == 0):
            continue
        whole = piece["start"] == 0 and piece["end"] == s.param.numel()
        for key, t in sd["state"][piece["name"]].items():
            shard.add(f"optim/{key}/{s.name}", s, t, None if whole else (piece["start"], piece["end"]))
    own = {"rng/cpu": torch.get_rng_state()}
    if (dev_rng := _device_rng(trainer.dev)) is not None:
        own["rng/device"] = dev_rng.cpu()
    red = trainer.reducer.state_dict()
    own.update({f"residual/{k}": v for k, v in red["residuals"].items()})
    info = write_shard({**shard.tensors, **own}, os.path.join(tmp, shard.fname))
    c = ps.coord
    write_json(os.path.join(tmp, f"rank_{ps.rank:05d}.json"), {
        "rank": ps.rank, "coord": [c.tp, c.pp, c.dp], "file": shard.fname, "file_info": info,
        "tensors": shard.entries, "own": sorted(own)})
    _barrier(ps, f"after writing the shards of {tmp}")
    if ps.rank == 0:
        _publish(trainer, step, tmp, final, sd, red["step"])
    _barrier(ps, f"after publishing {final}")
    return final


def _publish(trainer, step, tmp, final, opt_sd, reducer_step) -> None:
    """Rank 0: merge the per-rank JSON into index.json, rename, repoint latest, prune."""
    cfg = trainer.cfg
    tensors, files, ranks = {}, {}, {}
    for r in range(trainer.ps.world_size):
        path = os.path.join(tmp, f"rank_{r:05d}.json")
        with open(path, encoding="utf-8") as fh:
            part = json.load(fh)
        files[part["file"]] = part["file_info"]
        ranks[str(r)] = {"coord": part["coord"], "file": part["file"], "own": part["own"]}
        for name, entry in part["tensors"].items():
            merged = tensors.setdefault(name, {**entry, "pieces": []})
            if merged["shape"] != entry["shape"]:
                raise CheckpointError(f"ranks disagree on the shape of {name}: {merged['shape']} "
                                      f"vs {entry['shape']} (rank {r})")
            merged["pieces"] += entry["pieces"]
        os.remove(path)
    data = _data_info(trainer)
    if data["tokenizer_sha256"]:
        shutil.copyfile(f"{data['prefix']}.tokenizer.json", os.path.join(tmp, "tokenizer.json"))
    write_json(os.path.join(tmp, INDEX_NAME), {
        "format": FORMAT, "step": step, "layout": _layout(trainer),
        "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(cfg.model), "data": data,
        "sampler": {**trainer.sampler.state_dict(), "next_step": step},
        "scaler": trainer.scaler.state_dict(), "reducer": {"step": reducer_step},
        "optimizer": {"kind": opt_sd["kind"], "step": opt_sd["step"]},
        "tensors": tensors, "files": files, "ranks": ranks})
    root = os.path.dirname(final)
    old = None
    if os.path.isdir(final):
        old = f"{final}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    link = os.path.join(root, f".{LATEST}.tmp")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.basename(final), link)
    os.replace(link, os.path.join(root, LATEST))
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    for _, path in list_checkpoints(root)[:-cfg.checkpoint.keep_last]:
        if os.path.realpath(path) != os.path.realpath(final):
            shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):  # directories of saves that crashed before their rename
        if name.startswith("iter_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---- load -------------------------------------------------------------------------------------
def check_compatible(index: dict, cfg, data: dict, where: str) -> None:
    """The run's model shape and vocabulary must be the checkpoint's (pure: same on every rank)."""
    saved, model = index["model"], cfg.model
    keys = ["block", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"]
    if "model/embedding.position" in index["tensors"]:
        keys.append("max_position_embeddings")
    for key in keys:
        if saved[key] != getattr(model, key):
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(f"checkpoint {where} was saved with {flag} {saved[key]} but this run "
                                  f"has {flag} {getattr(model, key)}: use the checkpoint's model shape "
                                  f"or start without --load")
    was, now = index["data"], data
    describe = lambda d: "mock data" if d["mock"] else f"tokenizer {d['tokenizer']} ({d['prefix']})"
    if was["vocab_size"] != now["vocab_size"] or was["tokenizer"] != now["tokenizer"] or (
            was["tokenizer_sha256"] and now["tokenizer_sha256"]
            and was["tokenizer_sha256"] != now["tokenizer_sha256"]):
        fix = f"--mock-data --vocab-size {was['vocab_size']}" if was["mock"] else \
            f"--data-path {was['prefix']}, or data prepared with python -m engine.data prepare " \
            f"--tokenizer {was['prefix']}"
        raise CheckpointError(
            f"checkpoint {where} was trained on a {was['vocab_size']}-token vocabulary from "
            f"{describe(was)}, but this run's data has {now['vocab_size']} tokens from {describe(now)}: "
            f"train on the checkpoint's data ({fix}) or start without --load")


def _verify_shared(ps, ckpt: str, index: dict) -> None:
    """Each rank hashes every world_size-th file; an all-reduce shares the verdict."""
    names = sorted(index["files"])
    mine = names[ps.rank::ps.world_size] if dist.is_initialized() else names
    bad = {n for n in mine if verify(ckpt, index, [n])}
    if dist.is_initialized() and ps.world_size > 1:
        flags = torch.tensor([n in bad for n in names], dtype=torch.int32, device=ps.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad = {n for n, f in zip(names, flags.tolist()) if f}
    if bad:
        problems = verify(ckpt, index, sorted(bad))
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems)
                              + intact_hint(os.path.dirname(ckpt), exclude=ckpt))


def load_model_params(specs: list[ParamSpec], reader: TensorReader) -> None:
    for s in specs:
        name = f"model/{s.name}"
        if name not in reader:
            raise CheckpointError(f"checkpoint {reader.ckpt} has no tensor {s.name}: it was saved from "
                                  f"a different model (block or layer count)")
        saved = reader.index["tensors"][name]["shape"]
        if saved != s.global_shape:
            raise CheckpointError(f"checkpoint {reader.ckpt}: {s.name} has shape {saved} but this model "
                                  f"needs {s.global_shape}; use the checkpoint's model configuration")
        t = reader.read(name, s.offsets, list(s.param.shape), dtype=s.param.dtype)
        with torch.no_grad():
            s.param.copy_(t.to(s.param.device))


def load_checkpoint(trainer, load_dir: str) -> int:
    """Restore everything into a built trainer; return the step to continue from."""
    cfg, ps = trainer.cfg, trainer.ps
    ckpt = resolve(load_dir)
    index = read_index(ckpt)
    check_compatible(index, cfg, _data_info(trainer), ckpt)
    _verify_shared(ps, ckpt, index)
    reader = TensorReader(ckpt, index)
    specs = param_specs(trainer.chunks, ps, cfg.model.vocab_size)
    load_model_params(specs, reader)
    by_name = {s.name: s for s in specs}
    current = trainer.optimizer.state_dict()
    step = int(index["step"])
    state, pieces = {}, []
    for piece in current["pieces"]:
        s, (a, b) = by_name[piece["name"]], (piece["start"], piece["end"])
        pieces.append({"name": s.name, "start": a, "end": b})
        state[s.name] = {key: reader.read(f"optim/{key}/{s.name}", s.offsets, list(s.param.shape),
                                          flat=(a, b)).to(ps.device)
                         for key in ("exp_avg", "exp_avg_sq", "master")
                         if f"optim/{key}/{s.name}" in reader}
    try:
        trainer.optimizer.load_state_dict({"step": index["optimizer"]["step"], "pieces": pieces,
                                           "state": state})
        trainer.sampler.load_state_dict(index["sampler"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: {exc}") from exc
    trainer.sampler.next_step = step
    layout = index["layout"]
    if layout["precision"] == cfg.precision.precision:
        trainer.scaler.load_state_dict(index["scaler"])
    same = all(layout[k] == _layout(trainer)[k] for k in LAYOUT_KEYS + ("compression",))
    own = {}
    if same:  # per-rank state only means something on the same rank of the same layout
        rank = index["ranks"][str(ps.rank)]
        with safe_open(os.path.join(ckpt, rank["file"]), framework="pt") as fh:
            own = {k: fh.get_tensor(k) for k in rank["own"]}
        torch.set_rng_state(own["rng/cpu"])
        if "rng/device" in own and trainer.dev.type != "cpu":
            trainer.dev.set_rng_state(own["rng/device"])
    trainer.reducer.load_state_dict({"step": index["reducer"]["step"], "residuals": {
        k[len("residual/"):]: v.to(ps.device) for k, v in own.items() if k.startswith("residual/")}})
    trainer.loaded_checkpoint, trainer.loaded_step = ckpt, step
    return step


# ---- python -m engine.checkpoint inspect DIR ---------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="print step, layout and tensors; verify checksums").add_argument("dir")
    args = parser.parse_args(argv)
    try:
        return inspect(args.dir)
    except CheckpointError as exc:
        print(f"gridtron: checkpoint error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
