"""The trainer's loss scaler, gradient reducer and optimizer, by the run's data-parallel sharding
strategy (engine/config/sharding.py) and optimizer offload (docs/data_parallel.md).

- no_shard: ``MixedPrecisionOptimizer`` (torch's AdamW on fp32 masters);
- optim / optim_grads: ``DistributedOptimizer`` at ZeRO-1 / ZeRO-2, the parameter all-gather per
  bucket waited for at block boundaries (``--overlap-param-gather``);
- optim_grads_params: ZeRO-3; the reducer's buckets end at the gather units and hold no flat
  gradient buffer, the parameters become 1/dp shards on the device (the model was built on the
  host when the device is an accelerator, so it never exists whole there: ``host_build``), each
  unit gathered ahead of it and freed after it (parallel/dp/zero3_units.py);
- ``--optimizer-cpu-offload``: the distributed optimizer's masters and moments (a fraction of
  them) in host memory (parallel/dp/offload.py).
"""
from __future__ import annotations

import torch

from engine.training.loss_scaler import ConstantScaler, DynamicLossScaler
from parallel.dp import (CompressionPolicy, DistributedOptimizer, GradReducer,
                         MixedPrecisionOptimizer, memory_bytes)
from parallel.dp.zero3 import move_buffers
from parallel.dp.zero3_units import unit_index


def zero3(cfg) -> bool:
    return cfg.parallel.use_distributed_optimizer and cfg.parallel.zero_stage == 3


def host_build(cfg, device) -> bool:
    """Whether the model chunks are built in host memory and only their shards go to ``device``
    (ZeRO-3 on an accelerator)."""
    return zero3(cfg) and torch.device(device).type not in ("cpu", "meta")


def decays(name: str, param) -> bool:
    """Whether AdamW's weight decay applies to the parameter of logical ``name``: matrices, not
    biases (the MoE experts' biases too, stacked (experts, width) per layer), norms or position
    tables (Megatron-LM decays neither biases nor norms)."""
    return param.ndim >= 2 and not name.endswith("bias") and "position" not in name


def build_optimizer(trainer) -> None:
    """``trainer.scaler``, ``.reducer``, ``.optimizer`` and ``.memory`` (the exact bytes of this
    rank's parameters, gradients and optimizer state, parallel/dp/memory.py)."""
    cfg, ps, chunks = trainer.cfg, trainer.ps, trainer.chunks
    p, o, par = cfg.precision, cfg.optim, cfg.parallel
    trainer.scaler = (DynamicLossScaler(p.initial_loss_scale, 2.0, 0.5, p.loss_scale_window,
                                        p.hysteresis, p.min_loss_scale)
                      if p.precision == "fp16" else ConstantScaler(1.0))
    named = [(n, q) for c in chunks for n, q in c.logical_named_parameters()]
    sharded = zero3(cfg)
    device = trainer.dev.device
    reducer = GradReducer(named, ps, bucket_size_mb=par.bucket_size_mb,
                          compression_policy=CompressionPolicy.coerce(cfg.compression,
                                                                      o.train_iters),
                          overlap=par.overlap_grad_reduce,
                          unit_of=unit_index(chunks) if sharded else None,
                          device=device, deferred=sharded)
    reducer.loss_scaler = trainer.scaler     # top-k's local variance statistics, unscaled
    reducer.local_clip = o.clip_grad         # top-k's local clipping (dgc.py)
    trainer.reducer = reducer
    groups = [{"params": [q for n, q in named if decays(n, q)], "weight_decay": o.weight_decay},
              {"params": [q for n, q in named if not decays(n, q)], "weight_decay": 0.0}]
    adam = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                weight_decay=o.weight_decay)
    if par.use_distributed_optimizer:
        # under --compile the chunks' forward pre-hooks would be traced: gather synchronously
        # (ZeRO-3 is refused with --compile, engine/config/sharding.py)
        overlap = par.overlap_param_gather and not cfg.compile
        fraction = o.optimizer_offload_fraction if o.optimizer_cpu_offload else None
        trainer.optimizer = DistributedOptimizer(groups, reducer, ps, zero_stage=par.zero_stage,
                                                 overlap_param_gather=overlap,
                                                 offload_fraction=fraction, **adam)
        trainer.optimizer.register_param_gather_hooks(chunks)
        if host_build(cfg, device):   # the parameters are on the device now: their buffers too
            move_buffers(chunks, device)
    else:
        trainer.optimizer = MixedPrecisionOptimizer(groups, reducer, ps, **adam)
    trainer.memory = memory_bytes(reducer, trainer.optimizer)
