"""Saving: every rank writes the slices it owns into ``iter_X.tmp/``, rank 0 merges the per-rank
descriptions into ``index.json``, renames the directory and repoints ``latest`` (atomic: a crash before
the rename leaves the previous checkpoint and ``latest`` untouched). Replicated tensors are written
once: TP-replicated ones by tp rank 0, DP-replicated ones by dp rank 0, a tied output embedding by the
first stage only."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import torch
import torch.distributed as dist

from engine.checkpoint.index import (FORMAT, INDEX_NAME, LATEST, CheckpointError, list_checkpoints,
                                     step_dir_name, write_json, write_shard)
from engine.checkpoint.specs import ParamSpec, data_info, device_rng, layout_of, param_specs
from parallel.dp.residuals import logical_residual_pieces


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
        ps.world_group.barrier()
    except RuntimeError as exc:
        raise CheckpointError(f"barrier over all {ps.world_size} ranks {what} failed on "
                              f"{ps.describe()}: a rank did not arrive (check its log): {exc}") from exc


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
    # error-feedback residuals summed over the ranks that share them: any layout can take them up
    for name, _, a, b, t in logical_residual_pieces(trainer.reducer, ps):
        s = specs[name]
        if s.writer:
            whole = a == 0 and b == s.param.numel()
            shard.add(f"optim/grad_residual/{name}", s, t, None if whole else (a, b))
    own = {"rng/cpu": torch.get_rng_state()}
    if (dev_rng := device_rng(trainer.dev)) is not None:
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
    data = data_info(trainer)
    if data["tokenizer_sha256"]:
        shutil.copyfile(f"{data['prefix']}.tokenizer.json", os.path.join(tmp, "tokenizer.json"))
    write_json(os.path.join(tmp, INDEX_NAME), {
        "format": FORMAT, "step": step, "layout": layout_of(trainer),
        "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(cfg.model), "data": data,
        "sampler": {**trainer.sampler.state_dict(), "next_step": step},
        "scaler": trainer.scaler.state_dict(), "reducer": {"step": reducer_step},
        "optimizer": {"kind": opt_sd["kind"], "step": opt_sd["step"],
                      "variance_frozen": opt_sd.get("variance_frozen", False)},
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
