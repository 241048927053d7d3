"""Saving: every rank writes the slices it owns into ``iter_X.tmp/``, rank 0 merges the per-rank
descriptions into ``index.json``, renames the directory and repoints ``latest`` (atomic: a crash before
the rename leaves the previous checkpoint and ``latest`` untouched). Replicated tensors are written
once: TP-replicated ones by tp rank 0, DP- and CP-replicated ones by dp rank 0 of cp rank 0 (ZeRO
state, and under ZeRO-3 the parameters: every rank of the DP x CP group its own shard, as flat
ranges of the logical tensors), an expert's by expert-data-parallel rank 0
(each expert under its global index, so any ep reads it back), a tied output embedding by the
first stage only. The MoE routers' expert biases are saved beside the parameters.

A save has three parts, shared by the synchronous path here and the background one
(``async_writer.py``): ``snapshot`` (at the step boundary: what this rank writes, and on rank 0 what
the index says about the run), ``write_files`` (pure file I/O, no collective: the rank's safetensors
file and its JSON description) and ``publish`` (rank 0, once every rank's files are complete and
the run's metrics records up to the saved step are on disk: ``before_publish``)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.checkpoint.index import (ASIDE, FORMAT, INDEX_NAME, LATEST, CheckpointError, file_damage,
                                     list_checkpoints, resolve, sha256_file, step_dir_name, write_json,
                                     write_shard)
from engine.checkpoint.reader import _agree_on_failure
from engine.checkpoint.specs import (ParamSpec, buffer_specs, by_owner, data_info, device_rng,
                                     first_replica, layout_of, param_specs, split_flat)
from parallel.dp.residuals import logical_residual_pieces
from parallel.grid.launch import LaunchEnv


class _Shard:
    """What one rank writes: tensors for its file and the pieces for the index."""

    def __init__(self, fname: str):
        self.fname, self.tensors, self.entries = fname, {}, {}

    def add(self, name: str, spec: ParamSpec, t: torch.Tensor, flat=None) -> None:
        if flat is None:
            t = t.reshape(spec.shape)[tuple(slice(0, v) for v in spec.valid_shape)]
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


@dataclass
class Snapshot:
    """One rank's part of the save of ``step``, taken at the step boundary. For the background
    path every tensor is a host copy that training no longer touches."""
    step: int
    tmp: str
    final: str
    rank: int
    world_size: int
    keep_last: int
    fname: str
    tensors: dict[str, torch.Tensor]
    rank_json: dict                  # this rank's description (pieces, coordinates, own keys)
    index_meta: dict | None = None   # rank 0: what the index says about the run at this step


def lies_within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies under it, by real path (symbolic links followed)."""
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def _agree(ps, failure: Exception | None, what: str,
           after: str = "latest still names the previous checkpoint") -> None:
    """Every rank learns whether any rank failed at its own file work for ``what`` (``failure``:
    this rank's, a CheckpointError or an OSError such as a full disk or a missing permission,
    said as ``WHAT failed: OSError: ...; AFTER``); all raise the same line naming the failing rank
    (reader.py ``_agree_on_failure``: one all-gather, which is also the barrier here; nothing on a
    single process)."""
    if failure is not None and not isinstance(failure, CheckpointError):
        failure = CheckpointError(f"{what} failed: {type(failure).__name__}: {failure}; {after}")
    try:
        _agree_on_failure(ps, failure)
    except CheckpointError:
        raise
    except RuntimeError as exc:  # the all-gather itself: a rank that never arrives
        raise CheckpointError(f"agreeing over all {ps.world_size} ranks on {what} failed on "
                              f"{ps.describe()}: a rank did not arrive (check its log): {exc}") from exc


def _barrier(ps, what: str) -> None:
    if ps.world_size == 1 or not dist.is_initialized():
        return
    try:
        ps.world_group.barrier()
    except RuntimeError as exc:
        raise CheckpointError(f"barrier over all {ps.world_size} ranks {what} failed on "
                              f"{ps.describe()}: a rank did not arrive (check its log): {exc}") from exc


def checkpoint_dir(trainer, step: int) -> str:
    return os.path.join(trainer.cfg.checkpoint.save, step_dir_name(step))


def unchanged_since_load(trainer, step: int) -> bool:
    """True when ``step`` is the checkpoint this run loaded from the same place (nothing to save)."""
    loaded = getattr(trainer, "loaded_checkpoint", None)
    return getattr(trainer, "loaded_step", None) == step and bool(loaded) and \
        os.path.realpath(loaded) == os.path.realpath(checkpoint_dir(trainer, step))


def prepare_dir(trainer, step: int) -> str:
    """Rank 0 (re)creates ``iter_X.tmp``; the agreement on it (a barrier) lets no rank write
    before it exists, and makes a failure to create it every rank's one line."""
    ps, root = trainer.ps, trainer.cfg.checkpoint.save
    tmp = checkpoint_dir(trainer, step) + ".tmp"
    failure = None
    if ps.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            os.makedirs(tmp)
        except OSError as exc:
            failure = exc
    _agree(ps, failure, f"creating {tmp}")
    return tmp


def snapshot(trainer, step: int, tmp: str) -> Snapshot:
    """This rank's slices, per-rank state and (rank 0) the index metadata, as of this boundary.
    Tensors are views of the live state (the synchronous save writes them before training goes on;
    the background path copies them all to host memory, async_writer.py ``HostBuffers.take``,
    before the next step updates parameters, moments and residuals in place), and the summed
    error-feedback residuals, built here. ZeRO's parameter all-gathers still in flight are waited
    for first: no copy reads a half-gathered parameter."""
    trainer.params_ready()
    cfg, ps = trainer.cfg, trainer.ps
    shard = _Shard(f"rank_{ps.rank:05d}.safetensors")
    specs = param_specs(trainer.chunks, ps, cfg.model.vocab_size)
    owners = by_owner(specs)  # each parameter's logical tensors (a stacked one holds several)
    sharded = getattr(trainer.optimizer, "zero_stage", 0) == 3   # parameters only as shards
    for s in [*(() if sharded else specs), *buffer_specs(trainer.chunks, ps)]:
        if s.writer and first_replica(ps, s.param):
            shard.add(f"model/{s.name}", s, s.local(s.param.detach()))
    if sharded:  # ZeRO-3: every rank of the DP x CP (EDP) group its flat range, like the state
        for piece, values in trainer.optimizer.param_pieces():
            for s, flat, part in split_flat(owners[piece.name], piece.start, piece.end, values):
                if s.writer:
                    shard.add(f"model/{s.name}", s, part, flat)
    sd = trainer.optimizer.state_dict(clone=False)
    zero = sd["kind"] == "distributed"
    for piece in sd["pieces"]:
        for key, t in sd["state"][piece["name"]].items():
            for s, flat, part in split_flat(owners[piece["name"]], piece["start"], piece["end"], t):
                if s.writer and (zero or first_replica(ps, s.param)):
                    shard.add(f"optim/{key}/{s.name}", s, part, flat)
    # error-feedback residuals summed over the ranks that share them: any layout can take them up
    # (a collective: every rank builds them here, in the snapshot, on the main thread)
    # (and the compressors' momenta, as DP means: onebit's M, top-k's velocities)
    for kind, prefix in (("residual", "grad_residual"), ("momentum", "grad_momentum")):
        for name, _, a, b, t in logical_residual_pieces(trainer.reducer, ps, kind):
            for s, flat, part in split_flat(owners[name], a, b, t):
                if s.writer:
                    shard.add(f"optim/{prefix}/{s.name}", s, part, flat)
    own = {"rng/cpu": torch.get_rng_state()}
    if (dev_rng := device_rng(trainer.dev)) is not None:
        own["rng/device"] = dev_rng.cpu()
    if getattr(trainer, "rng", None) is not None:  # the dropout streams of each model chunk
        own.update(trainer.rng.state_tensors())
    red = trainer.reducer.state_dict()
    own.update({f"residual/{k}": v for k, v in red["residuals"].items()})
    c = ps.coord
    rank_json = {"rank": ps.rank, "coord": [c.tp, c.pp, c.dp], "file": shard.fname,
                 "tensors": shard.entries, "own": sorted(own),
                 "buckets": trainer.reducer.layout_digest()}
    meta = None
    if ps.rank == 0:
        meta = {"format": FORMAT, "step": step, "layout": layout_of(trainer),
                "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(cfg.model),
                "data": data_info(trainer), "sampler": {**trainer.sampler.state_dict(), "next_step": step},
                "scaler": dict(trainer.scaler.state_dict()), "reducer": {"step": red["step"],
                            "warmup_steps": red.get("warmup_steps")},
                "schedule_step": trainer.schedule_step,
                "optimizer": {"kind": sd["kind"], "step": sd["step"],
                              "variance_frozen": sd.get("variance_frozen", False)},
                "run": run_identity(trainer)}
    return Snapshot(step, tmp, checkpoint_dir(trainer, step), ps.rank, ps.world_size,
                    cfg.checkpoint.keep_last, shard.fname, {**shard.tensors, **own}, rank_json, meta)


def run_identity(trainer) -> dict:
    """Which job saved a checkpoint, and from what (the index's ``run``; engine/checkpoint/resume.py
    ``own_progress`` tells a restart of that job by it): ``job_id``, the launcher's identity of the
    job (parallel/grid/launch.py ``LaunchEnv.job_id``; None for a plain process), and ``load``, the
    real path of its --load (the saved config keeps it as typed, which may be relative)."""
    launch = getattr(trainer, "launch", None) or LaunchEnv.from_env()
    load = trainer.cfg.checkpoint.load
    return {"job_id": launch.job_id, "load": os.path.realpath(load) if load else None}


def write_files(snap: Snapshot, verify: bool = False) -> None:
    """Write this rank's safetensors file, then its JSON description, into ``snap.tmp``: file I/O
    only, no collective. ``verify`` re-reads the written file against its sha256 before the JSON
    (which rank 0 needs to publish) is written."""
    path = os.path.join(snap.tmp, snap.fname)
    info = write_shard(snap.tensors, path)
    if verify and (problem := file_damage(path, info)):
        raise CheckpointError(f"rank {snap.rank}: the file just written does not verify: {problem}")
    write_json(os.path.join(snap.tmp, f"rank_{snap.rank:05d}.json"), {**snap.rank_json, "file_info": info})


def before_publish(trainer, step: int, blocking_s: float | None = None,
                   ending: bool = False) -> None:
    """What must be on disk before checkpoint ``step`` becomes ``latest``: the trainer's
    ``before_publish`` (the metrics records of steps 1..step, written and fsynced), on every rank
    (completing a record may be a collective); ``blocking_s``: the boundary's time on this save so
    far; ``ending``: the run ends after this step (its last, or a stop). Nothing for a caller
    without one."""
    hook = getattr(trainer, "before_publish", None)
    if hook is not None:
        hook(step, blocking_s, ending)


def save_checkpoint(trainer, step: int, started: float | None = None, ending: bool = False) -> str:
    """Save synchronously: every rank returns once the checkpoint is published. ``started``: the
    ``time.perf_counter()`` at which the step boundary began working on it; ``ending``: the run
    ends after ``step`` (``before_publish``). A rank whose own part fails (creating the directory,
    writing its files, rank 0's publication: a full disk, a missing permission) tells the others
    at the agreement that follows it, and every rank raises the same CheckpointError naming it,
    instead of the others waiting at a barrier for the communication timeout."""
    ps = trainer.ps
    final = checkpoint_dir(trainer, step)
    if unchanged_since_load(trainer, step):
        return final  # nothing trained since this checkpoint was loaded
    started = time.perf_counter() if started is None else started
    tmp = prepare_dir(trainer, step)
    snap = snapshot(trainer, step, tmp)
    failure = None
    try:
        write_files(snap)
    except (CheckpointError, OSError) as exc:
        failure = exc
    _agree(ps, failure, f"writing the shards of {tmp}")
    before_publish(trainer, step, time.perf_counter() - started, ending)
    publish_agreed(ps, snap)
    return final


def publish_agreed(ps, snap: Snapshot) -> None:
    """Rank 0 publishes ``snap``; every rank then learns at one agreement (also the barrier)
    whether that failed, and all raise the same line if it did (``_agree``)."""
    failure = None
    if ps.rank == 0:
        try:
            publish(snap)
        except (CheckpointError, OSError) as exc:
            failure = exc
    _agree(ps, failure, f"publishing {snap.final}", f"{LATEST} names the newest checkpoint published")


def promote(tmp: str, final: str) -> None:
    """Make the complete directory ``tmp`` the checkpoint ``final`` and point ``latest`` at it,
    each by an atomic rename (a checkpoint already at ``final`` is swapped out first and removed
    last; a crash between those two renames leaves ``latest`` naming neither, and index.py
    ``resolve`` then takes the complete ``tmp``), then fsync the parent so the renames survive
    a crash."""
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


# what describes a tokenizer beside its tokenizer.json: special tokens, chat template, generation
TOKENIZER_SIBLINGS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                      "chat_template.json", "generation_config.json")


def copy_tokenizer(meta: dict, tmp: str) -> None:
    """The run's tokenizer.json into the checkpoint directory ``tmp``, with the files that describe
    it (TOKENIZER_SIBLINGS) from the first place holding the same tokenizer.json: the Hugging Face
    directory it was read from, the ``--load`` checkpoint (an imported model), the latest checkpoint
    in ``--save``."""
    data = meta["data"]
    shutil.copyfile(data["tokenizer_file"], os.path.join(tmp, "tokenizer.json"))
    places = [os.path.dirname(data["tokenizer_file"])]
    for root in (meta["config"]["checkpoint"]["load"], os.path.dirname(tmp)):
        try:
            if root:
                places.append(resolve(root))
        except CheckpointError:
            pass  # no checkpoint there (yet)
    for place in places:
        own = os.path.join(place, "tokenizer.json")
        if os.path.isfile(own) and sha256_file(own) == data["tokenizer_sha256"]:
            for name in TOKENIZER_SIBLINGS:
                if os.path.isfile(os.path.join(place, name)):
                    shutil.copyfile(os.path.join(place, name), os.path.join(tmp, name))
            return


def publish(snap: Snapshot) -> None:
    """Rank 0, once every rank's files are in ``snap.tmp``: merge the per-rank JSON into
    index.json, rename, repoint latest, prune (and drop what --overwrite moved aside)."""
    tmp, final = snap.tmp, snap.final
    tensors, files, ranks = {}, {}, {}
    for r in range(snap.world_size):
        path = os.path.join(tmp, f"rank_{r:05d}.json")
        with open(path, encoding="utf-8") as fh:
            part = json.load(fh)
        files[part["file"]] = part["file_info"]
        ranks[str(r)] = {"coord": part["coord"], "file": part["file"], "own": part["own"],
                         "buckets": part["buckets"]}
        for name, entry in part["tensors"].items():
            merged = tensors.setdefault(name, {**entry, "pieces": []})
            if merged["shape"] != entry["shape"]:
                raise CheckpointError(f"ranks disagree on the shape of {name}: {merged['shape']} "
                                      f"vs {entry['shape']} (rank {r})")
            merged["pieces"] += entry["pieces"]
        os.remove(path)
    meta = snap.index_meta
    if meta["data"]["tokenizer_sha256"]:
        copy_tokenizer(meta, tmp)
    write_json(os.path.join(tmp, INDEX_NAME), {**meta, "tensors": tensors, "files": files, "ranks": ranks})
    root = os.path.dirname(final)
    promote(tmp, final)
    load = meta["config"]["checkpoint"].get("load")
    # the checkpoints an --overwrite run moved aside (engine/checkpoint/resume.py) go once it has
    # published one of its own, unless this run continues them (its --load lies there)
    aside = os.path.join(root, ASIDE)
    if not (load and lies_within(load, aside)):
        shutil.rmtree(aside, ignore_errors=True)
    # --keep-last: the newest checkpoints up to this one stay (any after it are of a run this one
    # rolled back from: they are replaced as it saves those steps), and so does the one --load names
    kept = {os.path.realpath(final)} | ({os.path.realpath(load)} if load else set())
    for _, path in [(s, p) for s, p in list_checkpoints(root) if s <= snap.step][:-snap.keep_last]:
        if os.path.realpath(path) not in kept:
            shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):  # directories of saves that crashed before their rename
        if name.startswith("iter_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
