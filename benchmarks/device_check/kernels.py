"""The device check's first stage: every kernel's device path against its reference.

``kernels`` dispatches on the tensor's device (npu_fusion_attention / SDPA, npu_rms_norm,
npu_rotary_mul, npu_swiglu, ...); each case runs the device path on bf16 inputs and the plain-math
reference on the same inputs in fp32, forward and backward (causal attention, grouped-query
attention and packed documents included; the MoE experts' grouped GEMM on uneven groups, one of
them empty, with its row offsets on the device, against the loop of per-group GEMMs; where the
chip has FP8, the blockwise FP8 GEMMs of ``--fp8-recipe blockwise`` on the path the run would take,
``fp8_blockwise_row``). A case
that raises (a kernel the device has no image for, say) is its own row, not ok, with the error's
last line; the other cases still run. benchmarks/device_check/ runs this in a subprocess of its
own (``python -m benchmarks.device_check --stage kernels``) under a deadline.
"""
from __future__ import annotations

import torch

import kernels
from kernels.attention_lse import attention_lse, attention_lse_backward, block_path, merge_partial
from kernels.grouped_gemm import grouped_linear_path

# (forward, gradient) tolerances on low-precision inputs against the fp32 reference
TOLERANCE = {torch.bfloat16: (3e-2, 6e-2), torch.float16: (5e-3, 1e-2), torch.float32: (1e-4, 1e-4)}


class _TwoBlocks(torch.autograd.Function):
    """Causal attention computed as ring attention computes it on one rank: key/value blocks of
    half the sequence, partial results merged by log-sum-exp, each block's backward with the merged
    out and lse (kernels.attention_lse on the device's block kernel)."""

    @staticmethod
    def _steps(s):
        h = s // 2
        return [(slice(0, h), slice(0, h), True), (slice(h, s), slice(0, h), False),
                (slice(h, s), slice(h, s), True)]

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
        for qs, ks, causal in _TwoBlocks._steps(q.shape[2]):
            o, l = attention_lse(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal)
            out[:, :, qs], lse[:, :, qs] = merge_partial(out[:, :, qs], lse[:, :, qs], o, l)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
        for qs, ks, causal in _TwoBlocks._steps(q.shape[2]):
            gq, gk, gv = attention_lse_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                                out[:, :, qs], lse[:, :, qs], causal)
            grads[0][:, :, qs] += gq.float()
            grads[1][:, :, ks] += gk.float()
            grads[2][:, :, ks] += gv.float()
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def kernel_cases(device: torch.device, dtype: torch.dtype, seq: int = 512):
    """(name, device-path fn, reference fn, inputs): the ops at a training-like size."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    b, n, d, ffn = 2, 8, 64, 1408
    h = n * d
    cos, sin = kernels.rope_cos_sin(seq, d, device=device, dtype=dtype)
    docs = torch.zeros(b, seq, dtype=torch.int32)
    docs[:, seq // 3:] = 1
    docs[1, 2 * seq // 3:] = 2
    docs = docs.to(device)
    unit = b * seq // 16  # 2 x seq rows over 8 experts, unevenly
    counts = [3 * unit, 0, unit, 5 * unit, 2 * unit, unit, 3 * unit, unit]
    offsets = torch.tensor(counts).cumsum(0).to(device=device, dtype=torch.int32)
    return [
        ("attention causal", kernels.attention, kernels.attention_reference,
         [rand(b, n, seq, d), rand(b, n, seq, d), rand(b, n, seq, d)]),
        ("attention GQA (8 q / 2 kv heads)", kernels.attention, kernels.attention_reference,
         [rand(b, n, seq, d), rand(b, 2, seq, d), rand(b, 2, seq, d)]),
        ("attention packed documents",
         lambda q, k, v: kernels.attention(q, k, v, document_ids=docs),
         lambda q, k, v: kernels.attention_reference(q, k, v, document_ids=docs),
         [rand(b, n, seq, d), rand(b, n, seq, d), rand(b, n, seq, d)]),
        ("ring_block attention (two blocks merged, GQA)", _TwoBlocks.apply, kernels.attention_reference,
         [rand(b, n, seq, d), rand(b, 2, seq, d), rand(b, 2, seq, d)]),
        ("layer_norm", kernels.layer_norm, kernels.layer_norm_reference,
         [rand(b, seq, h), rand(h), rand(h)]),
        ("rms_norm", kernels.rms_norm, kernels.rms_norm_reference, [rand(b, seq, h), rand(h)]),
        ("rope", lambda x: kernels.apply_rope(x, cos, sin),
         lambda x: kernels.apply_rope_reference(x, cos, sin), [rand(b, n, seq, d)]),
        ("swiglu", kernels.swiglu, kernels.swiglu_reference, [rand(b, seq, ffn), rand(b, seq, ffn)]),
        ("grouped_gemm (8 experts, uneven, one empty)",
         lambda x, w, bias: kernels.grouped_linear(x, w, offsets, bias),
         lambda x, w, bias: kernels.grouped_linear_reference(x, w, counts, bias),
         [rand(sum(counts), h), rand(8, ffn, h) * h ** -0.5, rand(8, ffn)]),
    ]


def path_taken(name: str, inputs: list, documented: str) -> str:
    """The path the case's device function takes on these inputs where it chooses at run time
    (the ring's block kernels, the grouped GEMM), else ``documented`` (the device's)."""
    if name.startswith("ring_block"):
        q, k, _ = inputs
        taken = {block_path(q[:, :, qs], None, None, causal, k[:, :, ks].shape[2])
                 for qs, ks, causal in _TwoBlocks._steps(q.shape[2])}
        return " + ".join(sorted(taken))
    if name.startswith("grouped_gemm"):
        return grouped_linear_path(inputs[0], inputs[1])
    return documented


def _run(fn, inputs, up):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(up.to(out.dtype))
    return out.detach().float(), [x.grad.float() for x in leaves]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(1, max |b|)"""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1.0))


FP8_TOLERANCE = 0.1   # max error over max |exact|: e4m3's rounding (3 mantissa bits) of both operands


def fp8_blockwise_row(device: torch.device, seq: int = 512) -> dict:
    """The three blockwise FP8 GEMMs of a 1024-wide linear (kernels/fp8_blockwise.py: the fused
    kernel where the start-up probe agrees, else one rowwise FP8 GEMM per 128-wide tile) against
    the exact fp32 products of the same bf16 operands, ``graded_operands`` (tiles 2^18 apart, so a
    scale read for another tile flushes or saturates it), each result judged per 128 x 128 block
    against the block's largest element (``block_error``): forward is the forward GEMM's error,
    gradient the larger of the input and weight gradients'."""
    from kernels import fp8_blockwise as bw
    row = {"op": "fp8 blockwise GEMMs (1x128 / 128x128)",
           "path": "fused" if bw.fused_blockwise_runs(device.type) else "per 128-wide tile",
           "forward": None, "gradient": None, "tolerance": [FP8_TOLERANCE, FP8_TOLERANCE],
           "ok": False}
    try:
        x, w, dy = bw.graded_operands(seq, 1024, device)
        x2, dy2, wf = x.float()[0], dy.float()[0], w.float()
        sw = bw.block_scales(w)
        fwd = bw.block_error(bw.linear(x, w, sw)[0], x2 @ wf.t())
        grad = max(bw.block_error(bw.dgrad(dy, w, sw)[0], dy2 @ wf),
                   bw.block_error(bw.wgrad(dy, x, torch.bfloat16), dy2.t() @ x2))  # as training
        row.update(forward=fwd, gradient=grad, ok=fwd <= FP8_TOLERANCE and grad <= FP8_TOLERANCE)
    except Exception as exc:  # noqa: BLE001 - the row says what it raised
        row["error"] = f"{type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[-1][:200]
    return row


def check_kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                  seq: int = 512, fp8: bool = True) -> list[dict]:
    """Each case's forward and gradient error of the device path against the reference; with
    ``fp8`` (a chip with FP8, or the CPU) the blockwise FP8 row last."""
    fwd_tol, grad_tol = TOLERANCE[dtype]
    paths = kernels.kernel_paths(device.type)
    rows = []
    for name, fused, ref, inputs in kernel_cases(device, dtype, seq):
        row = {"op": name, "path": paths.get(name.split(" ")[0], "-"), "forward": None,
               "gradient": None, "tolerance": [fwd_tol, grad_tol], "ok": False}
        try:
            row["path"] = path_taken(name, inputs, row["path"])
            with torch.no_grad():
                shape = fused(*inputs).shape
            up = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
            out, grads = _run(fused, inputs, up)
            ref_out, ref_grads = _run(ref, [x.float() for x in inputs], up)
            fwd = _err(out, ref_out)
            grad = max(_err(a, b) for a, b in zip(grads, ref_grads))
            row.update(forward=fwd, gradient=grad, ok=fwd <= fwd_tol and grad <= grad_tol)
        except Exception as exc:  # noqa: BLE001 - the case's row says what it raised
            row["error"] = f"{type(exc).__name__}: " + \
                (str(exc).strip().splitlines() or [""])[-1][:200]
        rows.append(row)
    if fp8:
        rows.append(fp8_blockwise_row(device, seq))
    return rows
