"""Expert capacity (which assignments drop, padding), the expert bias of aux-loss-free balancing,
the step's MoE figures and their bad input, on one process against hand-computed values."""
from __future__ import annotations

import json

import pytest
import torch

from engine.base import ConfigError
from engine.config.cli import parse_args
from models import LayerContext
from models.config import GPTConfig
from models.moe.capacity import choose, expert_capacity, padded_rows
from models.moe.layer import MoELayer
from models.moe.router import TopKRouter
from models.moe.step_figures import StepFigures, moe_record, update_expert_bias
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from tests.helpers.moe_reference import expert_forward


def cfg_of(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32,
                num_experts=4, moe_router_topk=2)
    return GPTConfig(**{**base, **kw})


def test_capacity_drops_the_lowest_weights_hand_computed():
    assert expert_capacity(4, 1, 2, 1.0) == 2 and expert_capacity(3, 2, 3, 0.5) == 1
    assert expert_capacity(16, 2, 4, 1.25) == 10  # ceil(1.25 * 16 * 2 / 4)
    with pytest.raises(ValueError, match="must be > 0"):
        expert_capacity(4, 1, 2, 0.0)
    # K = 1, capacity 2: expert 0 has weights 0.5, 0.9, 0.5 -> token 1, then token 0 (the tie
    # goes to the lower token index); token 2 drops
    experts = torch.tensor([[0], [0], [0], [1]])
    weights = torch.tensor([[0.5], [0.9], [0.5], [0.7]])
    choice = choose(weights, experts, 2, 2)
    assert choice.keep.tolist() == [[True], [True], [False], [True]] and int(choice.dropped) == 1
    tokens, flat, mask = padded_rows(choice, experts)
    assert tokens.tolist() == [1, 0, 3, 0] and mask.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert flat.tolist() == [1, 0, 3, 0]
    # K = 2, capacity 1: expert 0 keeps token 1 (0.7), expert 1 token 2 (0.55), expert 2 token 1
    experts = torch.tensor([[0, 1], [0, 2], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.55, 0.45]])
    choice = choose(weights, experts, 3, 1)
    assert choice.keep.tolist() == [[False, False], [True, True], [True, False]]
    tokens, flat, mask = padded_rows(choice, experts)
    assert tokens.tolist() == [1, 2, 1] and flat.tolist() == [2, 4, 3] and mask.tolist() == [1.0] * 3
    # more room than tokens: padding rows beyond the T tokens
    tokens, flat, mask = padded_rows(choose(weights, experts, 3, 4), experts)
    assert tokens.numel() == 12 and mask.sum() == 6


@pytest.mark.parametrize("pad", [False, True])
def test_layer_with_capacity_equals_reference_without_the_dropped(pad):
    cfg = cfg_of(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad)
    layer = MoELayer(cfg, ParallelState.serial(), LayerContext(Initializer(7, 0.1)), "layers.0.mlp")
    x = torch.randn(2, 8, 16, requires_grad=True)
    y = layer(x)
    tokens = x.reshape(-1, 16)
    routing = layer.router(tokens)
    keep = choose(routing.weights, routing.experts, 4, expert_capacity(16, 2, 4, 0.5)).keep
    assert 0 < int((~keep).sum()) == int(layer.totals.dropped)
    ref = torch.stack([sum((routing.weights[t, j] * expert_forward(layer.experts, int(e), tokens[t:t + 1])[0]
                            for j, e in enumerate(routing.experts[t]) if keep[t, j]),
                           torch.zeros(16)) for t in range(16)])
    torch.testing.assert_close(y, ref.view(2, 8, 16), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert layer.router.weight.grad is not None
    # the load is the router's choice, before the drop
    assert layer.totals.load.sum() == 16 * 2


def test_padded_and_unpadded_capacity_agree_with_gradients():
    outs = []
    for pad in (False, True):
        cfg = cfg_of(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=pad)
        layer = MoELayer(cfg, ParallelState.serial(), LayerContext(Initializer(3, 0.1)), "layers.1.mlp")
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
        layer(x).square().sum().backward()
        outs.append((x.grad, layer.router.weight.grad, [p.grad for p in layer.experts.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
    for a, b in zip(outs[0][2], outs[1][2]):
        torch.testing.assert_close(a, b)


def test_expert_bias_chooses_and_the_scores_weigh():
    r = TopKRouter(4, 3, 1, Initializer(1, 0.5), "r", score_function="sigmoid", expert_bias=True)
    assert "expert_bias" in dict(r.named_buffers()) and "expert_bias" in r.state_dict()
    x = torch.randn(5, 4)
    scores = torch.sigmoid(x @ r.weight.t())
    plain = r(x)
    r.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0]))  # expert 2 wins every token
    biased = r(x)
    assert biased.experts.tolist() == [[2]] * 5
    torch.testing.assert_close(biased.weights, scores[:, 2:3])  # K = 1: the unbiased score
    assert not torch.equal(plain.experts, biased.experts)
    with pytest.raises(ValueError, match="sigmoid"):
        TopKRouter(4, 3, 1, Initializer(), "r", expert_bias=True)


def test_bias_update_and_figures_hand_computed():
    from models import build_chunks
    cfg = cfg_of(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_bias_update_rate=0.1, moe_layer_freq="[0,1]")
    chunks = build_chunks(cfg, ParallelState.serial(), LayerContext(Initializer(7, 0.1)), [range(2)], [0], 1)
    fig = StepFigures.of(chunks)
    assert fig.slots == {1: 0} and fig.width == 3 + 4
    # the world sums of [aux, z, dropped, load of layer 1], over dp x cp = 2 ranks
    read = fig.read([0.4, 0.2, 3.0, 3.0, 1.0, 2.0, 2.0], 2)
    assert read["moe_aux_loss"] == pytest.approx(0.2) and read["moe_z_loss"] == pytest.approx(0.1)
    assert read["moe_expert_load"] == [3, 1, 2, 2] and read["moe_load_imbalance"] == 1.5
    assert read["moe_tokens_dropped"] == 3
    # the imbalance is the most imbalanced layer's: [30, 10] and [10, 30] are 1.5 each, though
    # their sum [40, 40] is balanced
    two = StepFigures(2, {0: 0, 1: 1}).read([0, 0, 0, 30, 10, 10, 30], 1)
    assert two["moe_expert_load"] == [40, 40] and two["moe_load_imbalance"] == 1.5
    update_expert_bias(chunks, fig, read["loads"])
    bias = chunks[0].layers[1].mlp.router.expert_bias
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))  # mean load 2
    comm = {"ep": {"payload_bytes": 64}}
    assert moe_record(read, comm)["ep_comm_bytes"] == 64
    assert moe_record(None, comm) == dict.fromkeys(
        ("moe_aux_loss", "moe_z_loss", "moe_expert_load", "moe_load_imbalance", "moe_tokens_dropped",
         "ep_comm_bytes"))
    # a TP rank other than 0 adds nothing; this rank's vector counts its totals
    tokens = torch.randint(0, 32, (2, 9))
    chunks[0](tokens[:, :-1], tokens[:, 1:]).mean().backward()
    assert fig.vector(chunks, 1, False, torch.device("cpu")).abs().sum() == 0
    v = fig.vector(chunks, 1, True, torch.device("cpu"))
    assert v[3:].sum() == 2 * 8 * 2 and v[2] == 0


def test_expert_bias_stays_fp32_in_a_bf16_model():
    """A bf16 bias would round the update off: steps of 1e-3 stop moving it at |b| = 0.5."""
    from models import build_chunks
    cfg = cfg_of(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_bias_update_rate=1e-3, moe_layer_freq="[0,1]")
    chunks = build_chunks(cfg, ParallelState.serial(), LayerContext(Initializer(7, 0.1)), [range(2)],
                          [0], 1).to(dtype=torch.bfloat16)
    router = chunks[0].layers[1].mlp.router
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    assert router.state_dict()["expert_bias"].dtype == torch.float32
    fig = StepFigures.of(chunks)
    expected = torch.zeros(4)
    for _ in range(1000):  # expert 0 always over the mean load 6, expert 1 always under
        update_expert_bias(chunks, fig, [[10, 2, 6, 6]])
        expected += torch.tensor([-1e-3, 1e-3, 0.0, 0.0])
    assert torch.equal(router.expert_bias, expected)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-1.0, 1.0, 0.0, 0.0]),
                               rtol=0, atol=1e-4)


def test_expert_bias_stays_fp32_in_a_bf16_run_and_its_checkpoint(tmp_path):
    from engine.training.trainer import Trainer
    from parallel.grid.launch import LaunchEnv
    argv = ["--mock-data", "--vocab-size", "64", "--no-progress", "--device", "cpu", "--bf16",
            "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--lr-warmup-iters", "0", "--num-experts", "4", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
    ckpt = tmp_path / "iter_0000003"

    def biases(trainer):
        return [m.router.expert_bias.clone() for m in trainer.chunks.modules() if hasattr(m, "router")]

    trainer = Trainer(parse_args(argv + ["--train-iters", "3", "--save", str(tmp_path)]),
                      launch=LaunchEnv())
    try:
        trainer.train()
        trained = biases(trainer)
    finally:
        trainer.close()
    assert len(trained) == 2 and all(b.dtype == torch.float32 for b in trained)
    assert all(b.abs().sum() > 0 for b in trained)  # they moved
    index = json.loads((ckpt / "index.json").read_text())
    assert index["tensors"]["model/layers.0.mlp.router.expert_bias"]["dtype"] == "float32"
    trainer = Trainer(parse_args(argv + ["--train-iters", "4", "--load", str(ckpt)]), launch=LaunchEnv())
    try:
        assert trainer.maybe_load() == 3
        loaded = biases(trainer)
    finally:
        trainer.close()
    assert all(b.dtype == torch.float32 for b in loaded)
    assert all(torch.equal(x, y) for x, y in zip(loaded, trained))


def test_balancing_losses_count_the_unbiased_choice():
    """With the expert bias the experts are chosen by scores + bias, but the aux losses count the
    top-k of the unbiased scores (DeepSeek-V3, Megatron-Core); the load keeps the biased choice."""
    e, k, b, s = 4, 2, 2, 8
    x = torch.randn(b, s, 16, generator=torch.Generator().manual_seed(0))
    for kind in ("aux_loss", "seq_aux_loss"):
        cfg = cfg_of(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_aux_loss_coeff=1.0, moe_router_load_balancing_type=kind)
        layer = MoELayer(cfg, ParallelState.serial(), LayerContext(Initializer(7, 0.5)), "layers.0.mlp")
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))  # expert 3 always chosen
        layer(x)
        sig = torch.sigmoid(x.reshape(-1, 16) @ layer.router.weight.t())        # (T, E)
        p = sig / sig.sum(-1, keepdim=True)                                       # (T, E)
        chosen = torch.zeros_like(p).scatter(1, sig.topk(k).indices, 1.0)         # (T, E) unbiased
        biased = torch.zeros_like(p).scatter(1, (sig + layer.router.expert_bias).topk(k).indices, 1.0)
        assert not torch.equal(chosen.sum(0), biased.sum(0))
        if kind == "aux_loss":
            want = (chosen.sum(0) * p.sum(0)).sum() * e / (k * (b * s) ** 2)
        else:
            want = ((chosen.view(b, s, e).sum(1) * p.view(b, s, e).sum(1)).sum(-1) * e / (k * s * s)).mean()
        torch.testing.assert_close(layer.totals.aux_loss, want, rtol=1e-6, atol=0)
        assert torch.equal(layer.totals.load, biased.sum(0))


def test_dashboards_and_summary_carry_the_moe_metrics():
    from engine.observe.dashboards import scalars
    from engine.observe.metrics import summary_table
    rec = {"step": 1, "loss": 2.0, "moe_aux_loss": 0.1, "moe_expert_load": [3, 1],
           "moe_load_imbalance": 1.5, "moe_tokens_dropped": 2, "ep_comm_bytes": 100}
    tags = scalars(rec)
    assert tags["moe/expert_load/0"] == 3.0 and tags["moe/expert_load/1"] == 1.0
    assert tags["moe/aux_loss"] == 0.1 and tags["comm/ep_comm_bytes"] == 100.0
    base = dict(lr=1e-3, grad_norm=1.0, loss_scale=1.0, skipped=False, tokens=8, step_time_s=1.0,
                tokens_per_s=8.0, tflops_per_device=None, mfu=None, hfu=None, moe_z_loss=0.0)
    records = [{**base, **rec, "step": 1}, {**base, **rec, "step": 2, "moe_expert_load": [1, 3]},
               {**base, **rec, "step": 3, "moe_expert_load": [1, 3]}]
    table = summary_table(records, {})
    assert "MoE load imbalance (max / mean)" in table and "1.500" in table  # [2, 6] over steps 2..3
    assert "MoE assignments dropped" in table and "| EP bytes per step" in table


@pytest.mark.parametrize("argv,message", [
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"],
     "--moe-expert-capacity-factor 0.0 must be > 0"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "-1.5"],
     "--moe-expert-capacity-factor -1.5 must be > 0"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
    (["--num-experts", "4", "--moe-router-enable-expert-bias"], "add --moe-router-score-function sigmoid"),
    (["--num-experts", "4", "--moe-router-bias-update-rate", "-1"], "must be >= 0"),
    (["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor configures mixture-of-experts"),
    # a factor the capacity ceil(F T K / E) cannot be computed from (it overflowed mid-step)
    (["--num-experts", "4", "--moe-expert-capacity-factor", "inf"],
     "--moe-expert-capacity-factor inf must be a finite number > 0 (leave it unset for dropless "
     "routing)"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "nan"],
     "--moe-expert-capacity-factor nan must be a finite number > 0"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1e300"],
     "--moe-expert-capacity-factor 1e+300 is above --num-experts 4: a factor of E / K = 2 already "
     "lets every expert take all the tokens (no assignment dropped); give at most 2 for no drops, "
     "or leave it unset for dropless routing"),
    (["--num-experts", "4", "--moe-router-topk", "1", "--moe-expert-capacity-factor", "4.5"],
     "give at most 4 for no drops"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "nan"],
     "--moe-aux-loss-coeff must be a finite number, got nan"),
    (["--num-experts", "4", "--moe-router-bias-update-rate", "inf"],
     "--moe-router-bias-update-rate must be a finite number, got inf"),
])
def test_bad_capacity_and_bias_flags_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_largest_capacity_factor_is_the_expert_count(tmp_path):
    """F = E is accepted (it keeps everything, padded or not); a recipe's .inf is refused as the
    flag is; the capacity itself refuses what it cannot count."""
    cfg = parse_args(["--num-experts", "4", "--moe-expert-capacity-factor", "4"]).model
    assert expert_capacity(16, 2, 4, cfg.moe_expert_capacity_factor) == 32
    recipe = tmp_path / "r.yaml"
    recipe.write_text("num_experts: 4\nmodel:\n  moe_expert_capacity_factor: .inf\n")
    with pytest.raises(ConfigError, match="^--moe-expert-capacity-factor inf must be a finite"):
        parse_args(["--config", str(recipe)])
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        expert_capacity(16, 2, 4, float("inf"))


def test_trainer_step_reads_moe_figures_with_its_one_wait():
    """Padded capacity and the expert bias: no host read in the MoE layers, so the step waits
    once (the dispatch mode's count, a CPU run's default), and the figures come with that wait;
    with an unpadded capacity too (the dropped copies sort last, static shapes)."""
    from engine.training.trainer import Trainer
    from parallel.grid.launch import LaunchEnv
    argv = ["--mock-data", "--vocab-size", "64", "--no-progress", "--host-sync-interval", "1", "--device", "cpu", "--num-layers", "2",
            "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "2",
            "--lr-warmup-iters", "0", "--num-experts", "4", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-expert-capacity-factor", "0.5",
            "--moe-aux-loss-coeff", "0.01"]
    records = []
    for pad in (["--moe-pad-expert-input-to-capacity"], []):
        trainer = Trainer(parse_args(argv + pad), launch=LaunchEnv())
        assert trainer.clock.syncs.strict
        try:
            records += trainer.train().records
        finally:
            trainer.close()
    for r in records:
        assert r["host_syncs"] == 1 and r["host_sync_points"] == ["statistics"], r["host_sync_points"]
        assert sum(r["moe_expert_load"]) == 4 * 8 * 2 * 2 and r["moe_tokens_dropped"] > 0
        assert r["moe_aux_loss"] > 0 and r["ep_comm_bytes"] == 0 and r["moe_load_imbalance"] >= 1


def test_recomputed_forwards_are_not_counted_twice():
    from models import build_chunks
    from models.moe.stats import moe_layers
    cfg = cfg_of(moe_aux_loss_coeff=0.01)
    counts = []
    for recompute in ("none", "full"):
        ctx = LayerContext(Initializer(7, 0.1), recompute=recompute)
        chunks = build_chunks(cfg, ParallelState.serial(), ctx, [range(2)], [0], 1)
        tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
        # without the early stop the recomputation runs the whole layer again
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            chunks[0](tokens[:, :-1], tokens[:, 1:]).mean().backward()
        counts.append([int(m.totals.forwards) for m in moe_layers(chunks)])
        grad = chunks[0].layers[0].mlp.router.weight.grad
        assert grad is not None and grad.abs().sum() > 0
    assert counts == [[1, 1], [1, 1]]
