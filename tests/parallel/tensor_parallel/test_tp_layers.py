"""parallel/tensor_parallel layers and the vocab-parallel cross-entropy against their serial
equivalents on gloo groups of 2 and 4 ranks: outputs, input gradients and parameter gradients
(shards gathered and compared with the serial gradient).

Each TP layer is built twice on every rank: sharded (the ParallelState of the group) and serial
(ParallelState.serial(), same initializer and names). Layout-independent initialization makes the
shard equal the slice of the serial weight, which is asserted first; the serial biases are then
randomized and copied to the shards so that biases are exercised too.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.grid.state import ParallelState
from parallel.tensor_parallel import (ColumnParallelLinear, Initializer, RowParallelLinear,
                                      VocabParallelEmbedding, padded_vocab_size,
                                      vocab_parallel_cross_entropy)
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import gather_tensors, run_distributed
from tests.parallel.tensor_parallel.test_tp_mappings import tp_states

TOL = dict(rtol=1e-5, atol=1e-6)
INIT = Initializer(seed=7, std=0.5)


# ---- helpers shared with test_tp_model -------------------------------------------------------
def split_dim(local: torch.Tensor, serial: torch.Tensor) -> int:
    """The one dim along which a TP shard differs from the serial tensor."""
    dims = [d for d in range(local.dim()) if local.shape[d] != serial.shape[d]]
    assert len(dims) == 1, f"shard {tuple(local.shape)} vs serial {tuple(serial.shape)}"
    return dims[0]


def gather_shards(local: torch.Tensor, serial: torch.Tensor, group) -> torch.Tensor:
    """Concatenate the TP shards of ``local`` along the split dim. Vocabulary weights come back
    padded for this tp (which may differ from the serial padding): the caller trims them."""
    return torch.cat(gather_tensors(group, local), dim=split_dim(local, serial))


def full_tensor(local: torch.Tensor, serial: torch.Tensor, param, ps: ParallelState,
                vocab_size: int | None, summed: bool) -> torch.Tensor:
    """What the serial model holds for a parameter (or its gradient) of a TP module.

    Sharded tensors are gathered (vocabulary rows trimmed to ``vocab_size`` after checking that
    padding rows are zero); sequence-parallel replicated gradients are summed over TP when
    ``summed`` is False (i.e. the caller has not synchronized them yet).
    """
    if getattr(param, "tp_sharded", False) and ps.tp_size > 1:
        full = gather_shards(local, serial, ps.tp_group)
        if full.shape != serial.shape:  # padded vocabulary rows
            assert vocab_size is not None and full.shape[1:] == serial.shape[1:]
            assert torch.count_nonzero(full[vocab_size:]) == 0, "padding rows must stay zero"
            assert torch.count_nonzero(serial[vocab_size:]) == 0
            return full[:vocab_size]
        return full
    if getattr(param, "sequence_parallel", False) and not summed and ps.tp_size > 1:
        local = local.clone()
        ps.tp_group.all_reduce(local)
    return local


def compare_params(tp_mod, serial_mod, ps, vocab_size=None, grads=True, summed=False, **tol):
    """Every parameter (or its gradient) of ``tp_mod`` equals the serial module's after gathering."""
    tol = tol or TOL
    serial = dict(serial_mod.named_parameters())
    for name, p in tp_mod.named_parameters():
        q = serial[name]
        a, b = (p.grad, q.grad) if grads else (p.detach(), q.detach())
        assert a is not None and b is not None, f"{name}: missing gradient"
        full = full_tensor(a, b, p, ps, vocab_size, summed)
        if full.shape != b.shape:
            b = b[:vocab_size]
        torch.testing.assert_close(full, b, **tol, msg=lambda m: f"{name}: {m}")


def _copy_biases_from_serial(tp_mod, serial_mod, ps, seed):
    """Give every bias a random value (serial), and the TP module the matching slice."""
    gen = torch.Generator().manual_seed(seed)
    serial = dict(serial_mod.named_parameters())
    with torch.no_grad():
        for name, p in tp_mod.named_parameters():
            if not name.endswith("bias"):
                continue
            full = serial[name]
            full.copy_(torch.randn(full.shape, generator=gen))
            p.copy_(full.chunk(ps.tp_size)[ps.tp_rank] if getattr(p, "tp_sharded", False) else full)


def _run(mod, x, grad_weight):
    """Forward, backward of sum(y * grad_weight); returns y and x's gradient."""
    x = x.clone().requires_grad_(x.is_floating_point())
    y = mod(x)
    (y * grad_weight).sum().backward()
    return y.detach(), x.grad


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- checks run on each rank -------------------------------------------------------------------
def _check_column(ps: ParallelState, b=2, s=8, h_in=16, h_out=24):
    n, r = ps.tp_size, ps.tp_rank
    x, gw = _full(10, b, s, h_in), _full(11, b, s, h_out)
    for sp in (False, True):
        for gather in (False, True):
            serial = ColumnParallelLinear(h_in, h_out, ParallelState.serial(), "col", INIT)
            mod = ColumnParallelLinear(h_in, h_out, ps, "col", INIT, gather_output=gather,
                                       sequence_parallel=sp)
            assert mod.weight.shape == (h_out // n, h_in) and mod.weight.tp_sharded
            compare_params(mod, serial, ps, grads=False, rtol=0, atol=0)
            _copy_biases_from_serial(mod, serial, ps, seed=12)
            y_ref, gx_ref = _run(serial, x, gw)
            x_in = x.chunk(n, dim=1)[r] if sp else x
            out_w = gw if gather else gw.chunk(n, dim=-1)[r]
            y, gx = _run(mod, x_in, out_w)
            want_y = y_ref if gather else y_ref.chunk(n, dim=-1)[r]
            assert y.shape == want_y.shape, (sp, gather, y.shape)
            torch.testing.assert_close(y, want_y, **TOL)
            torch.testing.assert_close(gx, gx_ref.chunk(n, dim=1)[r] if sp else gx_ref, **TOL)
            compare_params(mod, serial, ps)


def _check_row(ps: ParallelState, b=2, s=8, h_in=24, h_out=16):
    n, r = ps.tp_size, ps.tp_rank
    x, gw = _full(20, b, s, h_in), _full(21, b, s, h_out)
    for sp in (False, True):
        serial = RowParallelLinear(h_in, h_out, ParallelState.serial(), "row", INIT)
        mod = RowParallelLinear(h_in, h_out, ps, "row", INIT, sequence_parallel=sp)
        assert mod.weight.shape == (h_out, h_in // n) and mod.weight.tp_sharded
        assert getattr(mod.bias, "sequence_parallel", False) == sp
        assert not getattr(mod.bias, "tp_sharded", False)
        compare_params(mod, serial, ps, grads=False, rtol=0, atol=0)
        _copy_biases_from_serial(mod, serial, ps, seed=22)
        y_ref, gx_ref = _run(serial, x, gw)
        y, gx = _run(mod, x.chunk(n, dim=-1)[r], gw.chunk(n, dim=1)[r] if sp else gw)
        torch.testing.assert_close(y, y_ref.chunk(n, dim=1)[r] if sp else y_ref, **TOL)
        torch.testing.assert_close(gx, gx_ref.chunk(n, dim=-1)[r], **TOL)
        compare_params(mod, serial, ps)  # the SP bias gradient is summed over TP here


def _check_embedding(ps: ParallelState, vocab: int, b=2, s=8, h=16):
    n, r = ps.tp_size, ps.tp_rank
    per_rank = padded_vocab_size(vocab, n) // n
    edges = [0, vocab - 1] + [k * per_rank + d for k in range(1, n) for d in (-1, 0)]
    edges = [t for t in edges if t < vocab]  # first/last token and both sides of each shard edge
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(30))
    tokens.view(-1)[: len(edges)] = torch.tensor(edges)
    gw = _full(31, b, s, h)
    for sp in (False, True):
        serial = VocabParallelEmbedding(vocab, h, ParallelState.serial(), "emb", INIT)
        mod = VocabParallelEmbedding(vocab, h, ps, "emb", INIT, sequence_parallel=sp)
        assert mod.weight.shape == (padded_vocab_size(vocab, n) // n, h)
        compare_params(mod, serial, ps, vocab_size=vocab, grads=False, rtol=0, atol=0)
        y_ref, _ = _run(serial, tokens, gw)
        y, _ = _run(mod, tokens, gw.chunk(n, dim=1)[r] if sp else gw)
        torch.testing.assert_close(y, y_ref.chunk(n, dim=1)[r] if sp else y_ref, **TOL)
        compare_params(mod, serial, ps, vocab_size=vocab)  # padding rows' grads are zero


def _check_cross_entropy(ps: ParallelState, vocab: int, b=2, s=8):
    n, r = ps.tp_size, ps.tp_rank
    padded = padded_vocab_size(vocab, n)
    per_rank = padded // n
    logits = _full(40, b, s, padded) * 3
    target = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(41))
    edges = [0, vocab - 1] + [k * per_rank + d for k in range(1, n) for d in (-1, 0)]
    edges = [t for t in edges if t < vocab]
    target.view(-1)[: len(edges)] = torch.tensor(edges)
    target.view(-1)[-1] = -100      # torch's ignore_index: loss 0, no gradient, on every layout
    weight = _full(42, b, s)

    ref_in = logits[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, vocab), target.reshape(-1), reduction="none")
    (ref * weight.reshape(-1)).sum().backward()
    ref_grad = torch.cat([ref_in.grad, torch.zeros(b, s, padded - vocab)], dim=-1)

    variants = [("serial", None, 0, logits)]  # padding handled without a group too
    variants.append(("tp", ps.tp_group, r * per_rank, logits.chunk(n, dim=-1)[r]))
    for label, group, start, local in variants:
        for junk in (0.0, 50.0):  # whatever sits in padding logits changes nothing
            inp = local.clone()
            ids = torch.arange(start, start + inp.shape[-1])
            inp[..., ids >= vocab] = junk
            inp.requires_grad_(True)
            loss = vocab_parallel_cross_entropy(inp, target, group, start, vocab)
            assert loss.shape == (b, s) and loss.dtype == torch.float32
            (loss * weight).sum().backward()
            torch.testing.assert_close(loss.detach(), ref.detach().view(b, s), **TOL,
                                       msg=lambda m: f"{label} loss, padding={junk}: {m}")
            want = ref_grad if group is None else ref_grad.chunk(n, dim=-1)[r]
            torch.testing.assert_close(inp.grad, want, **TOL,
                                       msg=lambda m: f"{label} grad, padding={junk}: {m}")
            assert torch.count_nonzero(inp.grad[..., ids >= vocab]) == 0

    # bf16 logits: fp32 loss, gradient handed back in bf16
    inp = logits.chunk(n, dim=-1)[r].to(torch.bfloat16).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(inp, target, ps.tp_group, r * per_rank, vocab)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and inp.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.detach(), ref.detach().view(b, s), rtol=2e-2, atol=2e-2)


def check_layers(ps: ParallelState) -> str:
    for sub in tp_states(ps).values():
        _check_column(sub)
        _check_row(sub)
        for vocab in (300, 512):  # 300 pads to a multiple of 128*tp; 512 needs no padding
            _check_embedding(sub, vocab)
            _check_cross_entropy(sub, vocab)
    return "ok"


def test_layers_and_cross_entropy_tp2_and_tp4():
    assert run_distributed(check_layers, grid=RankGrid(tp=4)) == ["ok"] * 4


def test_padded_vocab_size():
    assert padded_vocab_size(300, 1) == 384
    assert padded_vocab_size(300, 2) == 512
    assert padded_vocab_size(512, 4) == 512
    assert padded_vocab_size(513, 4) == 1024


def test_indivisible_shapes_fail_with_the_size_to_change():
    ps = ParallelState(RankGrid(tp=4, dp=1))  # construction needs no process group
    with pytest.raises(ValueError, match=r"col output size \(30\) is not divisible by tp=4"):
        ColumnParallelLinear(16, 30, ps, "col", INIT)
    with pytest.raises(ValueError, match=r"row input size \(30\) is not divisible by tp=4"):
        RowParallelLinear(30, 16, ps, "row", INIT)


def test_cross_entropy_without_tp_equals_the_vocab_parallel_function():
    """One rank holds the whole (padded) vocabulary: the fused ``F.cross_entropy`` path gives the
    loss and logit gradients of the vocabulary-parallel Function run on that one rank, padding
    columns' gradient exactly 0, in fp32 and from bf16 logits."""
    from parallel.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy
    torch.manual_seed(0)
    vocab, padded = 500, padded_vocab_size(500, 1)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (3 * torch.randn(2, 16, padded)).to(dtype)
        target = torch.randint(0, vocab, (2, 16))
        target[0, 0] = vocab - 1  # the last real entry
        fused = logits.clone().requires_grad_()
        ref = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(fused, target, None, 0, vocab)
        want = _VocabParallelCrossEntropy.apply(ref, target, None, 0, vocab)
        assert loss.dtype == want.dtype == torch.float32 and loss.shape == (2, 16)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        weights = torch.rand(2, 16)
        (loss * weights).sum().backward()
        (want * weights).sum().backward()
        assert fused.grad.dtype == dtype
        torch.testing.assert_close(fused.grad.float(), ref.grad.float(), rtol=1e-5, atol=1e-6)
        assert torch.count_nonzero(fused.grad[..., vocab:]) == 0
