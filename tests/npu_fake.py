"""A stand-in for torch_npu on machines without an NPU: each function implements the formula and
the input requirements that the torch_npu documentation states, so an NPU branch of kernels/ can
run end to end on the CPU. It is never the code under test: the kernels' argument preparation is.

    fake = install_fake_npu(monkeypatch)   # torch_npu -> FakeTorchNpu, kernels dispatch to "npu"
"""
from __future__ import annotations

import importlib
import sys

import torch

KERNEL_MODULES = ("kernels.attention", "kernels.norms", "kernels.rope", "kernels.swiglu")
COMPRESSED_CAUSAL = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
VARLEN_MAX_SEGMENTS = 1024  # documented maximum length of actual_seq_qlen in the TND layout


def _scores_attention(q, k, v, scale, masked):
    """q (n, sq, d), k and v (n_kv, skv, d): query head i reads key/value head i // (n / n_kv)."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    return scores.softmax(-1) @ v.float()


class FakeTorchNpu:
    """Implements the documented formulas and input requirements of the torch_npu ops used here."""

    def __init__(self):
        self.calls: list[str] = []

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, *, atten_mask=None,
                             scale=1.0, keep_prob=1.0, sparse_mode=0, actual_seq_qlen=None,
                             actual_seq_kvlen=None, **unused):
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
        masked = None
        if sparse_mode == 2:  # leftUpCausal: the fixed compressed mask, pattern independent of it
            assert atten_mask.dtype == torch.bool and torch.equal(atten_mask, COMPRESSED_CAUSAL)
            masked = torch.arange(skv)[None, :] > torch.arange(sq)[:, None]
        else:
            assert sparse_mode == 0
            masked = atten_mask
        out = torch.stack([_scores_attention(q[i], k[i], v[i], scale, masked)
                           for i in range(q.shape[0])]).to(query.dtype)
        out = out.transpose(1, 2).contiguous() if input_layout == "BSND" else out
        return out, None, None, None, 0, 0, 0

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
        x1, x2 = torch.chunk(x, 2, -1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

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
