"""Engine overhead: the same GPT and batches trained by the engine (tp=pp=dp=1) and by a plain
PyTorch loop written here (model.forward, loss.backward, clip_grad_norm_, AdamW.step), in one run.

Both sides use the same model class (models.GPTChunk), the same micro-batches and the same
optimizer hyper-parameters, so the ratio isolates what the engine adds around the model: the
gradient buffers and hooks, the loss scaler logic, clipping over the grid, metrics. Rounds
alternate between the two sides and the median round is reported. Target: ratio >= 0.97.

    python -m benchmarks.overhead [--steps 20] [--rounds 3] [--hidden-size 256] [--num-layers 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.cli import parse_args
from engine.trainer import Trainer


def engine_side(args) -> Trainer:
    argv = ["--mock-data", "--vocab-size", str(args.vocab_size), "--num-layers", str(args.num_layers),
            "--hidden-size", str(args.hidden_size), "--num-attention-heads", str(args.heads),
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.global_batch_size), "--train-iters", "1000000",
            "--no-progress", "--lr", "1e-4", "--clip-grad", "1.0", "--weight-decay", "0.1"]
    return Trainer(parse_args(argv))


def plain_step(model, opt, batches):
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for tokens, labels in batches:
        loss = model(tokens, labels).mean() / len(batches)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=16)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    trainer = engine_side(args)
    # the plain loop trains its own copy of the same model on the same batches
    plain = type(trainer.chunks[0])(trainer.chunks[0].cfg, trainer.ps, _ctx(trainer),
                                    trainer.chunks[0].layer_range)
    plain.load_state_dict(trainer.chunks[0].state_dict())
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = args.global_batch_size * args.seq_length
    engine_tps, plain_tps, step = [], [], 0
    for _ in range(2):  # warm-up both sides
        trainer.train_one(step)
        plain_step(plain, opt, trainer._batches(step))
        step += 1
    for _ in range(args.rounds):
        batches = [trainer._batches(step + i) for i in range(args.steps)]
        t0 = time.perf_counter()
        for b in batches:
            plain_step(plain, opt, b)
        plain_tps.append(tokens * args.steps / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for i in range(args.steps):
            trainer.train_one(step + i)
        engine_tps.append(tokens * args.steps / (time.perf_counter() - t0))
        step += args.steps
    trainer.close()
    e, p = statistics.median(engine_tps), statistics.median(plain_tps)
    print(f"| side | tokens/s (median of {args.rounds} rounds of {args.steps} steps) |")
    print("| --- | ---: |")
    print(f"| plain PyTorch loop | {p:,.0f} |")
    print(f"| gridtron (tp=pp=dp=1) | {e:,.0f} |")
    print(f"\nratio engine / plain = {e / p:.3f} (target >= 0.97); model: {args.num_layers} layers, "
          f"hidden {args.hidden_size}, seq {args.seq_length}, batch {args.global_batch_size}, "
          f"{torch.get_num_threads()} threads")


def _ctx(trainer):
    from models.layers import LayerContext
    from parallel.tensor_parallel import Initializer
    return LayerContext(Initializer(trainer.cfg.seed, trainer.cfg.model.init_std))


if __name__ == "__main__":
    main()
