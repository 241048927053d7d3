"""The run's data on a built trainer: the dataset (the built-in corpus prepared once, by rank 0),
packing, the training sampler, micro-batches per step and this rank's context-parallel shard."""
from __future__ import annotations

import torch

from engine.base import ConfigError
from engine.data import build_data
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
                              progress=cfg.log.progress and ps.rank == 0)
        except (ValueError, FileNotFoundError) as exc:  # e.g. a corpus too small for --seq-length
            raise ConfigError(f"data: {exc}") from exc

    if ps.world_size > 1 and not cfg.data.mock_data and cfg.data.data_path is None:
        # rank 0 prepares and caches the built-in corpus once; its outcome reaches every rank,
        # so a failure there ends all ranks with the same message instead of a hang
        outcome = None
        if ps.rank == 0:
            try:
                trainer.data = build()
            except ConfigError as exc:
                outcome = str(exc)
        outcome = ps.world_group.broadcast_object(outcome, src=0)
        if outcome is not None:
            raise ConfigError(outcome)
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
