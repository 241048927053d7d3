"""Data-parallel reducer and ZeRO-1 on real gloo groups, checked against serial computations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallel.runtime.comm_monitor import wire_bytes
from parallel.dp import DistributedOptimizer, GradReducer, MixedPrecisionOptimizer
from parallel.grads.norm import global_grad_norm
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import record_comm, run_distributed

VOCAB, BATCH, SEQ = 11, 8, 5


class Toy(nn.Module):
    """A tiny GPT-shaped model whose parameter names match the compression policy patterns."""

    def __init__(self, d: int = 8, h: int = 24):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.attn = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens, targets):          # (b, s), (b, s)
        x = self.embed(tokens)                   # (b, s, d)
        x = x + self.attn(x)
        x = x + self.mlp(self.norm(x))
        logits = self.head(x).float()            # (b, s, v)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(dtype=torch.float32) -> Toy:
    torch.manual_seed(0)
    return Toy().to(dtype)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def micro_slices(dp: int, rank: int, m: int) -> list[slice]:
    per = BATCH // dp
    return [slice(rank * per + i * per // m, rank * per + (i + 1) * per // m) for i in range(m)]


def groups(model: nn.Module, wd: float = 0.1) -> list[dict]:
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim > 1]
    rest = [(n, p) for n, p in model.named_parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def backward_step(model, reducer, step: int, dp: int, rank: int, m: int, flag: str = "last") -> None:
    """Run this rank's micro-batches; check that only the last one communicates."""
    tokens, targets = batch(step)
    slices = micro_slices(dp, rank, m)
    if flag == "count":
        reducer.set_num_microbatches(m)
    for i, sl in enumerate(slices):
        if flag == "last":
            reducer.set_last_microbatch(i == m - 1)
        (model(tokens[sl], targets[sl]) / m).backward()
        if i < m - 1:
            assert reducer.stats()["calls"] == 0 and reducer.num_launched == 0
    reducer.finish()


def serial_grads(step: int) -> dict[str, torch.Tensor]:
    model = make_model()
    model(*batch(step)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def lr_at(step: int) -> float:
    return 0.02 / step


def check_reducer(ps: ParallelState) -> None:
    dp, rank = ps.dp_size, ps.dp_rank
    for flag, overlap in (("last", True), ("count", True), ("last", False)):
        model = make_model()
        reducer = GradReducer(model, ps, bucket_size_mb=200 * 4 / 2 ** 20, overlap=overlap)
        assert len(reducer.buckets) >= 3
        assert reducer.buckets[0].slots[0].name == "head.bias"      # backward order
        for step in (1, 2):                                          # zero_grad between steps
            reducer.zero_grad()
            backward_step(model, reducer, step, dp, rank, m=2, flag=flag)
            reference = serial_grads(step)
            for name, p in model.named_parameters():
                # fp32: autograd accumulated into the buffer itself (grad is the main_grad view)
                assert p.grad is p.main_grad and p.main_grad.dtype == torch.float32
                torch.testing.assert_close(p.main_grad, reference[name], rtol=1e-5, atol=1e-7)
            expected = sum(wire_bytes("all_reduce", b.numel * 4, dp) for b in reducer.buckets)
            assert reducer.stats()["calls"] == len(reducer.buckets)
            assert reducer.stats()["wire_bytes"] == expected > 0
            assert reducer.stats()["payload_bytes"] == sum(b.numel * 4 for b in reducer.buckets)
        reducer.remove_hooks()


def check_overlap_launch(ps: ParallelState) -> None:
    """With overlap every bucket is launched before backward returns; an unused parameter is
    reduced by finish()."""
    model = make_model()
    reducer = GradReducer(model, ps, bucket_size_mb=200 * 4 / 2 ** 20)
    tokens, targets = batch(1)
    reducer.set_last_microbatch(True)
    model(tokens, targets).backward()
    assert reducer.num_launched == len(reducer.buckets)
    reducer.finish()
    with pytest.raises(RuntimeError, match="zero_grad"):
        model(tokens, targets).backward()

    model = make_model()
    model.spare = nn.Parameter(torch.ones(5))
    reducer = GradReducer(model, ps, bucket_size_mb=200 * 4 / 2 ** 20)
    backward_step(model, reducer, 1, ps.dp_size, ps.dp_rank, m=1)
    reference = serial_grads(1)
    assert reducer.stats()["calls"] == len(reducer.buckets)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.main_grad, reference.get(name, torch.zeros(5)), rtol=1e-5, atol=1e-7)


def train(ps, sharded: bool, steps: int, dtype=torch.float32):
    model = make_model(dtype)
    reducer = GradReducer(model, ps, bucket_size_mb=300 * 4 / 2 ** 20)
    cls = DistributedOptimizer if sharded else MixedPrecisionOptimizer
    opt = cls(groups(model), reducer, ps, lr=0.0, betas=(0.9, 0.95), eps=1e-8)
    norms = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        backward_step(model, reducer, step, ps.dp_size, ps.dp_rank, m=2)
        norms.append(opt.clip_grad_norm(0.5))
        opt.step(lr_at(step))
    return model, opt, reducer, norms


def serial_train(steps: int):
    model = make_model()
    opt = torch.optim.AdamW(groups(model), lr=0.0, betas=(0.9, 0.95), eps=1e-8)
    norms = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(*batch(step)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
    return model, norms


def assemble(ps, sd: dict) -> dict:
    """Full per-parameter flat tensors from every DP rank's ZeRO pieces; each value exactly once."""
    as_lists = {**sd, "state": {n: {k: t.tolist() for k, t in st.items()} for n, st in sd["state"].items()}}
    all_sd = ps.dp_group.all_gather_object(as_lists)   # (object collectives carry no tensors)
    full, seen = {}, {}
    for rank_sd in all_sd:
        for piece in rank_sd["pieces"]:
            name, n = piece["name"], torch.Size(piece["shape"]).numel()
            seen.setdefault(name, torch.zeros(n, dtype=torch.int32))[piece["start"]:piece["end"]] += 1
            for key, t in rank_sd["state"][name].items():
                full.setdefault(name, {}).setdefault(key, torch.zeros(n))[piece["start"]:piece["end"]] = \
                    torch.tensor(t)
    assert all(bool((c == 1).all()) for c in seen.values())
    return {"step": all_sd[0]["step"], "state": full}


def check_zero(ps: ParallelState) -> None:
    steps = 4
    plain, plain_opt, _, plain_norms = train(ps, sharded=False, steps=steps)
    zero, zero_opt, zero_red, zero_norms = train(ps, sharded=True, steps=steps)
    serial, serial_norms = serial_train(steps)
    for (name, a), b, s in zip(plain.named_parameters(), zero.parameters(), serial.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"ZeRO vs AdamW differ at {name}")
        torch.testing.assert_close(a, s, rtol=0, atol=1e-5, msg=f"DP vs serial differ at {name}")
    assert zero_norms == pytest.approx(plain_norms, rel=1e-6)
    # model parameters carry their ZeRO shard, so a model-wide norm needs no optimizer at hand
    assert global_grad_norm(list(zero.parameters()), ps) == \
        pytest.approx(global_grad_norm(list(plain.parameters()), ps), rel=1e-6)
    assert plain_norms == pytest.approx(serial_norms, rel=1e-5)
    # one ZeRO step's DP traffic: a reduce-scatter per bucket during backward, the norm's scalar,
    # an all-gather of the updated shard per bucket in forward order (the last bucket first);
    # payload = the tensors handed over
    with record_comm(ps) as events:
        train(ps, sharded=True, steps=1)
    dp_events = [(e.op, e.payload_bytes, e.wire_bytes) for e in events if e.group == "dp"]
    n, dp = len(zero_red.buckets), ps.dp_size
    assert dp_events[:n] == [("reduce_scatter", b.numel * 4, wire_bytes("reduce_scatter", b.numel * 4, dp))
                             for b in zero_red.buckets]
    assert dp_events[n] == ("all_reduce", 4, wire_bytes("all_reduce", 4, dp))      # the norm
    assert dp_events[n + 1:] == [("all_gather", b.numel // dp * 4, (dp - 1) * b.numel // dp * 4)
                                 for b in reversed(zero_red.buckets)]

    # optimizer state: the shards together equal the non-sharded state, and reload anywhere
    full = assemble(ps, zero_opt.state_dict())
    plain_sd = plain_opt.state_dict()
    assert full["step"] == plain_sd["step"] == steps
    for name, entry in plain_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full["state"][name][key], entry[key], rtol=1e-5, atol=1e-8)
        assert "master" not in full["state"][name]       # fp32: the parameter shard is the master
    fresh_model = make_model()
    fresh = DistributedOptimizer(groups(fresh_model), GradReducer(fresh_model, ps, 300 * 4 / 2 ** 20), ps)
    with torch.no_grad():   # as a checkpoint loads: the weights first (fp32: they are the masters)
        for a, b in zip(fresh_model.parameters(), zero.parameters()):
            a.copy_(b)
    fresh.load_state_dict(full)
    assert torch.equal(fresh.master.flat(), zero_opt.master.flat())   # (views of the params)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(fresh, key), getattr(zero_opt, key))
    assert fresh.step_count == steps

    # low-precision parameters: fp32 main grads and masters, params are the cast masters
    model, opt, _, _ = train(ps, sharded=True, steps=2, dtype=torch.bfloat16)
    for piece in opt.pieces:
        assert piece.param.dtype == torch.bfloat16 and piece.param.main_grad.dtype == torch.float32
        sl = slice(piece.shard_offset, piece.shard_offset + piece.end - piece.start)
        assert torch.equal(piece.param.detach().reshape(-1)[piece.start:piece.end],
                           opt.master[sl].to(torch.bfloat16))


def all_checks(ps: ParallelState) -> bool:
    check_reducer(ps)
    check_overlap_launch(ps)
    check_zero(ps)
    return True


@pytest.mark.parametrize("dp", [2, 4])
def test_reducer_and_zero_on_gloo(dp):
    assert all(run_distributed(all_checks, grid=RankGrid(dp=dp)))


def test_serial_reducer_has_no_collectives_and_matches_adamw():
    ps = ParallelState.serial()
    model, opt, reducer, norms = train(ps, sharded=False, steps=3)
    assert reducer.stats() == {"calls": 0, "payload_bytes": 0, "wire_bytes": 0}
    serial, serial_norms = serial_train(3)
    zero, _, zero_red, _ = train(ps, sharded=True, steps=3)
    assert zero_red.stats()["calls"] == 0
    for a, b, s in zip(model.parameters(), zero.parameters(), serial.parameters()):
        torch.testing.assert_close(a, s, rtol=0, atol=1e-6)
        torch.testing.assert_close(b, s, rtol=0, atol=1e-6)
    assert norms == pytest.approx(serial_norms, rel=1e-6)


def test_mixed_precision_state_dict_round_trip():
    ps = ParallelState.serial()
    model, opt, _, _ = train(ps, sharded=False, steps=2, dtype=torch.bfloat16)
    sd = opt.state_dict()
    assert sd["step"] == 2 and all("master" in e for e in sd["state"].values())
    other = make_model(torch.bfloat16)
    fresh = MixedPrecisionOptimizer(groups(other), GradReducer(other, ps), ps)
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["step"] == 2
    for a, b in zip(opt.masters, fresh.masters):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_compressed_buffers_keep_tp_identical_gradients_apart():
    """Under compression a weight whose gradient is the same on every TP rank (a position table),
    a TP shard and a partial (sequence_parallel) gradient never share a buffer: a compressor's
    choices depend on its whole bucket, so a mixed one would drift the copies apart over TP (and a
    partial bucket's refreshed variance is summed over TP)."""
    from parallel.dp import CompressionPolicy
    from parallel.dp.layout import build_buffers

    def params():
        shard, pos, norm = (torch.nn.Parameter(torch.zeros(8)) for _ in range(3))
        shard.tp_sharded, norm.sequence_parallel = True, True
        return [("layers.0.fc1.weight", shard), ("embedding.position", pos),
                ("layers.0.norm.weight", norm)]

    def members(policy):
        buffers, _ = build_buffers(params(), CompressionPolicy.from_dict(policy), torch.float32,
                                   1 << 20, 1)
        return sorted(sorted(n for n, _ in b.named_params) for b in buffers)

    assert members({"default": "topk"}) == [["embedding.position"], ["layers.0.fc1.weight"],
                                            ["layers.0.norm.weight"]]
    assert members(None) == [["embedding.position", "layers.0.fc1.weight",
                              "layers.0.norm.weight"]]   # uncompressed: the layout as it was
