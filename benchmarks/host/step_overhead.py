"""Step overhead: the engine's own time per step outside forward and backward (gradient reduction
epilogue, overflow check and unscale, grad norm, clipping, the optimizer, master-to-parameter copies,
the step's statistics), now and with the former per-parameter code, in one run.

Two trainers are built from the same recipe (a model of many small layers, so that the per-step
cost is dominated by per-parameter work, the case this benchmark exists for) and fed the same
batches. Each step runs forward and backward untimed on both, then times the part after backward:

- "now": what ``engine.training.step.Stepper.run`` does after backward: multi-tensor ops over the few flat
  gradient buffers (``grad_stats``), the step's one all-reduce and host read
  (``reduce_step_stats``), ``apply_grad_stats``, the optimizer (fused AdamW on CPU), and one
  multi-tensor master-to-parameter copy;
- "before": the same step written as it was: ``parallel.grads.norm``'s ``*_reference`` loops (an
  isfinite/any/max per gradient, a mul per gradient to unscale, a norm per gradient, a mul per
  gradient to clip), a host read after the overflow check and another after the norm, the
  per-parameter grad hand-over with ``.to().view_as()``, ``torch.optim.AdamW(foreach=True)`` and
  a ``copy_`` per parameter, then the loss read and its all-reduce.

The two sides alternate which goes first, step by step (the machine is shared: load drifts on the
scale of seconds); the ratio reported is the median over step pairs. Both sides do the same math, so
their losses stay equal to rounding (the fused and the multi-tensor AdamW kernels round differently);
the largest relative difference is printed.

Kernel launches: torch.profiler records the ops of one step's post-backward part on each side,
for two depths of the same model; a row counts the top-level aten ops (those not called by another
aten op: on an accelerator each is one kernel launch, or a few for a multi-tensor op over many
tensors) that are not pure metadata (views, shapes, empty allocations) or host reads of CPU
scalars (the optimizer's step counters). "now" must not grow with the number of parameters.
"host reads" counts, in the same part, every read of a tensor's value by the host (``item``,
``tolist``, ``bool``, ``float``...: the engine's own ``engine.device.syncs.SyncCounter``), the
profiler's ``aten::item`` rows alone would miss the "now" side's one ``tolist``. On this CPU every
tensor counts, the "before" side's foreach AdamW reading its host step counters (two per parameter)
included; on an accelerator those are host tensors and no device wait.

Both are host-time benchmarks: the trainers are built with ``--device cpu``, where every op runs
synchronously, so the host clock around a part measures that part's work (on an accelerator it
would measure launches, and the wait inside one side's host read).

    python -m benchmarks.host.step_overhead [--num-layers 100] [--steps 20] [--profile-layers 50,100]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import BenchParser, at_least, parse_int_list
from engine.config.cli import parse_args
from engine.device.syncs import SyncCounter
from engine.training.lr_schedule import learning_rate
from engine.training.trainer import Trainer
from parallel.grads.norm import (check_and_unscale_reference, counted_grads,
                                 local_norm_sq_reference, scale_reference)
from parallel.grads.main_grad import current_grad, sync_sequence_parallel_grads
from parallel.pipeline.executor import sum_embedding_grads

METADATA_OPS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::view_as", "aten::reshape", "aten::_reshape_alias",
    "aten::as_strided", "aten::slice", "aten::split", "aten::split_with_sizes", "aten::select",
    "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose", "aten::alias", "aten::detach",
    "aten::detach_", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh",
    "aten::to", "aten::unbind", "aten::expand", "aten::resolve_conj", "aten::resolve_neg",
})
HOST_SCALAR_OPS = frozenset({"aten::item", "aten::_local_scalar_dense"})


def build(num_layers: int, args) -> Trainer:
    argv = ["--mock-data", "--vocab-size", str(args.vocab_size), "--num-layers", str(num_layers),
            "--hidden-size", str(args.hidden_size), "--num-attention-heads", str(args.heads),
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.micro_batch_size), "--train-iters", "1000000",
            "--precision", args.precision, "--clip-grad", "1.0", "--no-progress", "--lr", "1e-4",
            "--initial-loss-scale", "256", "--device", "cpu"]
    return Trainer(parse_args(argv))


def as_before(trainer: Trainer) -> Trainer:
    """The former optimizer: torch.optim.AdamW(foreach=True) over the same masters."""
    opt, inner = trainer.optimizer, trainer.optimizer.inner
    o = trainer.cfg.optim
    opt.inner = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]}
                                   for g in inner.param_groups],
                                  lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                  foreach=True)
    return trainer


def forward_backward(trainer: Trainer, step: int):
    st = trainer.stepper
    batches = trainer._batches(step)
    st.optimizer.zero_grad()
    local_loss, pipe = st._forward_backward(batches, float(st.scaler.scale), [])
    return local_loss, pipe


def after_backward_now(trainer: Trainer, local_loss, pipe, lr: float) -> float:
    st = trainer.stepper
    st.reducer.finish()
    sync_sequence_parallel_grads(st.params, st.ps)
    sum_embedding_grads(st.ps, st.shared)
    stats, check = st.statistics(local_loss, pipe)
    if not check.skipped:
        st.optimizer.step(lr)
    return stats.loss


def after_backward_before(trainer: Trainer, local_loss, pipe, lr: float) -> float:
    """The step as it was written before the multi-tensor paths (see the module docstring)."""
    import torch.distributed as dist
    st, ps, opt = trainer.stepper, trainer.stepper.ps, trainer.stepper.optimizer
    st.reducer.finish()
    sync_sequence_parallel_grads(st.params, ps)
    sum_embedding_grads(ps, st.shared)
    pieces = opt.grad_pieces()
    grads = [g for g, _ in pieces]
    scale = st.scaler.scale
    flag = check_and_unscale_reference(grads, 1.0)                      # isfinite per gradient
    ps.world_group.all_reduce(flag, op=dist.ReduceOp.MAX)
    skipped = st.scaler.update(bool(flag.item() > 0))                   # host read 1
    norm = None
    if not skipped:
        if scale != 1.0:
            scale_reference(grads, 1.0 / scale)                          # a mul per gradient
        total = local_norm_sq_reference(counted_grads(pieces, ps))      # a norm per gradient
        ps.mp_group.all_reduce(total)
        norm = math.sqrt(total.item())                                  # host read 2
        coef = 1.0 / (norm + 1e-6)
        if coef < 1.0:
            scale_reference(grads, coef)                                 # a mul per gradient
        for group in opt.inner.param_groups:
            group["lr"] = lr
        borrowed = []
        for p, m in zip(opt.params, opt.masters):                       # per-parameter hand-over
            g = current_grad(p)
            if m is p and g is p.grad:
                continue
            m.grad = None if g is None else g.to(torch.float32).view_as(m)
            borrowed.append(m)
        opt.inner.step()
        for m in borrowed:
            m.grad = None
        with torch.no_grad():
            for p, m in zip(opt.params, opt.masters):                   # a copy per parameter
                if m is not p:
                    p.copy_(m)
    loss = float(local_loss.item())                                     # host read 3
    t = torch.tensor([loss], dtype=torch.float32)
    ps.world_group.all_reduce(t)
    return t.tolist()[0] / ps.dp_size


def count_launches(trainer: Trainer, fn, step: int) -> dict:
    """Top-level aten ops of one post-backward part, by kind (see the module docstring)."""
    local_loss, pipe = forward_backward(trainer, step)
    lr = learning_rate(step, trainer.cfg.optim)
    reads = SyncCounter(device_type="cpu")  # every host read of a tensor's value
    with profile(activities=[ProfilerActivity.CPU]) as prof, reads.step(), reads.watching():
        with record_function("after_backward"):
            fn(trainer, local_loss, pipe, lr)
    top = [e.name for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    counts = Counter(top)
    launches = sum(n for name, n in counts.items() if name not in METADATA_OPS | HOST_SCALAR_OPS)
    return {"launches": launches, "top_level_ops": len(top),
            "host_scalar_reads": sum(counts[n] for n in HOST_SCALAR_OPS),
            "host_reads": len(reads.last), "by_op": counts}


def main(argv=None) -> None:
    ap = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-layers", type=int, default=100)
    ap.add_argument("--hidden-size", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--precision", default="fp16", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--steps", type=int, default=20, help="timed step pairs")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-layers", default="50,100", help="depths whose launches are counted")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1: on a shared machine a second thread waits for a "
                         "time slice, which times the scheduler instead of the step)")
    args = ap.parse_args(argv)
    at_least(ap, args, num_layers=1, hidden_size=1, heads=1, seq_length=1, vocab_size=1,
             micro_batch_size=1, steps=1, warmup=0, threads=1)
    if args.hidden_size % args.heads:
        ap.error(f"--hidden-size {args.hidden_size} must be a multiple of --heads {args.heads}")
    try:
        args.profile_layers = parse_int_list(args.profile_layers, "--profile-layers")
    except ValueError as exc:
        ap.error(str(exc))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    now, before = build(args.num_layers, args), as_before(build(args.num_layers, args))
    sides = {"now": (now, after_backward_now), "before": (before, after_backward_before)}
    times = {"now": [], "before": []}
    ratios, max_rel = [], 0.0
    for step in range(args.warmup + args.steps):
        order = ("now", "before") if step % 2 == 0 else ("before", "now")
        loss = {}
        for name in order:
            trainer, fn = sides[name]
            local_loss, pipe = forward_backward(trainer, step)
            lr = learning_rate(step, trainer.cfg.optim)
            t0 = time.perf_counter()
            loss[name] = fn(trainer, local_loss, pipe, lr)
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(dt)
        max_rel = max(max_rel, abs(loss["now"] - loss["before"]) / abs(loss["before"]))
        if step >= args.warmup:
            ratios.append(times["before"][-1] / times["now"][-1])
    params = sum(1 for c in now.chunks for p in c.parameters() if p.requires_grad)
    n = len(ratios)
    print(f"| side | median time after backward per step (ms), {n} interleaved steps |")
    print("| --- | ---: |")
    for name in ("before", "now"):
        print(f"| {name} | {1e3 * statistics.median(times[name]):.2f} |")
    print(f"\nbefore / now = {statistics.median(ratios):.2f}x (median of {n} step pairs; target >= 3)")
    print(f"largest relative loss difference between the sides: {max_rel:.1e}")
    print(f"model: {args.num_layers} layers, hidden {args.hidden_size}, {params} parameter tensors, "
          f"{args.precision}, {torch.get_num_threads()} threads")
    now.close(), before.close()

    print("\n| side | layers | parameter tensors | kernel launches | top-level ops | "
          "aten::item | host reads |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layers in args.profile_layers:
        for name in ("before", "now"):
            trainer = build(layers, args) if name == "now" else as_before(build(layers, args))
            fn = sides[name][1]
            for step in range(2):  # warm: optimizer state exists
                local_loss, pipe = forward_backward(trainer, step)
                fn(trainer, local_loss, pipe, 1e-4)
            c = count_launches(trainer, fn, 2)
            tensors = sum(1 for ch in trainer.chunks for p in ch.parameters() if p.requires_grad)
            print(f"| {name} | {layers} | {tensors} | {c['launches']} | {c['top_level_ops']} | "
                  f"{c['host_scalar_reads']} | {c['host_reads']} |")
            if name == "now":
                ops = ", ".join(f"{k} {v}" for k, v in sorted(c["by_op"].items())
                                if k not in METADATA_OPS)
                print(f"|  | ops: {ops} | | | | | |")
            trainer.close()


if __name__ == "__main__":
    main()
