"""A stand-in for torch_npu on machines without an NPU: each function implements the formula and
the input requirements that the torch_npu documentation states, so an NPU branch of kernels/ can
run end to end on the CPU. It is never the code under test: the kernels' argument preparation is.

    fake = install_fake_npu(monkeypatch)   # torch_npu -> FakeTorchNpu, kernels dispatch to "npu"
"""
from __future__ import annotations

import importlib
import sys

import torch

KERNEL_MODULES = ("kernels.attention", "kernels.attention_lse", "kernels.grouped_gemm", "kernels.norms",
                  "kernels.rope", "kernels.swiglu")
COMPRESSED_CAUSAL = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
VARLEN_MAX_SEGMENTS = 1024  # documented maximum length of actual_seq_qlen in the TND layout


def _scores(q, k, scale, masked):
    """Masked scaled scores (n, sq, skv) in fp32; query head i reads key head i // (n / n_kv)."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    return scores if masked is None else scores.masked_fill(masked, float("-inf"))


def _softmax_stats(scores):
    """Row max and sum of exp(scores - max), as the kernel keeps them. A fully masked row's values
    are not documented: this stand-in leaves max 0 and sum 1 there (lse 0, a finite wrong value),
    so code that relies on them for such rows fails its tests."""
    mx = scores.amax(-1)
    empty = torch.isinf(mx)
    mx = torch.where(empty, torch.zeros_like(mx), mx)
    total = torch.exp(scores - mx.unsqueeze(-1)).sum(-1)
    return mx, torch.where(empty, torch.ones_like(total), total), empty


def _scores_attention(q, k, v, scale, masked, stats=False):
    """q (n, sq, d), k and v (n_kv, skv, d): query head i reads key/value head i // (n / n_kv)."""
    scores = _scores(q, k, scale, masked)
    mx, total, empty = _softmax_stats(scores)
    v = v.repeat_interleave(q.shape[0] // v.shape[0], 0)
    probs = torch.exp(scores - mx.unsqueeze(-1)) / total.unsqueeze(-1)
    out = probs.masked_fill(empty.unsqueeze(-1), 0.0) @ v.float()
    return (out, mx, total) if stats else out


def _repeat8(t):
    return t.unsqueeze(-1).expand(*t.shape, 8).contiguous()


NO_BAND = 2147483647   # pre_tockens / next_tockens defaults: no band


def _block_mask(sparse_mode, atten_mask, sq, skv, batch, pre=NO_BAND, nxt=NO_BAND):
    """The (sq, skv) or (1, sq, skv) masked-out pattern of BNSD/BSND calls for batch row ``batch``.
    sparse_mode 0 also masks outside the band j - i <= next_tockens, i - j <= pre_tockens, and
    holds the documented rule that the mask and the band agree: a mask holding the causal
    triangle needs next_tockens 0 and pre_tockens >= Sq ("next_tockens取值为0，pre_tockens大于等于
    Sq"; otherwise "参数取值与atten_mask分布不一致会导致精度问题")."""
    if sparse_mode == 2:  # leftUpCausal: the fixed compressed mask, pattern independent of it
        assert atten_mask.dtype == torch.bool and torch.equal(atten_mask, COMPRESSED_CAUSAL)
        return torch.arange(skv)[None, :] > torch.arange(sq)[:, None]
    assert sparse_mode == 0
    offset = torch.arange(skv)[None, :] - torch.arange(sq)[:, None]          # j - i
    band = (offset > nxt) | (-offset > pre)
    if atten_mask is None:
        return band if band.any() else None
    assert atten_mask.dtype == torch.bool and atten_mask.shape[-2:] == (sq, skv)
    assert atten_mask.dim() in (2, 4), "documented: [S1, S2], [B, 1, S1, S2] or [B, N, S1, S2]"
    causal = bool(atten_mask[..., offset > 0].all()) and not bool(atten_mask[..., offset == 0].all())
    if causal:  # the causal triangle is in the mask (and the diagonal open: not a masked block)
        assert nxt == 0 and pre >= sq, "a causal atten_mask needs next_tockens 0, pre_tockens >= Sq"
    return (atten_mask if atten_mask.dim() == 2 else atten_mask[batch]) | band


class FakeTorchNpu:
    """Implements the documented formulas and input requirements of the torch_npu ops used here."""

    def __init__(self):
        self.calls: list[str] = []

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, *, atten_mask=None,
                             scale=1.0, keep_prob=1.0, sparse_mode=0, actual_seq_qlen=None,
                             actual_seq_kvlen=None, pre_tockens=NO_BAND, next_tockens=NO_BAND,
                             **unused):
        self.calls.append(f"npu_fusion_attention:{input_layout}")
        assert input_layout in ("BNSD", "BSND", "TND") and not unused and keep_prob == 1.0
        assert all(t.is_contiguous() for t in (query, key, value))
        assert key.shape == value.shape
        if input_layout == "TND":
            return self._varlen(query, key, value, head_num, atten_mask, scale, sparse_mode,
                                actual_seq_qlen, actual_seq_kvlen)
        assert actual_seq_qlen is None and actual_seq_kvlen is None
        q, k, v = (t.transpose(1, 2) if input_layout == "BSND" else t for t in (query, key, value))
        assert q.shape[1] == head_num and head_num % k.shape[1] == 0  # Nq / Nkv a whole number
        sq, skv = q.shape[2], k.shape[2]
        outs, maxes, sums = [], [], []
        for i in range(q.shape[0]):
            o, mx, total = _scores_attention(q[i], k[i], v[i], scale,
                                             _block_mask(sparse_mode, atten_mask, sq, skv, i,
                                                         pre_tockens, next_tockens), True)
            outs.append(o), maxes.append(mx), sums.append(total)
        out = torch.stack(outs).to(query.dtype)
        out = out.transpose(1, 2).contiguous() if input_layout == "BSND" else out
        # softmax_max / softmax_sum: (B, N, S1, 8) fp32, each value repeated 8 times
        return out, _repeat8(torch.stack(maxes)), _repeat8(torch.stack(sums)), None, 0, 0, 0

    def npu_fusion_attention_grad(self, query, key, value, dy, head_num, input_layout, *,
                                  atten_mask=None, softmax_max=None, softmax_sum=None,
                                  attention_in=None, scale_value=1.0, keep_prob=1.0, sparse_mode=0,
                                  pre_tockens=NO_BAND, next_tockens=NO_BAND, **unused):
        """The documented backward: P = exp(scale * Q K^T (masked) - softmax_max) / softmax_sum,
        dV = P^T dy, dS = P * (dy V^T - rowsum(dy * attention_in)), dQ = scale dS K,
        dK = scale dS^T Q (summed over the query heads of a key/value head)."""
        self.calls.append(f"npu_fusion_attention_grad:{input_layout}")
        assert input_layout in ("BNSD", "BSND") and not unused and keep_prob == 1.0
        assert all(t.is_contiguous() for t in (query, key, value, dy, attention_in))
        assert softmax_max.shape[-1] == 8 and softmax_sum.shape == softmax_max.shape
        assert dy.shape == query.shape == attention_in.shape
        tr = (lambda t: t.transpose(1, 2)) if input_layout == "BSND" else (lambda t: t)
        q, k, v, do, o = (tr(t).float() for t in (query, key, value, dy, attention_in))
        assert q.shape[1] == head_num and softmax_max.shape[:3] == q.shape[:3]
        rep = q.shape[1] // k.shape[1]
        sq, skv = q.shape[2], k.shape[2]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for i in range(q.shape[0]):
            s = _scores(q[i], k[i], scale_value, _block_mask(sparse_mode, atten_mask, sq, skv, i,
                                                             pre_tockens, next_tockens))
            p = torch.exp(s - softmax_max[i, ..., :1].float()) / softmax_sum[i, ..., :1].float()
            vr = v[i].repeat_interleave(rep, 0)
            kr = k[i].repeat_interleave(rep, 0)
            ds = p * (do[i] @ vr.transpose(-2, -1) - (do[i] * o[i]).sum(-1, keepdim=True))
            dq[i] = ds @ kr * scale_value
            dk[i] = (ds.transpose(-2, -1) @ q[i] * scale_value).view(k.shape[1], rep, skv, -1).sum(1)
            dv[i] = (p.transpose(-2, -1) @ do[i]).view(k.shape[1], rep, skv, -1).sum(1)
        back = (lambda t, like: tr(t).contiguous().to(like.dtype))
        return back(dq, query), back(dk, key), back(dv, value), None

    def _varlen(self, query, key, value, head_num, atten_mask, scale, sparse_mode, qlen, kvlen):
        """TND: (T, N, D) tokens; actual_seq_qlen / kvlen are cumulative ends (2 2 2 -> 2 4 6)."""
        assert query.dim() == 3 and query.shape[1] == head_num and head_num % key.shape[1] == 0
        assert isinstance(qlen, list) and isinstance(kvlen, list) and all(isinstance(x, int) for x in qlen)
        assert 1 <= len(qlen) <= VARLEN_MAX_SEGMENTS and len(kvlen) == len(qlen)
        assert qlen[-1] == query.shape[0] and kvlen[-1] == key.shape[0]
        assert all(b > a for a, b in zip([0] + qlen, qlen))
        out = torch.empty(query.shape, dtype=torch.float32)
        for (q0, q1), (k0, k1) in zip(zip([0] + qlen, qlen), zip([0] + kvlen, kvlen)):
            q, k, v = (t[a:b].transpose(0, 1) for t, a, b in
                       ((query, q0, q1), (key, k0, k1), (value, k0, k1)))  # (n, len, d)
            sq, skv = q1 - q0, k1 - k0
            masked = None
            if sparse_mode == 3:  # rightDownCausal, anchored at each segment's bottom-right corner
                assert torch.equal(atten_mask, COMPRESSED_CAUSAL)
                masked = torch.arange(skv)[None, :] > torch.arange(sq)[:, None] + (skv - sq)
            else:
                assert sparse_mode == 0 and atten_mask is None
            out[q0:q1] = _scores_attention(q, k, v, scale, masked).transpose(0, 1)
        return out.to(query.dtype), None, None, None, 0, 0, 0

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self.calls.append("npu_rms_norm")
        assert gamma.dtype == x.dtype
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rotary_mul(self, x, r1, r2):
        self.calls.append("npu_rotary_mul")
        assert x.dim() == r1.dim() == r2.dim() == 4 and r1.dtype == x.dtype
        assert torch.broadcast_shapes(x.shape, r1.shape, r2.shape) == x.shape
        assert x.shape[-1] % 2 == 0 and x.shape[-1] < 896  # the widest documented table (A2/A3)
        x1, x2 = torch.chunk(x, 2, -1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    def npu_grouped_matmul(self, x, weight, *, bias=None, group_list=None, split_item=0,
                           group_type=None, group_list_type=0, **unused):
        """The one-tensor case (x, weight, y one tensor each; op-plugin 7.3.0): x (m, k) not
        transposed, weight (G, k, n) 3-D (transposed allowed), group_list an int64 tensor of
        cumulative row counts (group_list_type 0: non-negative, non-decreasing, last = m),
        group_type 0, split_item 2 or 3, at most 1024 groups, k and n below 65536."""
        self.calls.append("npu_grouped_matmul")
        assert not unused and bias is None  # the engine adds the bias itself
        assert isinstance(x, list) and isinstance(weight, list) and len(x) == len(weight) == 1
        x, w = x[0], weight[0]
        assert x.dim() == 2 and x.is_contiguous() and w.dim() == 3
        assert w.is_contiguous() or w.transpose(1, 2).is_contiguous()
        assert x.dtype == w.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        assert group_type == 0 and group_list_type == 0 and split_item in (2, 3)
        assert isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64
        assert group_list.dim() == 1 and group_list.numel() == w.shape[0] <= 1024
        ends = group_list.tolist()
        assert all(0 <= a <= b for a, b in zip([0] + ends, ends)) and ends[-1] == x.shape[0]
        assert x.shape[1] == w.shape[1] and max(x.shape[1], w.shape[2]) < 65536
        outs = [x[a:b].float() @ w[g].float() for g, (a, b) in enumerate(zip([0] + ends, ends))]
        return [torch.cat(outs).to(x.dtype)]

    def npu_swiglu(self, x, dim=-1):
        self.calls.append("npu_swiglu")
        assert x.is_contiguous()
        a, b = torch.chunk(x, 2, dim)
        return a * torch.sigmoid(a) * b


def install_fake_npu(monkeypatch) -> FakeTorchNpu:
    """Make ``import torch_npu`` return the fake and every kernel take its NPU branch."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    for name in KERNEL_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "device_kind", lambda t: "npu")
    return fake
