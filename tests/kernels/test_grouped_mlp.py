"""The experts' grouped MLP (kernels/grouped_experts.py) against its reference, the loop.

- The one-Function path (``torch._grouped_mm`` for both projections, the backward written out):
  output and the gradients of x, both weights and both biases equal the loop's under autograd, GELU
  with biases and SwiGLU without, on uneven and empty groups, the rows' groups given or computed;
  it reads nothing on the host (the step's wait counter in strict mode) and is one autograd node.
- Unaligned widths take the composition (``grouped_linear`` twice), equal to the loop as well,
  and so does a weight whose base pointer is off 16 bytes (``weights_aligned``, on any device).
- SwiGLU's packed derivative equals autograd's of the expression, exactly.
- An expert without rows gets exactly zero weight gradient in the fused MLP, a grouped linear and
  the zero-bubble W, whatever ``torch._grouped_mm`` leaves in its block (NaN, emulating sm100).
"""
from __future__ import annotations

import importlib

import pytest
import torch

from engine.device.syncs import SyncCounter
from kernels import grouped_mlp, grouped_mlp_reference, swiglu_packed, swiglu_packed_backward

ge = importlib.import_module("kernels.grouped_experts")
gg = importlib.import_module("kernels.grouped_gemm")
HAS_GROUPED_MM = gg.torch_grouped_mm_runs("cpu", torch.float32)
COUNTS = [[5, 0, 3, 8], [0, 6, 0], [7]]  # uneven, empty first/last/middle groups, one group


def _operands(counts, kind, bias, h=16, f=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g, f_in = len(counts), f * (2 if kind == "swiglu" else 1)
    x = torch.randn(sum(counts), h, generator=gen)
    w_in, w_out = torch.randn(g, f_in, h, generator=gen), torch.randn(g, h, f, generator=gen)
    b_in = torch.randn(g, f_in, generator=gen) if bias else None
    b_out = torch.randn(g, h, generator=gen) if bias else None
    return [x, w_in, w_out, b_in, b_out]


def _run(fn, operands, seed=1):
    """Output and every operand's gradient for a fixed random output gradient."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in operands]
    y = fn(*leaves)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)))
    return y, [y.detach()] + [t.grad for t in leaves if t is not None]


def _offsets(counts) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("kind,bias", [("gelu", True), ("swiglu", False)])
def test_one_function_equals_the_loop_without_a_host_read(kind, bias):
    for counts in COUNTS:
        ops = _operands(counts, kind, bias)
        groups = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        _, want = _run(lambda x, wi, wo, bi, bo: grouped_mlp_reference(x, counts, wi, wo, kind, bi, bo),
                       ops)
        assert ge.fused_path(ops[0], ops[1], ops[2], ops[3:])
        for given in (groups, None):
            counter = SyncCounter(strict=True)
            with counter.step(), counter.watching():
                y, got = _run(lambda x, wi, wo, bi, bo: grouped_mlp(
                    x, _offsets(counts), wi, wo, kind, bi, bo, given), ops)
            assert [e.name for e in counter.last] == []
            assert type(y.grad_fn).__name__ == "_GroupedMlpForwardGroupedMlpBackwardBackward"
            for i, (a, b) in enumerate(zip(got, want)):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"{i}: {m}")


def test_unaligned_widths_take_the_composition_equal_to_the_loop():
    counts = [5, 0, 3, 8]
    ops = _operands(counts, "gelu", True, h=6)          # 24-byte rows: not torch._grouped_mm's
    assert not ge.fused_path(ops[0], ops[1], ops[2], ops[3:])
    y, got = _run(lambda x, wi, wo, bi, bo: grouped_mlp(x, _offsets(counts), wi, wo, "gelu", bi, bo),
                  ops)
    _, want = _run(lambda x, wi, wo, bi, bo: grouped_mlp_reference(x, counts, wi, wo, "gelu", bi, bo),
                   ops)
    assert type(y.grad_fn).__name__ != "_GroupedMlpForwardGroupedMlpBackwardBackward"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="kind"):
        grouped_mlp(ops[0], _offsets(counts), ops[1], ops[2], "relu")
    with pytest.raises(ValueError, match="w_out"):
        grouped_mlp(ops[0], _offsets(counts), ops[1], ops[2][:, :, :4], "gelu")


def test_swiglu_packed_backward_is_autograds_derivative():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 16, generator=gen).requires_grad_()
    grad = torch.randn(5, 3, 8, generator=gen)
    swiglu_packed(x).backward(grad)
    assert torch.equal(swiglu_packed_backward(grad, x.detach()), x.grad)
    with pytest.raises(ValueError, match="2f"):
        swiglu_packed_backward(grad, x.detach()[..., :8])


def test_bias_gradients_sum_in_fp32_and_add_no_bf16_rows_one_by_one():
    """A bias's gradient sums thousands of rows per group: in bf16 added row by row (``index_add_``
    on CUDA: one bf16 atomic add per element, rounded each time) the sum stalls at 256 times a
    term. ``group_sum`` adds the rows in fp32 and rounds once: equal to the fp32 sum rounded to
    bf16, here where that sum is exact (multiples of 2^-8), on groups of 2048 rows; and
    neither the fused MLP's backward nor a grouped linear's bias backward dispatches an
    ``index_add`` on a bf16 tensor (the CPU's own ``index_add_`` happens to accumulate widely, so
    the op is what a CPU run can see)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(-64, 65, (4096, 16), generator=gen).to(torch.bfloat16) / 256
    groups = torch.arange(4096) // 2048                                       # 2 groups of 2048
    want = torch.stack([rows[:2048].float().sum(0), rows[2048:].float().sum(0)]).to(torch.bfloat16)
    assert torch.equal(gg.group_sum(rows, groups, 2), want)
    ones = torch.ones(4096, 16, dtype=torch.bfloat16)
    assert torch.equal(gg.group_sum(ones, groups, 2), torch.full((2, 16), 2048.0, dtype=torch.bfloat16))

    class LowPrecisionIndexAdds(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "index_add" in str(func) and args[0].dtype in (torch.bfloat16, torch.float16):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))
    counts = [40, 0, 24, 32]
    operands = [None if t is None else t.to(torch.bfloat16) for t in _operands(counts, "gelu", True)]
    leaves = [t.clone().requires_grad_() for t in operands]
    with LowPrecisionIndexAdds() as mode:
        grouped_mlp(leaves[0], _offsets(counts), leaves[1], leaves[2], "gelu", leaves[3],
                    leaves[4]).sum().backward()
        x, w = leaves[0].detach(), leaves[1].detach()
        b = leaves[3].detach().clone().requires_grad_()
        gg.add_group_bias(gg.grouped_linear(x, w, _offsets(counts)), b, _offsets(counts)).sum().backward()
    assert mode.seen == [] and leaves[3].grad is not None and b.grad is not None
    assert torch.equal(b.grad, gg.group_sum(torch.ones(96, 8, dtype=torch.bfloat16),
                                            gg.row_groups(_offsets(counts), 96), 4))


def _empty_groups_nan(real):
    """``torch._grouped_mm`` as pytorch issue #172439 reports it on sm100: grouped along K (the
    weight gradient, 2-D x 2-D), a group over zero rows comes back as garbage, here NaN. The
    device's behaviour, emulated; the code under test runs as it is."""
    def grouped_mm(a, b, offs=None, **kwargs):
        out = real(a, b, offs=offs, **kwargs)
        if a.dim() == 2 and b.dim() == 2:                                   # (G, M, N)
            counts = torch.diff(offs, prepend=offs.new_zeros(1))
            out = out.masked_fill((counts == 0).view(-1, 1, 1), float("nan"))
        return out
    return grouped_mm


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("path", ["grouped_mlp", "grouped_linear", "deferred_w"])
def test_an_expert_without_rows_gets_a_zero_weight_gradient_whatever_the_kernel_leaves(
        monkeypatch, path):
    """Each bf16 weight gradient over ``torch._grouped_mm`` (the fused MLP's backward, a grouped
    linear's, a zero-bubble W's ``grouped_weight_grad``) zeroes on CUDA the blocks of the groups
    with no rows, on the device, so an expert that received no tokens gets exactly zero, not what
    the kernel wrote for a group over zero rows (NaN here, as on sm100 in the issue above). The
    CUDA rule is pointed at the CPU here, whose own kernel writes zeros (the next test)."""
    from models.moe.grouped_split import grouped_linear_defer_w
    from parallel.grads.weight_grad import WeightGradStore
    assert gg.torch_grouped_mm_runs("cpu", torch.bfloat16)                  # probed unpatched
    assert gg.MASK_EMPTY_GROUPS == {"cuda"}
    monkeypatch.setattr(gg, "MASK_EMPTY_GROUPS", frozenset({"cpu"}))
    monkeypatch.setattr(torch, "_grouped_mm", _empty_groups_nan(torch._grouped_mm))
    counts = [5, 0, 3, 8]                                                   # expert 1: no rows
    x, w_in, w_out, _, _ = (None if t is None else t.to(torch.bfloat16)
                            for t in _operands(counts, "swiglu", False))
    x, w_in, w_out = (t.requires_grad_() for t in (x, w_in, w_out))
    if path == "grouped_mlp":
        assert ge.fused_path(x, w_in, w_out)
        y = grouped_mlp(x, _offsets(counts), w_in, w_out, "swiglu")         # (n, h)
        assert type(y.grad_fn).__name__ == "_GroupedMlpForwardGroupedMlpBackwardBackward"
        y.float().square().sum().backward()
        weights = (w_in, w_out)
    elif path == "grouped_linear":
        assert gg.grouped_linear_path(x, w_in) == "torch"
        gg.grouped_linear(x, w_in, _offsets(counts)).float().square().sum().backward()
        weights = (w_in,)
    else:
        store = WeightGradStore()
        with store.capture("b"):
            grouped_linear_defer_w(x, w_in, None, _offsets(counts), store).float().square().sum() \
                .backward()
        assert w_in.grad is None and store.run("b") == 1
        weights = (w_in,)
    for w in weights:
        assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1])), (path, w.grad[1].flatten()[:4])
        assert w.grad[[0, 2, 3]].isfinite().all() and w.grad[[0, 2, 3]].abs().sum() > 0


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no CPU torch._grouped_mm")
def test_the_cpu_kernel_writes_zeros_for_a_group_over_zero_rows():
    """Why the CPU pays no mask: its torch._grouped_mm (a GEMM per group) gives an expert without
    rows an exactly zero weight gradient."""
    counts = [5, 0, 3, 8]
    x, w_in, w_out, _, _ = (None if t is None else t.to(torch.bfloat16)
                            for t in _operands(counts, "swiglu", False))
    x, w_in, w_out = (t.requires_grad_() for t in (x, w_in, w_out))
    assert ge.fused_path(x, w_in, w_out)
    grouped_mlp(x, _offsets(counts), w_in, w_out, "swiglu").float().square().sum().backward()
    for w in (w_in, w_out):
        assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))
        assert w.grad[[0, 2, 3]].abs().sum() > 0


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no CPU torch._grouped_mm")
def test_a_weight_off_16_bytes_takes_the_composition_equal_to_the_loop():
    """CUDA's torch._grouped_mm requires 16-byte aligned base pointers (the CPU's does not).
    ``weights_aligned`` checks both stacked weights' pointers on any device, so a w_out that is a
    contiguous view 2 bytes into its buffer (aligned widths) keeps ``grouped_mlp`` off the one
    Function; the composition it takes equals the loop (bf16, within its rounding)."""
    counts = [5, 0, 3, 8]
    x, w_in, w_out, _, _ = (None if t is None else t.to(torch.bfloat16)
                            for t in _operands(counts, "swiglu", False))
    def two_bytes_in(t):  # the same values, contiguous, one bf16 element into a buffer
        return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view_as(t).copy_(t)
    shifted = two_bytes_in(w_out)                                           # (G, h, f)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 2
    assert ge.weights_aligned(w_in, w_out) and ge.fused_path(x, w_in, w_out)
    assert not ge.weights_aligned(w_in, shifted)
    assert not ge.weights_aligned(two_bytes_in(w_in), w_out)
    assert not ge.fused_path(x, w_in, shifted)
    leaves = [x.clone().requires_grad_(), w_in.clone().requires_grad_(), shifted.requires_grad_()]
    y = grouped_mlp(leaves[0], _offsets(counts), *leaves[1:], "swiglu")      # (n, h)
    assert type(y.grad_fn).__name__ != "_GroupedMlpForwardGroupedMlpBackwardBackward"
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y.backward(dy)
    want = [t.clone().requires_grad_() for t in (x, w_in, w_out)]
    y_ref = grouped_mlp_reference(want[0], counts, want[1], want[2], "swiglu")
    y_ref.backward(dy)
    for a, b in zip([y] + [t.grad for t in leaves], [y_ref] + [t.grad for t in want]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=5e-2)
