"""The run's data on a built trainer: the dataset (the built-in corpus prepared once, by rank 0),
packing, the training sampler, micro-batches per step and this rank's context-parallel shard; this
rank's micro-batches of a step, and the validation loss."""
from __future__ import annotations

import torch

from engine.base import ConfigError, os_error_text
from engine.data import build_data, collate
from engine.data.packing import MicroBatch, count_loss_tokens, micro_batch
from engine.training.validate import validate_packing
from parallel.context_parallel import load_balanced, shard_index


def build_run_data(trainer) -> None:
    """Set ``trainer.data``, ``packing``, ``sampler``, ``num_micro`` and ``cp_index``; a
    ConfigError (the same on every rank) for data that cannot serve the run."""
    cfg, ps = trainer.cfg, trainer.ps
    d = cfg.data
    given_vocab = d.mock_data or "vocab_size" in cfg.explicit  # else the data's vocabulary

    def build():
        try:
            return build_data(d.data_path, cfg.model.seq_length, cfg.seed, mock=d.mock_data,
                              vocab_size=cfg.model.vocab_size if given_vocab else None,
                              tokenizer=d.tokenizer, cache_dir=d.cache_dir, split=d.split,
                              tokenizer_model=d.tokenizer_model, tokenizer_type=d.tokenizer_type,
                              vocab_file=d.vocab_file, merge_file=d.merge_file,
                              progress=trainer.progress and ps.rank == 0)
        except (ValueError, FileNotFoundError) as exc:  # e.g. a corpus too small for --seq-length
            raise ConfigError(f"data: {exc}") from exc
        except OSError as exc:  # e.g. --cache-dir under a file, a .bin this user cannot read
            raise ConfigError(f"data: {os_error_text(exc)}; check the paths of --data-path, "
                              f"--cache-dir and the tokenizer files: data and tokenizer files "
                              f"readable, the cache a directory you can write to") from exc

    if ps.world_size > 1 and not cfg.data.mock_data and cfg.data.data_path is None:
        # rank 0 prepares and caches the built-in corpus once; its outcome reaches every rank,
        # so a failure there ends all ranks instead of leaving them waiting out the timeout: a
        # ConfigError (any bad input, an unreadable or unwritable path included) as the same
        # line on every rank; any other exception (a defect, not the user's input) as rank 0's
        # own traceback there and one line naming it on the others
        outcome, failure = None, None
        if ps.rank == 0:
            try:
                trainer.data = build()
            except ConfigError as exc:
                outcome = ("config", str(exc))
            except Exception as exc:
                failure, outcome = exc, ("error", f"{type(exc).__name__}: {exc}")
        outcome = ps.world_group.broadcast_object(outcome, src=0)
        if failure is not None:
            raise failure
        if outcome is not None:
            kind, text = outcome
            if kind == "config":
                raise ConfigError(text)
            raise RuntimeError(f"rank 0 failed to prepare the built-in corpus ({text}); its "
                               f"traceback is in rank 0's output")
        if ps.rank != 0:
            trainer.data = build()
    else:
        trainer.data = build()
    data = trainer.data
    cfg.model.vocab_size = data.vocab_size
    trainer.packing = validate_packing(cfg, getattr(data.train, "eot_id", None))
    trainer.sampler = data.sampler("train", cfg.data.global_batch_size, cfg.seed)
    if cfg.log.eval_interval and len(data.valid) == 0:
        raise ConfigError(f"--eval-interval {cfg.log.eval_interval} needs validation data, but "
                          f"--split {d.split} leaves none of {data.prefix}'s documents for "
                          f"it: give the validation split a weight or more documents, or drop "
                          f"--eval-interval")
    trainer.num_micro = cfg.data.num_microbatches(ps.dp_size)
    # context parallelism: the positions of every row this rank keeps (chunks r and 2cp-1-r
    # for the ring, the r-th contiguous shard for Ulysses)
    trainer.cp_index = None if ps.cp_size == 1 else torch.tensor(
        shard_index(cfg.model.seq_length, ps.cp_size, ps.cp_rank,
                    load_balanced(cfg.parallel.cp_comm_type)), dtype=torch.long)


def rank_batches(trainer, step: int, dataset=None, sampler=None,
                 loss_tokens: int | None = None) -> list[MicroBatch]:
    """This rank's micro-batches of ``step`` (``MicroBatch``: tokens, labels and, with packed
    documents, the per-token metadata every stage builds alike from the same tokens); under
    context parallelism this rank's sequence shard of each (global positions, the loss count of
    the whole global batch). ``loss_tokens``: that count (--eod-mask-loss) when the caller has it
    already."""
    sampler = sampler or trainer.sampler
    ds = dataset or trainer.data.train
    ps = trainer.ps
    micro = sampler.micro_batches(step, ps.dp_rank, ps.dp_size, trainer.cfg.data.micro_batch_size)
    pack = trainer.packing
    if loss_tokens is None and pack is not None and pack.eod_mask_loss and trainer.stepper.holds_loss:
        # the mean is over the unmasked tokens of the whole global batch, whatever the layout:
        # a sum over the dataset's per-sample table (built at the first step), no sample read
        loss_tokens = count_loss_tokens(ds, sampler.global_batch(step), pack.eod_id)
    batches = [micro_batch(collate(ds, idx), pack, loss_tokens) for idx in micro]  # (b, s) each
    if trainer.cp_index is not None:
        batches = [mb.select(trainer.cp_index) for mb in batches]  # (b, s/cp) each
    return [mb.to(trainer.dev.device) for mb in batches]


@torch.no_grad()
def validation_loss(trainer) -> float:
    """Validation loss over ``eval_iters`` global batches of the validation split: the mean over
    all their loss tokens, as training's loss is over one global batch's (with --eod-mask-loss
    each batch's mean weighted by its unmasked tokens, counted from the dataset's per-sample table
    on every rank alike; Megatron-LM pools its evaluation the same way)."""
    cfg, pack = trainer.cfg, trainer.packing
    trainer.params_ready()
    sampler = trainer.data.sampler("valid", cfg.data.global_batch_size, cfg.seed)
    for c in trainer.chunks:
        c.eval()
    total = tokens = 0.0
    for it in range(cfg.log.eval_iters):
        count = count_loss_tokens(trainer.data.valid, sampler.global_batch(it), pack.eod_id) \
            if pack is not None and pack.eod_mask_loss else None   # (once: the batches take it)
        loss = trainer.stepper.forward_only(rank_batches(trainer, it, trainer.data.valid, sampler,
                                                         count))
        count = 1 if count is None else count
        if count:   # a batch of end-of-document tokens only has no loss token to count
            total, tokens = total + loss * count, tokens + count
    for c in trainer.chunks:
        c.train()
    return total / tokens if tokens else float("nan")
