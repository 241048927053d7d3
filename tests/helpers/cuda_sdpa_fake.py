"""A stand-in for PyTorch's CUDA SDPA kernels that return the log-sum-exp, on machines without a GPU.

Each function follows the operator's schema (positional outputs as in torch 2.4 to 2.13) and checks
the input requirements the kernels enforce: flash takes fp16/bf16, equal query and key/value heads
and no mask; efficient attention takes an additive bias whose last dimension is 16-element aligned
and returns an lse padded to 32 queries, which its backward reads in that layout. The GPU's compute
capability (``capability``, default 9.0) is held to as PyTorch does: flash raises below 8.0
(flash_api.cpp ``mha_fwd`` / ``mha_bwd``: ``is_sm80_or_newer = major * 10 >= 80``), efficient
attention has no bf16 kernel below 8.0 (cutlassF.h / cutlassB.h dispatch). Causal masks are aligned
as each kernel aligns them: efficient attention's ``is_causal`` top-left (CausalFromTopLeft: query i
sees keys 0..i), flash's bottom-right when the query and key lengths differ (FlashAttention 2: query
i sees keys 0..i + sk - sq; torch/nn/attention/bias.py calls flash with is_causal=True for its
lower-right variant). Their math is the flash-attention formula (backward recomputes
P = exp(S - lse) from the lse it is given). It is never the code under test:
kernels/attention_lse_cuda.py's argument preparation is. On a GPU the device check
(benchmarks/device_check/kernels.py) runs the real kernels against the reference.

    fake = CudaSdpaFake(); monkeypatch.setattr(lse_mod, "cuda_ops", fake.ops)
    fake = CudaSdpaFake(capability=(7, 5))   # a T4
"""
from __future__ import annotations

import torch


def _scores(q, k, causal, bias, scale, bottom_right=False):
    """Scores (b, n, sq, sk) fp32; causal top-left, or (``bottom_right``) anchored at the last
    query and key: key j masked for query i when j > i + sk - sq."""
    s = q.float() @ k.float().transpose(-2, -1) * scale
    if causal:
        sq, sk = s.shape[-2:]
        shift = sk - sq if bottom_right else 0
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1 + shift), float("-inf"))
    if bias is not None:
        s = s + bias.float()
    return s


def _forward(q, k, v, causal, bias, scale, bottom_right=False):
    s = _scores(q, k, causal, bias, scale, bottom_right)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, causal, bias, scale, bottom_right=False):
    p = torch.exp(_scores(q, k, causal, bias, scale, bottom_right) - lse.unsqueeze(-1))
    do = dout.float()
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (do @ v.float().transpose(-2, -1) - delta)
    return ((ds @ k.float() * scale).to(q.dtype), (ds.transpose(-2, -1) @ q.float() * scale).to(k.dtype),
            (p.transpose(-2, -1) @ do).to(v.dtype))


def _same_heads(q, k, v):
    assert q.dim() == 4 and k.shape == v.shape and k.shape[1] == q.shape[1], \
        "the SDPA kernels take equal query and key/value heads"


class CudaSdpaFake:
    def __init__(self, capability: tuple[int, int] = (9, 0)):
        self.calls: list[str] = []
        self.capability = capability

    def _sm80_or_newer(self) -> bool:
        return self.capability[0] * 10 >= 80

    def _flash_device(self):
        if not self._sm80_or_newer():
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    def _efficient_device(self, q, which: str):
        if self.capability[0] < 5 or (q.dtype == torch.bfloat16 and not self._sm80_or_newer()):
            raise RuntimeError(f"{which}: no kernel found to launch!")

    def ops(self) -> dict:
        return {"flash": self.flash, "flash_backward": self.flash_backward,
                "efficient": self.efficient, "efficient_backward": self.efficient_backward}

    def flash(self, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        self.calls.append("flash")
        self._flash_device()
        assert q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0
        _same_heads(q, k, v)
        out, lse = _forward(q, k, v, is_causal, None, scale, bottom_right=True)
        rng = torch.empty((), dtype=torch.int64)
        return out, lse, None, None, q.shape[2], k.shape[2], rng, rng, torch.empty(0)

    def flash_backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p,
                       is_causal, seed, offset, *, scale=None):
        self.calls.append("flash_backward")
        self._flash_device()
        assert cum_q is None and cum_k is None, "a defined cumulative length selects the varlen kernel"
        assert (max_q, max_k) == (q.shape[2], k.shape[2]) and lse.shape == q.shape[:3]
        _same_heads(q, k, v)
        return _backward(dout, q, k, v, out, lse, is_causal, None, scale, bottom_right=True)

    @staticmethod
    def _check_bias(bias, q, k):
        if bias is None:
            return
        assert bias.dtype == q.dtype and bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, "bias rows must be 16-aligned"

    def efficient(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                  scale=None):
        self.calls.append("efficient")
        self._efficient_device(q, "cutlassF")
        assert compute_log_sumexp and dropout_p == 0.0
        _same_heads(q, k, v)
        self._check_bias(attn_bias, q, k)
        out, lse = _forward(q, k, v, is_causal, attn_bias, scale)
        sq = q.shape[2]
        padded = torch.full((*lse.shape[:-1], -(-sq // 32) * 32), 123.0)  # junk beyond sq
        padded[..., :sq] = lse
        rng = torch.empty((), dtype=torch.int64)
        return out, padded, rng, rng

    def efficient_backward(self, dout, q, k, v, attn_bias, out, lse, seed, offset, dropout_p,
                           grad_input_mask, is_causal=False, *, scale=None):
        self.calls.append("efficient_backward")
        self._efficient_device(q, "cutlassB")
        sq = q.shape[2]
        assert lse.shape[-1] == -(-sq // 32) * 32, "the lse is read in the forward's padded layout"
        assert list(grad_input_mask) == [True, True, True, False]
        _same_heads(q, k, v)
        self._check_bias(attn_bias, q, k)
        return (*_backward(dout, q, k, v, out, lse[..., :sq], is_causal, attn_bias, scale), None)
