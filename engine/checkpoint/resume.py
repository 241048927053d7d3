"""Where a run starts: ``--load``, this run's own unfinished checkpoint in ``--save``, or nothing; and
whose checkpoints a ``--save`` directory may be given to.

A job that torchrun restarts passes the same flags again: with ``--save DIR`` alone it continues from
DIR's latest checkpoint by itself; with ``--load A --save B`` it continues from B's when that is newer
(a later step) than A's. That is only done for checkpoints of *this* run: the recipe the index stores
(``RECIPE``: model shape, data and tokenizer, global batch size, seed) equals this run's, and their
step is below this run's ``--train-iters`` (so a larger ``--train-iters`` continues a run; the
learning rate, layout and logging may change between attempts). Any other checkpoint in ``--save``
(another model or recipe, a run already at or past ``--train-iters``, an imported model) belongs to
another run: the run stops before training with one line naming the directory, what it holds and
the ways on (``--load`` it, a new ``--run-dir``/``--save``, or ``--overwrite``). With ``--overwrite``
rank 0 moves them into ``SAVE/overwritten/`` (itself a checkpoint directory: ``--load
SAVE/overwritten`` continues that run), with the run's metrics file, timeline and plot at the paths
this run writes (``metrics.jsonl``, ``timeline.json``, ``loss.png`` there), and the first checkpoint
this run publishes removes it (engine/checkpoint/writer.py ``publish``; not that of a run whose
``--load`` lies in it). Until then a ``--save`` whose
``overwritten/`` is still there is refused without ``--overwrite``, so nothing is lost to a crash.

A ``--load`` inside ``--save`` (one of its ``iter_*`` checkpoints, or its ``overwritten/``) names
that directory's own run: the run starts from what ``--load`` names (a rollback to an earlier step)
and nothing is moved aside, even with ``--overwrite``; only a restart of the same job (torchrun's
--max-restarts, a Slurm requeue: the same ``LaunchEnv.job_id``) continues from ``--save``'s latest
instead (``own_progress``), and never under ``--overwrite``. A new submission of the same command
rolls back again. ``--finetune`` there is refused (``_finetune_refusal``: its steps count from 0,
so its checkpoints would replace the loaded run's), unless ``--save``'s latest is this job's own
fine-tune progress: ``--load DIR --save DIR --finetune`` started on an empty DIR, restarted.

``plan_start`` decides from the configuration, the shared file system and the job identity (the
same in every process of a job) alone, so every rank reaches the same answer, before any collective
(engine/training/launch.py calls it before the process group exists; the trainer again when it
starts).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass


from engine.checkpoint.index import (ASIDE, INDEX_NAME, LATEST, CheckpointError, has_checkpoint,
                                     read_index, resolve, saved_step)
from engine.checkpoint.reader import load_checkpoint
from engine.checkpoint.writer import _barrier, lies_within
from parallel.grid.launch import LaunchEnv

# (config section, key) pairs that make two runs the same run; None: a RunConfig field
RECIPE = (("model", "block"), ("model", "num_layers"), ("model", "hidden_size"),
          ("model", "num_attention_heads"), ("model", "num_query_groups"), ("model", "ffn_hidden_size"),
          ("model", "max_position_embeddings"), ("model", "seq_length"), ("model", "qk_layernorm"),
          ("model", "num_experts"), ("model", "moe_layer_freq"), ("model", "moe_ffn_hidden_size"),
          ("model", "moe_shared_expert_intermediate_size"), ("data", "data_path"),
          ("data", "mock_data"), ("data", "tokenizer"), ("data", "tokenizer_model"),
          ("data", "tokenizer_type"), ("data", "vocab_file"), ("data", "merge_file"), ("data", "split"),
          ("data", "global_batch_size"), (None, "seed"))


@dataclass(frozen=True)
class Start:
    """How a run starts. ``source``: the checkpoint root to load (None: from scratch);
    ``resumed``: it is this run's own checkpoint in --save (loaded in full, even under --finetune);
    ``replace``: the --save directory whose checkpoints rank 0 moves aside first (--overwrite)."""
    source: str | None = None
    step: int | None = None
    resumed: bool = False
    replace: str | None = None
    held: str | None = None  # what ``replace`` holds, for the line rank 0 prints
    why: str = ""            # (``resumed``) why --save's checkpoint and not --load's, for that line


def _plain(value):
    """A value as it reads back from the index's JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def recipe_differences(index: dict, cfg) -> list[str]:
    """``--flag THERE there, HERE here`` for every RECIPE key where the checkpoint's run and ``cfg``
    differ (the vocabulary too when this run gives it: --mock-data or --vocab-size). Pure."""
    saved = index.get("config") if isinstance(index.get("config"), dict) else {}
    keys = list(RECIPE)
    if cfg.data.mock_data or "vocab_size" in cfg.explicit:
        keys.append(("model", "vocab_size"))
    out = []
    for section, key in keys:
        owner = getattr(cfg, section) if section else cfg
        here = _plain(getattr(owner, key))
        kept = saved.get(section) if section else saved
        # a key the run's saved section lacks (written before the field existed): its default
        there = kept.get(key, _default(owner, key)) if isinstance(kept, dict) and kept else None
        if section == "model" and key == "vocab_size":
            there = index["model"]["vocab_size"]
        if there != here:
            flag = "--" + key.replace("_", "-")
            out.append(f"{flag} {_text(there)} there, {_text(here)} here")
    return out


def _default(owner, key: str):
    """A field's default: what a checkpoint written before the field existed stands for."""
    f = type(owner).__dataclass_fields__[key]
    return _plain(f.default) if f.default is not dataclasses.MISSING else None


def _text(value) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return "unset" if value is None else str(value)


def describe(index: dict) -> str:
    """What a checkpoint holds, in one phrase: its step and model shape."""
    m = index["model"]
    what = f"step {index['step']}, {m['block']} layers={m['num_layers']} hidden={m['hidden_size']} " \
           f"heads={m['num_attention_heads']}"
    if m.get("num_experts"):
        what += f" experts={m['num_experts']} top-{m.get('moe_router_topk')}"
    return what + (", imported by engine.import_hf" if "source" in index else "")


def _save_flag(cfg) -> str:
    ck, run_dir = cfg.checkpoint, cfg.log.run_dir
    if run_dir and "save" not in cfg.explicit and \
            os.path.realpath(ck.save) == os.path.realpath(os.path.join(run_dir, "checkpoints")):
        return f"--run-dir {run_dir}: {ck.save}"
    return f"--save {ck.save}"


def _refusal(cfg, index: dict, differences: list[str]) -> CheckpointError:
    save, iters = cfg.checkpoint.save, cfg.optim.train_iters
    step = index["step"]
    shape = any(d.startswith(f"--{k.replace('_', '-')} ") for d in differences
                for section, k in RECIPE if section == "model")
    if "source" in index:  # a step-0 import: its shape comes with --use-checkpoint-args
        what, cont = describe(index), f"--load {save} --use-checkpoint-args to train from it"
    else:
        shown = "; ".join(differences[:3]) + (f"; and {len(differences) - 3} more"
                                              if len(differences) > 3 else "")
        why = f"another recipe: {shown}" if differences else \
            f"a finished run: step {step}, and this run's --train-iters is {iters}"
        what = f"{describe(index)}; {why}"
        cont = f"--load {save}" + (" --use-checkpoint-args" if shape else "") + " to continue it" + \
            (f" (with a --train-iters above {step})" if step >= iters else "")
    return CheckpointError(
        f"{_save_flag(cfg)} holds the checkpoints of another run ({what}): pass {cont}, give this "
        f"run a new --run-dir or --save, or add --overwrite to replace them (they are moved to "
        f"{os.path.join(save, ASIDE)} and deleted once this run's first checkpoint is saved)")


def _aside_refusal(cfg) -> CheckpointError:
    aside = os.path.join(cfg.checkpoint.save, ASIDE)
    try:
        what = describe(read_index(resolve(aside), hint=False))
    except CheckpointError:
        what = "checkpoints"
    return CheckpointError(
        f"{_save_flag(cfg)}: {aside} holds the checkpoints ({what}) that an --overwrite run moved "
        f"aside and that no checkpoint of it has replaced yet: pass --load {aside} to continue "
        f"them, move them back into {cfg.checkpoint.save}, give this run a new --run-dir or --save, "
        f"or add --overwrite to replace them")


def own_progress(index: dict, cfg, job: str | None) -> bool:
    """Whether checkpoint ``index`` is the progress of an earlier attempt of this very job of a
    ``--load`` inside (or equal to) its ``--save``: saved by the same job (``job``, the launcher's
    identity of this one, parallel/grid/launch.py ``LaunchEnv.job_id``: a restart by torchrun or a
    Slurm requeue keeps it, a new submission does not; None, a plain process that no launcher
    restarts, never matches), given the same ``--load`` (by real path, as the index records it:
    writer.py ``run_identity``) and ``--finetune``, of this run's recipe, past step 0 and below
    this run's ``--train-iters``. Pure."""
    saved = index.get("config") if isinstance(index.get("config"), dict) else {}
    ck = saved.get("checkpoint") if isinstance(saved.get("checkpoint"), dict) else {}
    run = index.get("run") if isinstance(index.get("run"), dict) else {}
    return bool(job) and run.get("job_id") == job and isinstance(run.get("load"), str) and \
        run["load"] == os.path.realpath(cfg.checkpoint.load) and \
        bool(ck.get("finetune")) == bool(cfg.checkpoint.finetune) and \
        0 < index["step"] < cfg.optim.train_iters and not recipe_differences(index, cfg)


def _finetune_refusal(cfg) -> CheckpointError:
    ck = cfg.checkpoint
    where = "is" if os.path.realpath(ck.load) == os.path.realpath(ck.save) else "lies in"
    return CheckpointError(
        f"--finetune with --load {ck.load}, which {where} {_save_flag(cfg)}: a fine-tune counts its "
        f"steps from 0, so its checkpoints would replace the loaded run's (and {LATEST}), the one "
        f"--load names included; give the fine-tune its own --save (--load {ck.load} --save "
        f"FINETUNE_DIR --finetune)")


def _continuing(cfg, same: bool, job: str | None) -> Start:
    """A ``--load`` that names ``--save`` itself (``same``) or a checkpoint inside it: what
    ``--load`` names, unless ``--save``'s latest is this job's own progress since that load (a
    restart; checked for ``same`` only under --finetune: without it, ``--load DIR`` already is DIR's
    latest, loaded in full; never under --overwrite, which forces the start from --load). A
    --finetune is refused unless it continues its own progress (``_finetune_refusal``)."""
    ck = cfg.checkpoint
    if (not same or ck.finetune) and not ck.overwrite:
        try:
            index = read_index(resolve(ck.save), hint=False)
        except CheckpointError:  # a damaged latest is no progress to continue (--load may be intact)
            index = None
        if index is not None and own_progress(index, cfg, job):
            return Start(source=ck.save, step=index["step"], resumed=True,
                         why=f": this job's own progress since --load {ck.load}")
    if ck.finetune:
        raise _finetune_refusal(cfg)
    return Start(source=ck.load, step=saved_step(ck.load))


def plan_start(cfg, launch: LaunchEnv | None = None) -> Start:
    """How the run of ``cfg`` starts, or a CheckpointError when its --save holds another run's
    checkpoints (see the module's docstring). ``launch``: this process's (the environment's when
    None), for its job identity. Pure: reads the configuration, the environment and the shared
    file system, changes nothing."""
    ck = cfg.checkpoint
    job = (launch or LaunchEnv.from_env()).job_id
    save, load = ck.save, ck.load
    aside = bool(save) and os.path.isdir(os.path.join(save, ASIDE))
    same = bool(load) and bool(save) and os.path.realpath(load) == os.path.realpath(save)
    inside = bool(load) and bool(save) and not same and lies_within(load, save)
    if not save or not has_checkpoint(save):
        if inside and ck.finetune:  # (--load SAVE/overwritten: its saves beside what it loads)
            raise _finetune_refusal(cfg)
        # (--load SAVE/overwritten is the refusal's own way on: it continues them)
        if aside and not ck.overwrite and not (inside and lies_within(load, os.path.join(save, ASIDE))):
            raise _aside_refusal(cfg)
        if same:  # --load DIR --save DIR on an empty DIR (Megatron-LM's first run) starts afresh
            return Start()
        return Start(source=load, step=saved_step(load) if load else None)
    if same or inside:  # the directory's own run: what --load names, or this job's progress since
        return _continuing(cfg, same, job)
    if os.path.isfile(os.path.join(save, INDEX_NAME)):
        raise CheckpointError(f"{_save_flag(cfg)} is one checkpoint (it holds {INDEX_NAME}), not a "
                              f"directory of them: save into {os.path.dirname(os.path.abspath(save))} "
                              f"or a new directory (and --load {save} to start from it)")
    index = read_index(resolve(save))  # a damaged --save is named, never silently replaced
    step, differences = index["step"], recipe_differences(index, cfg)
    if not differences and step < cfg.optim.train_iters:  # this run's own, unfinished
        if not load:
            return Start(source=save, step=step, resumed=True)
        given = saved_step(load)
        # under --finetune steps count from 0 again: any saved progress is newer than --load
        if given is None or step > given or (ck.finetune and step > 0):
            return Start(source=save, step=step, resumed=True, why=f", newer than --load {load}")
        return Start(source=load, step=given)
    if not ck.overwrite:
        raise _refusal(cfg, index, differences)
    return Start(source=load, step=saved_step(load) if load else None, replace=save,
                 held=describe(index))


# the run's other outputs that move aside with its checkpoints, under these names
OUTPUTS = (("metrics_file", "metrics.jsonl"), ("timeline", "timeline.json"), ("plot", "loss.png"))


def run_outputs(cfg) -> list[tuple[str, str]]:
    """(name in the aside directory, path) of the metrics file, timeline and plot the run writes."""
    return [(name, getattr(cfg.log, key)) for key, name in OUTPUTS if getattr(cfg.log, key)]


def move_aside(save: str, outputs: list[tuple[str, str]] = ()) -> tuple[str, list[str]]:
    """Move ``save``'s checkpoints (``latest`` and every ``iter_*``) into ``save/overwritten``, by
    renames inside ``save``, and the replaced run's ``outputs`` (its metrics, timeline and plot,
    which the new run would replace at once) beside them; returns that directory and the names of
    the outputs moved. A leftover ``overwritten`` is a replaced run's whose replacement has saved
    since (``publish`` removes it then): it is removed first."""
    aside = os.path.join(save, ASIDE)
    shutil.rmtree(aside, ignore_errors=True)
    os.makedirs(aside)
    for name in sorted(os.listdir(save)):
        if name == LATEST or name.startswith("iter_"):
            os.rename(os.path.join(save, name), os.path.join(aside, name))
    moved, parents = [], {save, aside}
    for name, path in outputs:
        if os.path.isfile(path):
            shutil.move(path, os.path.join(aside, name))  # a rename on one file system
            moved.append(name)
            parents.add(os.path.dirname(os.path.abspath(path)))
    for parent in sorted(parents):  # the renames survive a crash
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return aside, moved


def resume(trainer) -> int:
    """Carry out ``plan_start`` on a built trainer: move another run's checkpoints aside
    (--overwrite; rank 0, once every rank has decided), then load. Returns the step to continue from."""
    cfg, main = trainer.cfg, trainer.is_main
    start = plan_start(cfg, getattr(trainer, "launch", None))
    if start.replace:
        _barrier(trainer.ps, f"before moving the checkpoints in {start.replace} aside")
        if main:
            aside, moved = move_aside(start.replace, run_outputs(cfg))
            also = f" and its {', '.join(moved)}" if moved else ""
            print(f"gridtron: --overwrite: moved the checkpoints in {start.replace} ({start.held})"
                  f"{also} to {aside}; they are deleted once this run's first checkpoint is saved "
                  f"(until then --load {aside} continues that run)", flush=True)
    if start.source is None:
        return 0
    if start.resumed:
        if main:
            print(f"gridtron: resuming from {start.source} (step {start.step})"
                  + (start.why or "; pass --load to choose another checkpoint"), flush=True)
        return load_checkpoint(trainer, start.source, weights_only=False)
    step = load_checkpoint(trainer, start.source)
    if main:
        only = f" (weights only: training starts at step {step})" if start.step != step else ""
        print(f"gridtron: loaded {trainer.loaded_checkpoint} at step {start.step}{only}", flush=True)
    return step

