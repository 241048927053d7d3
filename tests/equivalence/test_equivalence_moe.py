"""Mixture-of-experts layouts against the serial model (fp32, dropless routing, one seed).

Each rank trains the serial model itself (``ParallelState.serial()``) and then the layout, with
the same loop: the global batch of step k drawn from (seed, k), DP ranks taking consecutive
slices, micro-batches consecutive slices of those; the reducer (expert weights summed over EDP),
the global gradient norm with clipping (every expert counted once), SGD. The per-step token loss,
balancing loss (aux + z) and gradient norm must agree to a relative 1e-4:

- ep 2 over dp 2; ep 2 and ep 4 over dp 4; ep 2 with tp 2 (dp 2): gpt2 blocks with the global
  aux loss (one micro-batch per rank, so every micro-step is the global batch), a shared expert
  and the z-loss; llama blocks with the per-sequence aux loss, sigmoid scores and an uneven split
  into micro-batches (2 per rank against 1 or 4 in the serial run), MoE every second layer.
- Through the real trainer (engine/training): ep 2 over dp 2, and ep 2 over dp 2 with pp 2, against
  the serial trainer's per-step losses and gradient norms.
"""
from __future__ import annotations

import torch

from models import LayerContext, build_chunks
from models.config import GPTConfig
from models.moe.stats import pop_moe_stats, set_aux_grad_scale
from parallel.dp.reducer import GradReducer
from parallel.expert_parallel import init_expert_groups
from parallel.grad_norm import clip_grads
from parallel.state import LaunchEnv, ParallelState
from parallel.tensor_parallel import Initializer
from parallel.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS, REL, GLOBAL_BATCH, SEED = 4, 1e-4, 8, 1234

GPT2 = dict(block="gpt2", num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05,
            moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=16)
LLAMA = dict(block="llama", num_experts=4, moe_router_topk=2, moe_layer_freq="[0,1]",
             moe_router_score_function="sigmoid", moe_router_load_balancing_type="seq_aux_loss",
             moe_aux_loss_coeff=0.05, moe_ffn_hidden_size=24)


def model_config(kind: dict) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                     vocab_size=64, seed=SEED, **kind)


def train(ps: ParallelState, cfg: GPTConfig, micro_per_rank: int) -> list[tuple[float, ...]]:
    """(loss, balancing loss, grad norm) per step of this layout."""
    torch.manual_seed(0)
    chunks = build_chunks(cfg, ps, LayerContext(Initializer(SEED, cfg.init_std)), [range(cfg.num_layers)],
                          [0], 1)
    model = chunks[0]
    reducer = GradReducer(model, ps, bucket_size_mb=0.01)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    dp, dp_rank = ps.dp_cp_group.size, ps.dp_cp_group.rank
    per_rank = GLOBAL_BATCH // dp
    mb = per_rank // micro_per_rank
    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(SEED * 100 + step)
        data = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_length + 1), generator=gen)
        mine = data[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        reducer.zero_grad()
        set_aux_grad_scale(chunks, 1.0 / micro_per_rank)
        total = torch.zeros(())
        for i in range(micro_per_rank):
            rows = mine[i * mb:(i + 1) * mb]
            reducer.set_last_microbatch(i == micro_per_rank - 1)
            loss = model(rows[:, :-1], rows[:, 1:]).mean() / micro_per_rank
            loss.backward()
            total += loss.detach()
        reducer.finish()
        norm = clip_grads(params, 1.0, ps)
        opt.step()
        stats = pop_moe_stats(chunks, micro_per_rank)
        figures = torch.tensor([float(total), stats["aux_loss"] + stats["z_loss"]])
        ps.dp_cp_group.all_reduce(figures)
        loss_v, aux_v = (figures / dp).tolist()
        out.append((loss_v, aux_v, norm))
    reducer.remove_hooks()
    held = {n.split(".experts.experts.")[1].split(".")[0] for n, _ in model.named_parameters()
            if ".experts.experts." in n}
    assert len(held) == cfg.num_experts // ps.ep_group.size  # each EP rank holds E / ep experts
    return out


def _layouts(ps: ParallelState, layouts: list) -> list:
    """[(name, serial figures, layout figures)] for (grid, ep, model kind, micro per rank,
    serial micro-batches) on this world."""
    results = []
    rules = ps.comm.rules_name
    for grid, ep, kind, micro, serial_micro in layouts:
        cfg = model_config(kind)
        serial = train(ParallelState.serial(backend_rules=rules), cfg, serial_micro)
        lps = ps if grid == ps.grid else ParallelState.initialize(
            grid, torch.device("cpu"), "gloo", LaunchEnv.from_env(), backend_rules=rules)
        init_expert_groups(lps, ep)
        assert lps.ep_group.size == ep and (ep == 1 or lps.edp_group is not lps.dp_cp_group)
        results.append((f"{grid.describe()} ep={ep} {kind['block']}", serial, train(lps, cfg, micro)))
    return results


def _check(results) -> None:
    for per_rank in results:
        for name, serial, layout in per_rank:
            for step, (a, b) in enumerate(zip(serial, layout)):
                for what, x, y in zip(("loss", "balancing loss", "grad norm"), a, b):
                    assert abs(x - y) <= REL * max(abs(x), 1e-6), \
                        f"{name} step {step + 1}: {what} {y} != serial {x}"
            assert serial[0][1] > 0


def test_moe_ep2_dp2_equals_serial():
    _check(run_distributed(_layouts, grid=RankGrid(dp=2), args=([
        (RankGrid(dp=2), 2, GPT2, 1, 1),
        (RankGrid(dp=2), 2, LLAMA, 2, 4),
    ],)))


def test_moe_ep_dp4_and_tp2_equal_serial():
    _check(run_distributed(_layouts, grid=RankGrid(dp=4), args=([
        (RankGrid(dp=4), 2, GPT2, 1, 1),
        (RankGrid(dp=4), 4, LLAMA, 1, 2),
        (RankGrid(tp=2, dp=2), 2, GPT2, 1, 1),
    ],)))


# ---- through the real trainer ---------------------------------------------------------------------

TRAINER = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu",
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--global-batch-size", "8", "--train-iters", "3",
           "--precision", "fp32", "--lr", "1e-2", "--lr-warmup-iters", "0", "--peak-tflops", "1",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.05",
           "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-z-loss-coeff", "1e-3"]


def _trainer_losses(ps, argv: list[str]) -> dict:
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    trainer = Trainer(parse_args(argv))
    records = trainer.train().records
    trainer.close()
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "ep": trainer.ps.ep_group.size}


def test_trainer_ep2_dp2_equals_serial():
    """The trainer wires it all: expert groups, the balancing losses' gradient factor (2 micro-batches
    per rank here against 4 in the serial run), the reducer and the step's gradient norm."""
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    serial = Trainer(parse_args(TRAINER + ["--micro-batch-size", "2"]), launch=LaunchEnv())
    ref = serial.train().records
    serial.close()
    runs = run_distributed(_trainer_losses, grid=RankGrid(dp=2), args=(
        TRAINER + ["--dp", "2", "--ep", "2", "--micro-batch-size", "2"],))
    assert runs[0]["ep"] == 2
    for key in ("loss", "grad_norm"):
        for step, (got, want) in enumerate(zip(runs[0][key], [r[key] for r in ref]), start=1):
            assert abs(got - want) <= REL * abs(want), f"ep=2 dp=2: {key} at step {step} is {got}, serial {want}"


def test_trainer_pp2_dp2_ep2_equals_serial():
    """Pipeline stages with MoE layers on both: EP groups inside each stage, the balancing losses'
    gradient reaching the first stage through the pipeline's backward."""
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    serial = Trainer(parse_args(TRAINER + ["--micro-batch-size", "2"]), launch=LaunchEnv())
    ref = serial.train().records
    serial.close()
    runs = run_distributed(_trainer_losses, grid=RankGrid(pp=2, dp=2), args=(
        TRAINER + ["--pp", "2", "--dp", "2", "--ep", "2", "--micro-batch-size", "1"],))
    assert {r["ep"] for r in runs} == {2}
    for key in ("loss", "grad_norm"):
        for step, (got, want) in enumerate(zip(runs[0][key], [r[key] for r in ref]), start=1):
            assert abs(got - want) <= REL * abs(want), f"pp=2 dp=2 ep=2: {key} at step {step} is {got}, serial {want}"
