"""Loading: verify the files (each rank hashes a share, the verdict is all-reduced), check the run's
model shape and vocabulary against the checkpoint's, and read into each rank only the boxes of the
global tensors its own shards cover, so a checkpoint saved under one layout loads under any other.

``--finetune`` reads the model weights only (step 0, fresh optimizer, sampler and random states);
``--no-load-optim`` and ``--no-load-rng`` leave out those parts; ``--use-checkpoint-args`` takes the
model shape from the checkpoint. A checkpoint of step 0 (``python -m engine.import_hf``) holds only
weights, and loads like ``--finetune``."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from safetensors import safe_open

from engine.base import ConfigError
from engine.config.fp8 import check_fp8_flags
from engine.checkpoint.index import (CheckpointError, intact_hint, is_weight_key, read_index,
                                     resolve, verify)
from engine.checkpoint.tensor_reader import TensorReader
from engine.checkpoint.specs import (LAYOUT_KEYS, ParamSpec, buffer_specs, by_owner, data_info,
                                     layout_of, param_specs, read_flat, saved_layout)
from models.moe.config import moe_layer_pattern
from models.registry import BlockRegistry, default_registry
from parallel.dp.residuals import fold_logical_residuals


# the run's choices, not the shape (the experts' kernel too: checkpoints do not depend on it)
MODEL_SHAPE_SKIP = ("seq_length", "vocab_size", "dropout", "attention_dropout", "seed",
                    "moe_grouped_gemm")
# training choices of MoE layers: the checkpoint's under --use-checkpoint-args unless this run sets them
MODEL_RUN_CHOICES = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type",
                     "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
                     "moe_token_dispatcher_type", "moe_router_bias_update_rate")


def with_checkpoint_args(cfg):
    """``cfg`` with the model shape of the checkpoint at --load (pure: a JSON read)."""
    try:
        index = read_index(resolve(cfg.checkpoint.load))
    except CheckpointError as exc:
        raise ConfigError(f"--use-checkpoint-args: {exc}") from exc
    saved = index["model"]
    known = {f.name for f in dataclasses.fields(cfg.model)}
    shape = {k: v for k, v in saved.items() if k in known and k not in MODEL_SHAPE_SKIP
             and not (k in MODEL_RUN_CHOICES and k in cfg.explicit)}
    for key, value in shape.items():  # a size the user set that the checkpoint contradicts
        if key in cfg.explicit and getattr(cfg.model, key) != value:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"--use-checkpoint-args takes {flag} {value} from the checkpoint "
                              f"{cfg.checkpoint.load}, but {flag} {getattr(cfg.model, key)} was given: "
                              f"drop {flag} (or --use-checkpoint-args to choose the model shape "
                              f"yourself)")
    if "max_position_embeddings" in shape and cfg.model.seq_length > shape["max_position_embeddings"]:
        raise ConfigError(f"--seq-length {cfg.model.seq_length} is longer than the checkpoint's position "
                          f"table ({shape['max_position_embeddings']}); use a shorter --seq-length")
    try:
        out = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--use-checkpoint-args: {exc}") from exc
    try:   # what needs the model's shape: FP8's bf16 layers and blockwise tiles
        check_fp8_flags(out, model_known=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return out


# what a checkpoint written before a field existed holds in its place
SHAPE_DEFAULTS = {"num_experts": None, "moe_ffn_hidden_size": None,
                  "moe_shared_expert_intermediate_size": None, "moe_layer_freq": "1"}


def _setting(flag: str, value, given: str, absent: str) -> str:
    """``GIVEN --flag VALUE``, or ``ABSENT --flag`` and what that means for the model."""
    if value is not None:
        return f"{given} {flag} {value}"
    return f"{absent} {flag}" + (" (a dense model)" if flag == "--num-experts" else "")


def model_differences(saved: dict, model) -> list[tuple[str, object, object]]:
    """(flag, the checkpoint's value, this run's) for every field of the model's shape that
    differs: layers, widths, heads and key/value groups, and the mixture of experts (experts,
    which layers hold them, their widths). Pure."""
    keys = ["block", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
            "ffn_hidden_size", "num_experts"]
    if model.num_experts is not None and saved.get("num_experts") is not None:
        keys += ["moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"]
    out = []
    for key in keys:
        there = saved.get(key, saved["num_attention_heads"] if key == "num_query_groups" else
                          SHAPE_DEFAULTS.get(key))
        if there != getattr(model, key):
            out.append(("--" + key.replace("_", "-"), there, getattr(model, key)))
    if not out and model.num_experts is not None:  # the same layers, the same experts
        freq = saved.get("moe_layer_freq", "1")
        there = [i for i, moe in enumerate(moe_layer_pattern(freq, saved["num_layers"])) if moe]
        here = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
        if here != there:
            out.append(("--moe-layer-freq", f"{freq} (MoE layers {there})",
                        f"{model.moe_layer_freq} (MoE layers {here})"))
    return out


# what the model computes beyond its shape: a run may change one only by giving it (fine-tuning
# with another RoPE base, say); a default that differs from the checkpoint's is refused
MODEL_FUNCTION = ("norm_eps", "rope_base", "moe_router_topk", "moe_router_score_function",
                  "moe_router_pre_softmax", "moe_router_enable_expert_bias")


def function_differences(saved: dict, model, explicit,
                         registry: BlockRegistry | None = None) -> list[tuple[str, object, object]]:
    """(flag, the checkpoint's value, this run's) for every field of ``MODEL_FUNCTION`` that this
    run leaves at its default and that differs from the checkpoint's (the RoPE base only for a
    rotary block of the run's ``registry``, the router's fields only for a model with experts)."""
    keys = ["norm_eps"]
    try:
        rotary = (registry or default_registry()).resolve(model.block).position == "rope"
    except ValueError:   # a block this run cannot resolve is refused elsewhere
        rotary = False
    keys += ["rope_base"] if rotary else []
    keys += list(MODEL_FUNCTION[2:]) if model.num_experts is not None else []
    defaults = {f.name: f.default for f in dataclasses.fields(model)}
    return [("--" + key.replace("_", "-"), saved.get(key, defaults[key]), getattr(model, key))
            for key in keys if key not in explicit
            and saved.get(key, defaults[key]) != getattr(model, key)]


def check_compatible(index: dict, cfg, data: dict, where: str,
                     registry: BlockRegistry | None = None) -> None:
    """The run's model shape and vocabulary must be the checkpoint's (pure: same on every rank);
    so must what the model computes (``MODEL_FUNCTION``) unless this run sets it."""
    saved, model = index["model"], cfg.model
    differences = model_differences(saved, model)
    if "model/embedding.position" in index["tensors"] and \
            saved["max_position_embeddings"] != model.max_position_embeddings:
        differences.append(("--max-position-embeddings", saved["max_position_embeddings"],
                            model.max_position_embeddings))
    if differences:
        flag, there, here = differences[0]
        more = f" (and {len(differences) - 1} more: " + ", ".join(
            f"{f} {t} there, {h} here" for f, t, h in differences[1:]) + ")" if differences[1:] else ""
        raise CheckpointError(f"checkpoint {where} was saved {_setting(flag, there, 'with', 'without')} "
                              f"but this run has {_setting(flag, here, '', 'no').strip()}{more}: "
                              f"use the checkpoint's model shape (--use-checkpoint-args) or start "
                              f"without --load")
    if (changed := function_differences(saved, model, cfg.explicit, registry)):
        theirs = " and ".join(f"{f} {t}" for f, t, _ in changed)
        ours = " and ".join(str(h) for _, _, h in changed)
        one = len(changed) == 1
        raise CheckpointError(f"checkpoint {where} was saved with {theirs}, where this run has "
                              f"{'its default' if one else 'the defaults'} {ours}: give the "
                              f"checkpoint's {'value' if one else 'values'} (or "
                              f"--use-checkpoint-args), or set {'it' if one else 'them'} yourself "
                              f"to change {'it' if one else 'them'}")
    if saved.get("qk_layernorm", False) != model.qk_layernorm:  # else its norms would be skipped
        given = "with --qk-layernorm, this run without" if saved.get("qk_layernorm", False) else \
            "without --qk-layernorm, this run with it"
        raise CheckpointError(f"checkpoint {where} was saved {given}: use the checkpoint's model "
                              f"shape (--use-checkpoint-args) or start without --load")
    was, now = index["data"], data
    describe = lambda d: "mock data" if d["mock"] else f"tokenizer {d['tokenizer']}" + (
        f" ({d['prefix']})" if d["prefix"] else "")
    named = was["tokenizer"] is not None or was["mock"]  # an import without tokenizer names none
    if was["vocab_size"] != now["vocab_size"] or (named and was["tokenizer"] != now["tokenizer"]) or (
            was["tokenizer_sha256"] and now["tokenizer_sha256"]
            and was["tokenizer_sha256"] != now["tokenizer_sha256"]):
        if was["mock"]:
            fix = f"--mock-data --vocab-size {was['vocab_size']}"
        elif was["prefix"] is None:  # imported from Hugging Face: its data is the model's tokenizer's
            fix = "data prepared with the model's own tokenizer: python -m engine.data prepare " \
                  "--tokenizer-model <the Hugging Face model's directory>"
        else:
            fix = f"--data-path {was['prefix']}, or data prepared with python -m engine.data " \
                  f"prepare --tokenizer {was['prefix']}"
        raise CheckpointError(
            f"checkpoint {where} was trained on a {was['vocab_size']}-token vocabulary from "
            f"{describe(was)}, but this run's data has {now['vocab_size']} tokens from {describe(now)}: "
            f"train on the checkpoint's data ({fix}) or start without --load")


def _verify_shared(ps, ckpt: str, index: dict, keys=None) -> None:
    """Each rank checks every world_size-th file (``keys``: only those tensors, index.py
    ``file_damage``); an all-reduce shares the verdict."""
    names = sorted(index["files"])
    mine = names[ps.rank::ps.world_size] if dist.is_initialized() else names
    bad = {n for n in mine if verify(ckpt, index, [n], keys)}
    if dist.is_initialized() and ps.world_size > 1:
        flags = torch.tensor([n in bad for n in names], dtype=torch.int32, device=ps.device)
        ps.world_group.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad = {n for n, f in zip(names, flags.tolist()) if f}
    if bad:
        problems = verify(ckpt, index, sorted(bad), keys)
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems)
                              + intact_hint(os.path.dirname(ckpt), exclude=ckpt))


def load_buffers(specs: list[ParamSpec], reader: TensorReader) -> None:
    """The saved buffers (MoE expert biases); one the checkpoint lacks stays as built (zero: an
    imported or older checkpoint has no bias yet)."""
    for s in specs:
        if f"model/{s.name}" in reader:
            t = reader.read(f"model/{s.name}", s.offsets, list(s.param.shape), dtype=s.param.dtype)
            s.param.copy_(t.to(s.param.device))


def load_model_params(specs: list[ParamSpec], reader: TensorReader, optimizer=None) -> None:
    """Every parameter's box from the checkpoint; with a ZeRO-3 ``optimizer`` (the parameters
    exist only as shards) this rank's flat range of each, into its shard."""
    for s in specs:
        name = f"model/{s.name}"
        if name not in reader:
            raise CheckpointError(f"checkpoint {reader.ckpt} has no tensor {s.name}: it was saved from "
                                  f"a different model (block or layer count)")
        saved = reader.index["tensors"][name]["shape"]
        if saved != s.global_shape:
            raise CheckpointError(f"checkpoint {reader.ckpt}: {s.name} has shape {saved} but this model "
                                  f"needs {s.global_shape}; use the checkpoint's model configuration")
        if optimizer is None:
            t = reader.read(name, s.offsets, list(s.shape), dtype=s.param.dtype)
            with torch.no_grad():
                s.local(s.param).copy_(t.to(s.param.device))
    if optimizer is None:
        return
    owners = by_owner(specs)

    def read(s, flat):
        return reader.read(f"model/{s.name}", s.offsets, list(s.shape), flat=flat or (0, s.numel),
                           dtype=s.param.dtype)

    with torch.no_grad():
        for piece, values in optimizer.param_pieces():
            values.copy_(read_flat(owners[piece.name], piece.start, piece.end, read))


class StateReader(Mapping):
    """The optimizer state a rank loads, {name: {"exp_avg", "exp_avg_sq", "master": flat host
    tensor}}, read from the files when the optimizer asks for a parameter and not kept: one
    parameter's state in host memory at a time, each copied straight into its home (the device,
    or the offload's host memory), never the whole state at once (an offloaded 8B model's is
    89.8 GiB, most of its host's memory). ``ranges``: name -> the [start, end) elements this rank
    holds; ``read(name, start, end, key)``: those elements of ``optim/<key>``, or None."""

    def __init__(self, ranges: dict, read):
        self.ranges, self.read = ranges, read

    def __contains__(self, name) -> bool:   # (Mapping's own would read the state to answer)
        return name in self.ranges

    def __getitem__(self, name: str) -> dict:
        a, b = self.ranges[name]
        found = {key: self.read(name, a, b, key) for key in ("exp_avg", "exp_avg_sq", "master")}
        return {key: t for key, t in found.items() if t is not None}

    def __iter__(self):
        return iter(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)


def load_checkpoint(trainer, load_dir: str, weights_only: bool | None = None) -> int:
    """Restore everything into a built trainer; return the step to continue from.
    ``weights_only`` (default: --finetune) loads the model weights alone and starts at step 0;
    resuming this run's own checkpoint passes False.

    Past the shared verification each rank reads its own part with no collective in between
    (``_read_own``); a rank that fails there (a tensor its shard needs missing, a file it cannot
    read) tells the others in one all-gather before anything else is exchanged, and every rank
    raises the same one line naming it, instead of the others running on into the next collective
    and waiting there for the communication timeout. The residuals of another layout are folded
    (collectives) after that agreement."""
    cfg, ps = trainer.cfg, trainer.ps
    ck = cfg.checkpoint
    weights_only = ck.finetune if weights_only is None else weights_only
    ckpt = resolve(load_dir)
    index = read_index(ckpt)
    check_compatible(index, cfg, data_info(trainer), ckpt, getattr(trainer, "registry", None))
    step = index["step"]
    if step >= cfg.optim.train_iters and not weights_only and \
            os.path.realpath(load_dir) == os.path.realpath(ck.load or ""):
        raise CheckpointError(f"checkpoint {ckpt} is at step {step} and --train-iters is "
                              f"{cfg.optim.train_iters}: nothing to train. --train-iters counts all "
                              f"steps; pass one above {step} to continue (or --finetune to restart "
                              f"from step 0 with these weights)")
    # the weights alone (a fine-tune, an imported model): their bytes are what is read and checked
    _verify_shared(ps, ckpt, index, is_weight_key if weights_only or step == 0 else None)
    failure, fold = None, None
    try:
        fold = _read_own(trainer, ckpt, index, weights_only)
    except (CheckpointError, OSError) as exc:
        failure = exc if isinstance(exc, CheckpointError) else CheckpointError(
            f"checkpoint {ckpt}: {type(exc).__name__}: {exc}")
    _agree_on_failure(ps, failure)
    if fold is not None:
        fold()
    step = 0 if weights_only or step == 0 else step
    trainer.loaded_checkpoint, trainer.loaded_step = ckpt, step
    return step


def _agree_on_failure(ps, failure: CheckpointError | None) -> None:
    """Every rank learns whether any rank's own read failed; all raise the first failure's line,
    naming its rank (one all-gather of the failures' lines; nothing on a single process)."""
    if not (dist.is_initialized() and ps.world_size > 1):
        if failure is not None:
            raise failure
        return
    failed = ps.world_group.failures(None if failure is None else str(failure))
    if failed:
        rank, line = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise CheckpointError(f"rank {rank}{others}: {line}")


def _read_own(trainer, ckpt: str, index: dict, weights_only: bool):
    """This rank's part of the checkpoint into the trainer (weights, buffers, optimizer state,
    sampler, scaler, per-rank state), reading files only: no collective. Returns the residual
    folding to run once every rank has read (collectives; None when there is nothing to fold)."""
    cfg, ps = trainer.cfg, trainer.ps
    ck = cfg.checkpoint
    step = index["step"]
    if not (weights_only or step == 0):   # the sampler first: its refusals (another --seed,
        try:                              # other data) before any tensor is read
            trainer.sampler.load_state_dict(index["sampler"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {ckpt}: {exc}") from exc
    reader = TensorReader(ckpt, index)
    specs = param_specs(trainer.chunks, ps, cfg.model.vocab_size)
    trainer.params_ready()  # (ZeRO-3: nothing gathered while its shards change)
    sharded = getattr(trainer.optimizer, "zero_stage", 0) == 3
    load_model_params(specs, reader, trainer.optimizer if sharded else None)
    load_buffers(buffer_specs(trainer.chunks, ps), reader)
    if weights_only or step == 0:  # weights only: the run starts at step 0 with fresh state
        trainer.optimizer.load_state_dict({"step": 0, "pieces": [], "state": {}})
        return None
    if not ck.load_optim:
        trainer.optimizer.load_state_dict({"step": 0, "pieces": [], "state": {}})
    owners = by_owner(specs)  # each parameter's logical tensors (a stacked one holds several)

    def flat_reader(key):
        def read(s, flat):
            name = f"{key}/{s.name}"
            if name not in reader:
                return None
            return reader.read(name, s.offsets, list(s.shape), flat=flat or (0, s.numel))
        return read

    current = trainer.optimizer.state_dict(clone=False)   # (its piece list; nothing copied)
    pieces = [{"name": p["name"], "start": p["start"], "end": p["end"]}
              for p in (current["pieces"] if ck.load_optim else [])]
    state = StateReader({p["name"]: (p["start"], p["end"]) for p in pieces},
                        lambda name, a, b, key: read_flat(owners[name], a, b,
                                                          flat_reader(f"optim/{key}")))
    try:
        if ck.load_optim:
            trainer.optimizer.load_state_dict({
                "step": index["optimizer"]["step"], "pieces": pieces, "state": state,
                "variance_frozen": index["optimizer"].get("variance_frozen", False)})
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: {exc}") from exc
    trainer.sampler.next_step = step
    # (a checkpoint written before the schedule counted applied updates: the step count it ran by)
    trainer.schedule_step = index.get("schedule_step", step)
    layout = saved_layout(index)
    if layout["precision"] == cfg.precision.precision:
        trainer.scaler.load_state_dict(index["scaler"])
    same = all(layout.get(k) == layout_of(trainer)[k]
               for k in LAYOUT_KEYS + ("compression", "use_distributed_optimizer"))
    own, residuals_as_saved = {}, same
    if same:  # per-rank state only means something on the same rank of the same layout
        rank = index["ranks"][str(ps.rank)]
        with safe_open(os.path.join(ckpt, rank["file"]), framework="pt") as fh:
            own = {k: fh.get_tensor(k) for k in rank["own"]}
        # the residuals also follow the buckets (--bucket-size-mb, --sequence-parallel): on
        # others they are folded from their logical tensors, as under another layout (a
        # checkpoint without the digest was written before it: its buckets are taken as saved)
        residuals_as_saved = rank.get("buckets") in (None, trainer.reducer.layout_digest())
        if ck.load_rng:
            torch.set_rng_state(own["rng/cpu"])
        if ck.load_rng and "rng/device" in own and trainer.dev.type != "cpu":
            trainer.dev.set_rng_state(own["rng/device"])
        if ck.load_rng and getattr(trainer, "rng", None) is not None:   # the dropout streams
            trainer.rng.load_state_tensors(own)
    elif ck.load_rng and getattr(trainer, "rng", None) is not None:  # no per-rank state: the
        trainer.rng.restart_at(step)  # streams from the loaded step, not repeating steps 1, 2, ...
    if not ck.load_optim:
        # fresh AdamW moments: the compression warm-up starts again too (its uncompressed steps
        # build the second moment that the frozen-variance update divides by; kept at the saved
        # step, the next update divided by eps)
        return None
    # (a checkpoint written before skipped steps left the compression warm-up uncounted holds a
    # step that counted them: the applied updates + 1 bound it, GradReducer.step_skipped)
    try:
        trainer.reducer.load_state_dict({
            "step": min(index["reducer"]["step"], trainer.schedule_step + 1),
            "warmup_steps": index["reducer"].get("warmup_steps"),
            "residuals": {k[len("residual/"):]: v.to(ps.device) for k, v in own.items()
                          if residuals_as_saved and k.startswith("residual/")}})
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: the gradient compression state cannot be "
                              f"restored ({exc}): resume with the saved --bucket-size-mb and "
                              f"--sequence-parallel") from exc
    if residuals_as_saved:
        return None

    def reading(prefix):   # another layout: each rank takes an equal share of the summed residuals
        def read(name, param):
            parts = owners[name]
            t = read_flat(parts, 0, param.numel(), flat_reader(f"optim/{prefix}"))
            return None if t is None else t.view(param.shape).to(ps.device)
        return read

    def fold():
        fold_logical_residuals(trainer.reducer, ps, reading("grad_residual"))
        fold_logical_residuals(trainer.reducer, ps, reading("grad_momentum"), kind="momentum")
    return fold
