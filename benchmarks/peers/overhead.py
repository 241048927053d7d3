"""Engine overhead: the same GPT and batches trained by the engine (tp=pp=dp=1) and by a plain
PyTorch loop written here (model.forward, loss.backward, clip_grad_norm_, AdamW.step), in one run.

Both sides do the same work, so the ratio isolates what the engine adds around the model (the
gradient buffers and hooks, the loss-scaler logic, clipping over the grid, metrics):

- the same model class (models.GPTChunk) with the same initial weights, in training mode;
- the same micro-batches, fetched and collated inside the timed step on both sides;
- the same optimizer math: torch.optim.AdamW with the engine's defaults (foreach/fused left to
  torch on both sides), the engine's two weight-decay groups (no decay on biases, norms and the
  position table), the engine's learning-rate schedule per step and clipping at 1.0.

Because the math is the same, both sides produce the same loss at every step; the benchmark checks
that (a side doing less work would show up as a loss mismatch) and prints the largest difference.

Timing is interleaved step by step, alternating which side goes first, because on a shared
machine the load from other processes drifts on the scale of seconds: timing ten steps of one
side and then ten of the other measured that drift, not the engine (earlier block-wise runs
put the ratio anywhere between 0.7 and 5). The ratio reported is the median over step pairs of
plain step time / engine step time; tokens/s per side come from each side's median step time.
Target: ratio >= 0.97. A host-time benchmark: the engine is built with ``--device cpu`` (the plain
loop copies its model), where every op runs synchronously, so each side's host clock covers its
whole step (on an accelerator the engine's step would return with its optimizer still queued).

    python -m benchmarks.peers.overhead [--steps 20] [--rounds 3] [--hidden-size 256] [--num-layers 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import BenchParser, at_least
from engine.config.cli import parse_args
from engine.training.dp_setup import decays
from engine.training.lr_schedule import learning_rate
from engine.training.trainer import Trainer


def engine_side(args) -> Trainer:
    argv = ["--mock-data", "--vocab-size", str(args.vocab_size), "--num-layers", str(args.num_layers),
            "--hidden-size", str(args.hidden_size), "--num-attention-heads", str(args.heads),
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.global_batch_size), "--train-iters", "1000000",
            "--no-progress", "--lr", "1e-4", "--clip-grad", "1.0", "--weight-decay", "0.1",
            "--device", "cpu"]
    return Trainer(parse_args(argv))


def plain_side(trainer: Trainer):
    """A copy of the engine's model and an AdamW configured exactly as the engine's."""
    chunk = trainer.chunks[0]
    model = type(chunk)(chunk.cfg, trainer.ps, _ctx(trainer), chunk.layer_range)
    model.load_state_dict(chunk.state_dict())
    model.train()
    o = trainer.cfg.optim
    named = list(model.logical_named_parameters())
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": o.weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    return model, opt


def plain_step(trainer: Trainer, model, opt, step: int) -> float:
    """One step of the plain loop; the engine object only supplies the batches and the LR."""
    batches = trainer._batches(step)  # same collate + copy as the engine's step
    for group in opt.param_groups:
        group["lr"] = learning_rate(step, trainer.cfg.optim)
    opt.zero_grad(set_to_none=True)
    losses = []
    for mb in batches:  # tokens, labels (b, s) each
        loss = model(mb.tokens, mb.labels).mean() / len(batches)
        loss.backward()
        losses.append(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.cfg.optim.clip_grad)
    opt.step()
    return torch.stack(losses).sum().item()


def main(argv=None) -> None:
    ap = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="step pairs per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed step pairs before the rounds")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=16)
    args = ap.parse_args(argv)
    at_least(ap, args, steps=1, rounds=1, warmup=0, num_layers=1, hidden_size=1, heads=1,
             seq_length=1, vocab_size=1, micro_batch_size=1, global_batch_size=1)
    if args.hidden_size % args.heads:
        ap.error(f"--hidden-size {args.hidden_size} must be a multiple of --heads {args.heads}")
    if args.global_batch_size % args.micro_batch_size:
        ap.error(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                 f"--micro-batch-size {args.micro_batch_size}")
    torch.manual_seed(0)
    trainer = engine_side(args)
    model, opt = plain_side(trainer)

    def run_plain(step):
        t0 = time.perf_counter()
        loss = plain_step(trainer, model, opt, step)
        return time.perf_counter() - t0, loss

    def run_engine(step):
        t0 = time.perf_counter()
        loss = trainer.train_one(step)["loss"]
        return time.perf_counter() - t0, loss

    plain_t, engine_t, pair_ratio, round_ratio, max_rel = [], [], [], [], 0.0
    for step in range(args.warmup + args.steps * args.rounds):
        if step % 2 == 0:
            (tp, lp), (te, le) = run_plain(step), run_engine(step)
        else:
            (te, le), (tp, lp) = run_engine(step), run_plain(step)
        max_rel = max(max_rel, abs(le - lp) / abs(lp))
        if step < args.warmup:
            continue
        plain_t.append(tp)
        engine_t.append(te)
        pair_ratio.append(tp / te)
        if len(plain_t) % args.steps == 0:
            round_ratio.append(sum(plain_t[-args.steps:]) / sum(engine_t[-args.steps:]))
    trainer.close()
    tokens = args.global_batch_size * args.seq_length
    p, e = tokens / statistics.median(plain_t), tokens / statistics.median(engine_t)
    n = len(plain_t)
    print(f"| side | median step (s) | tokens/s (median of {n} interleaved steps) |")
    print("| --- | ---: | ---: |")
    print(f"| plain PyTorch loop | {statistics.median(plain_t):.3f} | {p:,.0f} |")
    print(f"| gridtron (tp=pp=dp=1) | {statistics.median(engine_t):.3f} | {e:,.0f} |")
    print(f"\nratio engine / plain = {statistics.median(pair_ratio):.3f} (median of {n} step pairs; "
          f"target >= 0.97); per round (sum of times): "
          f"{', '.join(f'{r:.3f}' for r in round_ratio)}")
    print(f"largest relative loss difference between the sides: {max_rel:.1e}")
    print(f"model: {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
          f"batch {args.global_batch_size} (micro-batch {args.micro_batch_size}), "
          f"{torch.get_num_threads()} threads")


def _ctx(trainer):
    from models.layers import LayerContext
    from parallel.tensor_parallel import Initializer
    return LayerContext(Initializer(trainer.cfg.seed, trainer.cfg.model.init_std))


if __name__ == "__main__":
    main()
