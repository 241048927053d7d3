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
- ep 2 over dp 2 with a capacity factor (assignments dropped, padded and not), and with the
  expert bias of aux-loss-free balancing (its update from the global load, equal to serial, and the
  serial bias moves); the step's MoE figures (models/moe/step_figures.py) as the trainer reads
  them: the per-expert load and the dropped count exactly, the bias to 1e-6.
- Through the real trainer (engine/training): ep 2 over dp 2 (sigmoid scores and the expert bias,
  with the MoE metrics of the step records), and ep 2 over dp 2 with pp 2, against the serial
  trainer's per-step losses, gradient norms and MoE metrics.
"""
from __future__ import annotations

import torch

from models import LayerContext, build_chunks
from models.config import GPTConfig
from models.moe.stats import moe_layers, pop_moe_stats, set_aux_grad_scale
from models.moe.step_figures import StepFigures, update_expert_bias
from parallel.dp.reducer import GradReducer
from models.logical import logical_views
from parallel.expert_parallel import init_expert_groups
from parallel.grads.norm import clip_grads
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS, REL, GLOBAL_BATCH, SEED = 20, 1e-4, 8, 1234

GPT2 = dict(block="gpt2", num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05,
            moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=16)
LLAMA = dict(block="llama", num_experts=4, moe_router_topk=2, moe_layer_freq="[0,1]",
             moe_router_score_function="sigmoid", moe_router_load_balancing_type="seq_aux_loss",
             moe_aux_loss_coeff=0.05, moe_ffn_hidden_size=24)
# capacity is per micro-batch and the global aux loss per micro-step: per-sequence aux loss here
CAPACITY = {**GPT2, "moe_expert_capacity_factor": 0.75, "moe_router_load_balancing_type": "seq_aux_loss"}
PADDED = {**LLAMA, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
BIAS = {**LLAMA, "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.05,
        "moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "none"}


def model_config(kind: dict) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                     vocab_size=64, seed=SEED, **kind)


def train(ps: ParallelState, cfg: GPTConfig, micro_per_rank: int) -> list[tuple[float, ...]]:
    """(loss, balancing loss, grad norm, dropped, load..., bias...) per step of this layout."""
    torch.manual_seed(0)
    chunks = build_chunks(cfg, ps, LayerContext(Initializer(SEED, cfg.init_std)), [range(cfg.num_layers)],
                          [0], 1)
    model = chunks[0]
    reducer = GradReducer(model, ps, bucket_size_mb=0.01)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    figures = StepFigures.of(chunks)
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
        sums = figures.vector(chunks, micro_per_rank, ps.tp_rank == 0, torch.device("cpu"))
        ps.world_group.all_reduce(sums)  # as the trainer's step does
        moe = figures.read(sums.tolist(), dp)
        update_expert_bias(chunks, figures, moe["loads"])
        stats = pop_moe_stats(chunks, micro_per_rank)
        figures_ = torch.tensor([float(total), stats["aux_loss"] + stats["z_loss"]])
        ps.dp_cp_group.all_reduce(figures_)
        loss_v, aux_v = (figures_ / dp).tolist()
        assert abs(moe["moe_aux_loss"] + moe["moe_z_loss"] - aux_v) <= 1e-5 * max(abs(aux_v), 1e-6)
        bias = [float(v) for m in moe_layers(chunks) if m.router.expert_bias is not None
                for v in m.router.expert_bias]
        out.append((loss_v, aux_v, norm, moe["moe_tokens_dropped"], *moe["moe_expert_load"], *bias))
    reducer.remove_hooks()
    held = {n.split(".experts.experts.")[1].split(".")[0] for n in logical_views(model)
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
        tag = " capacity" if cfg.moe_expert_capacity_factor else ""
        tag += " bias" if cfg.moe_router_enable_expert_bias else ""
        results.append((f"{grid.describe()} ep={ep} {kind['block']}{tag}", serial,
                        train(lps, cfg, micro)))
    return results


def _check(results) -> None:
    for per_rank in results:
        for name, serial, layout in per_rank:
            for step, (a, b) in enumerate(zip(serial, layout)):
                assert len(a) == len(b), name
                for i, (x, y) in enumerate(zip(a, b)):
                    what = ("loss", "balancing loss", "grad norm", "dropped")[i] if i < 4 else \
                        f"load/bias entry {i - 4}"
                    assert abs(x - y) <= REL * max(abs(x), 1e-6), \
                        f"{name} step {step + 1}: {what} {y} != serial {x}"
            if "bias" in name:
                assert any(v != 0 for v in serial[-1][4 + 4:]), "the serial run's bias moved"
            else:
                assert serial[0][1] > 0
            if "capacity" in name:
                assert all(s[3] > 0 for s in serial), "the capacity dropped assignments"


def test_moe_ep2_dp2_equals_serial():
    _check(run_distributed(_layouts, grid=RankGrid(dp=2), args=([
        (RankGrid(dp=2), 2, GPT2, 1, 1),
        (RankGrid(dp=2), 2, LLAMA, 2, 4),
        # capacity is per micro-batch: the same micro-batch size (4 sequences) in both runs
        (RankGrid(dp=2), 2, CAPACITY, 1, 2),
        (RankGrid(dp=2), 2, PADDED, 1, 2),
        (RankGrid(dp=2), 2, BIAS, 2, 4),
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
           "--seq-length", "16", "--global-batch-size", "8", "--train-iters", str(STEPS),
           "--precision", "fp32", "--lr", "1e-2", "--lr-warmup-iters", "0", "--peak-tflops", "1",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.05",
           "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-z-loss-coeff", "1e-3"]


def _trainer_losses(ps, argv: list[str]) -> dict:
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    trainer = Trainer(parse_args(argv))
    records = trainer.train().records
    trainer.close()
    return {**{k: [r[k] for r in records] for k in ("loss", "grad_norm") + MOE_KEYS},
            "ep": trainer.ps.ep_group.size}


MOE_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_expert_load", "moe_load_imbalance",
            "moe_tokens_dropped", "ep_comm_bytes")
BIAS_FLAGS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
              "--moe-router-bias-update-rate", "0.05"]


def _check_moe_metrics(got: dict, ref: list, what: str) -> None:
    """The step records' MoE metrics against the serial run's: the same figures, except the EP
    traffic (none serially)."""
    for step, r in enumerate(ref):
        assert got["moe_expert_load"][step] == r["moe_expert_load"], (what, step)
        assert sum(r["moe_expert_load"]) == 8 * 16 * 2 * 2  # tokens x K x MoE layers
        assert got["moe_tokens_dropped"][step] == r["moe_tokens_dropped"] == 0
        for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
            assert abs(got[key][step] - r[key]) <= REL * abs(r[key]), (what, key, step)
        assert r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 and r["ep_comm_bytes"] == 0
        assert got["ep_comm_bytes"][step] > 0


def test_trainer_ep2_dp2_equals_serial():
    """The trainer wires it all: expert groups, the balancing losses' gradient factor (2 micro-batches
    per rank here against 4 in the serial run), the reducer and the step's gradient norm."""
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    serial = Trainer(parse_args(TRAINER + BIAS_FLAGS + ["--micro-batch-size", "2"]), launch=LaunchEnv())
    seen = {i: [] for i, _ in enumerate(moe_layers(serial.chunks))}   # each forward's bias
    for i, m in enumerate(moe_layers(serial.chunks)):
        m.router.register_forward_pre_hook(
            lambda mod, args, i=i: seen[i].append(mod.expert_bias.abs().sum().item()))
    ref = serial.train().records
    serial.close()
    # the steps' updates moved every layer's bias (a sign rule: it may come back to 0 later)
    assert all(max(sums) > 0 for sums in seen.values()), seen
    runs = run_distributed(_trainer_losses, grid=RankGrid(dp=2), args=(
        TRAINER + BIAS_FLAGS + ["--dp", "2", "--ep", "2", "--micro-batch-size", "2"],))
    assert runs[0]["ep"] == 2
    for key in ("loss", "grad_norm"):
        for step, (got, want) in enumerate(zip(runs[0][key], [r[key] for r in ref]), start=1):
            assert abs(got - want) <= REL * abs(want), f"ep=2 dp=2: {key} at step {step} is {got}, serial {want}"
    _check_moe_metrics(runs[0], ref, "ep=2 dp=2")


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
    _check_moe_metrics(runs[0], ref, "pp=2 dp=2 ep=2")  # one MoE layer per stage: the world's sums
