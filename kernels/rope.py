"""Rotary position embedding in the "rotate half" convention (Hugging Face Llama, GPT-NeoX).

Channel i of the first half pairs with channel i + d/2: the pair is rotated by position * theta_i,
theta_i = base^(-2i/d). ``rope_cos_sin`` returns cos/sin laid out as cat(freqs, freqs) so the
rotation is one element-wise expression, x * cos + rotate_half(x) * sin, which is also exactly the
formula torch_npu.npu_rotary_mul documents. Checkpoints trained with HF Llama therefore load as is.

- NPU: ``torch_npu.npu_rotary_mul(x, cos, sin)`` with 4-D cos/sin, (1, 1, s, d) for BNSD memory or
  (1, s, 1, d) for BSND memory, within its documented shape limits; outside them the plain
  expression (the documentation itself advises that fallback).
- CUDA: the same expression compiled regionally (kernels/compiled.py: one inductor kernel forward
  and one backward per shape; the plain expression inside a compiled model).
- CPU: the plain expression (autograd handles the backward).
"""

from __future__ import annotations

import torch

from kernels.compiled import compiled, use_compiled
from kernels.dispatch import KernelPaths, device_kind, import_torch_npu

# Documented shape limits of npu_rotary_mul in "half" mode, per chip table (the call the engine
# makes: BNSD or BSND input, cos/sin broadcast as 11SD / 1S1D or B1SD / BS1D, no gradient for them):
# - "a2-a3": Atlas A2 / A3 training series with jit_compile=False (torch_npu's default there;
#   torch_npu 7.0.0 API reference, torch_npu.npu_rotary_mul, constraints): D even and below 896,
#   B and N below 1000 (B*N <= 1024 only when cos/sin need gradients, which they do not here).
#   The "D equal to 128" rule of older pages is the jit_compile=True (and Atlas training) one.
# - "atlas-training": Ascend 910A / 910ProB (torch_npu 6.0.0 API reference, and op-plugin's
#   docs/context/torch_npu-npu_rotary_mul.md for jit_compile=True: "D维度数值为128"): D = 128,
#   B and N at most 1000, broadcast axes at most 1024 elements in total, and for BNSD no B*N > 8*S.
ROTARY_TABLES = ("a2-a3", "atlas-training")
NPU_ROTARY_MAX_HEAD_DIM = 896            # a2-a3: D < 896
NPU_ROTARY_HEAD_DIM = 128                # atlas-training: D exactly 128
NPU_ROTARY_MAX_BATCH_OR_HEADS = 1000     # a2-a3: < 1000; atlas-training: <= 1000
NPU_ROTARY_MAX_BROADCAST = 1024          # atlas-training
NPU_ROTARY_MAX_BN_PER_S = 8              # atlas-training, BNSD

def rope_cos_sin(
    seq_len: int,
    head_dim: int,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim), for positions offset .. offset + seq_len - 1.

    Angles are computed in fp32 (as HF Llama does) and cast to ``dtype`` at the end.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number for rotary embedding, got {head_dim}")
    if seq_len < 0 or offset < 0:
        raise ValueError(f"seq_len and offset must be >= 0, got seq_len={seq_len}, offset={offset}")
    if base <= 0:
        raise ValueError(f"base must be positive, got {base}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))  # (d/2,)
    pos = torch.arange(offset, offset + seq_len, device=device).float()  # (s,)
    freqs = torch.outer(pos, inv_freq)  # (s, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (s, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_cos_sin_at(
    position_ids: torch.Tensor,
    head_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at given positions: position_ids (b, s) -> each (b, 1, s, head_dim), broadcasting
    over heads. Row p equals row p of ``rope_cos_sin`` exactly (the same fp32 products), so packed
    documents whose positions restart see the angles a document alone would."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (b, s), got shape {tuple(position_ids.shape)}")
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number for rotary embedding, got {head_dim}")
    if base <= 0:
        raise ValueError(f"base must be positive, got {base}")
    device = position_ids.device
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))  # (d/2,)
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # (b, s, d/2)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # (b, 1, s, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeCache:
    """cos/sin tables built once per (length, head_dim, base, dtype, device) and reused by every
    layer and step, plus the per-token rows of the last micro-batch's positions (every layer of a
    micro-batch is handed the same ``position_ids`` tensor, so they are gathered once per
    micro-batch). Owned by the model (``models.layers.LayerContext``), never global.

    ``table(s, ...)`` equals ``rope_cos_sin(s, ...)`` and ``at(position_ids, ...)`` equals
    ``rope_cos_sin_at(position_ids, ...)`` bit for bit: row p of the table is the same fp32 product
    p * theta_i either way. Inside a torch.compile graph nothing is cached (the compiler hoists the
    table itself), so a cache lookup never splits or re-specialises the graph.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last: tuple | None = None   # (position_ids, key, (cos, sin))
        self.builds = 0                   # tables computed (for tests)

    def table(self, length: int, head_dim: int, base: float = 10000.0,
              dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each (length, head_dim), for positions 0 .. length - 1."""
        if torch.compiler.is_compiling():
            return rope_cos_sin(length, head_dim, base, device, dtype)
        device = torch.device("cpu") if device is None else torch.device(device)
        for key, tables in self._tables.items():   # a longer table of the same kind serves too
            if key[1:] == (head_dim, float(base), dtype, device) and key[0] >= length:
                return tables[0][:length], tables[1][:length]
        tables = rope_cos_sin(length, head_dim, base, device, dtype)
        self._tables[(length, head_dim, float(base), dtype, device)] = tables
        self.builds += 1
        return tables

    def at(self, position_ids: torch.Tensor, head_dim: int, base: float = 10000.0,
           dtype: torch.dtype = torch.float32, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at the given positions, (b, s) -> each (b, 1, s, head_dim). ``length``: a
        bound on the positions (the model's sequence length; default s), the table's length."""
        if torch.compiler.is_compiling():
            return rope_cos_sin_at(position_ids, head_dim, base, dtype)
        key = (head_dim, float(base), dtype)
        last = self._last
        if last is not None and last[0] is position_ids and last[1] == key:
            return last[2]
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be (b, s), got shape {tuple(position_ids.shape)}")
        cos, sin = self.table(max(length or 0, position_ids.shape[1]), head_dim, base, dtype,
                              position_ids.device)
        out = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)  # (b, 1, s, d)
        self._last = (position_ids, key, out)
        return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) for x = cat(x1, x2) along the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"apply_rope expects x of shape (b, n, s, d), got {tuple(x.shape)}")
    s, d = x.shape[2], x.shape[3]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[-2:] != (s, d) or t.dim() not in (2, 4):
            raise ValueError(
                f"{name} must be (s, d) = ({s}, {d}) or 4-D broadcastable to x with those last two "
                f"dims; got {tuple(t.shape)}. Slice rope_cos_sin's tables to the sequence you apply."
            )


def npu_rotary_layout(x: torch.Tensor) -> str:
    """"BSND" when x (b, n, s, d) is a transposed view of contiguous (b, s, n, d) memory, else "BNSD".

    npu_rotary_mul accepts both layouts (with cos/sin shaped to match), so a view of a (b, s, h)
    projection is rotated in place of memory instead of being copied to BNSD first.
    """
    return "BSND" if not x.is_contiguous() and x.transpose(1, 2).is_contiguous() else "BNSD"


def npu_rotary_supported(x: torch.Tensor, table: str = "a2-a3") -> bool:
    """Whether npu_rotary_mul's documented shape limits of ``table`` hold for x (b, n, s, d).

    >>> [npu_rotary_supported(torch.empty(2, 8, 16, d, device="meta")) for d in (64, 96, 128, 896)]
    [True, True, True, False]
    >>> [npu_rotary_supported(torch.empty(2, 8, 16, d, device="meta"), "atlas-training") for d in (64, 128)]
    [False, True]
    """
    b, n, s, d = x.shape
    if table == "a2-a3":
        return d % 2 == 0 and d < NPU_ROTARY_MAX_HEAD_DIM and b < NPU_ROTARY_MAX_BATCH_OR_HEADS \
            and n < NPU_ROTARY_MAX_BATCH_OR_HEADS
    if table != "atlas-training":
        raise ValueError(f"unknown npu_rotary_mul table {table!r}; expected one of {ROTARY_TABLES}")
    return (
        d == NPU_ROTARY_HEAD_DIM
        and b <= NPU_ROTARY_MAX_BATCH_OR_HEADS
        and n <= NPU_ROTARY_MAX_BATCH_OR_HEADS
        and b * n <= NPU_ROTARY_MAX_BROADCAST
        and (npu_rotary_layout(x) == "BSND" or b * n <= NPU_ROTARY_MAX_BN_PER_S * s)
    )


def npu_rotary_args(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layout, x, r1, r2) for npu_rotary_mul: cos/sin (s, d) become 4-D in x's dtype, (1, 1, s, d)
    for BNSD or (1, s, 1, d) for BSND, where x is passed as its (b, s, n, d) view."""
    s, d = x.shape[2], x.shape[3]
    layout = npu_rotary_layout(x)
    # logical (1|b, 1|n, s, d) in x's dtype, then the same transpose as x for BSND
    r1, r2 = (t.to(x.dtype).reshape(1, 1, s, d) if t.dim() == 2 else t.to(x.dtype) for t in (cos, sin))
    if layout == "BSND":
        x, r1, r2 = x.transpose(1, 2), r1.transpose(1, 2), r2.transpose(1, 2)
    return layout, x, r1, r2


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               paths: KernelPaths | None = None) -> torch.Tensor:
    """Rotate q or k, x (b, n, s, d), by cos/sin (s, d) from ``rope_cos_sin``; returns (b, n, s, d).
    ``paths``: the chip's fused ops (None: all); without ``rotary_mul`` an NPU runs the expression."""
    _check_rope(x, cos, sin)
    table = "a2-a3" if paths is None else paths.rotary_table
    kind = device_kind(x)
    if kind == "npu" and (paths is None or paths.rotary_mul) and npu_rotary_supported(x, table):
        torch_npu = import_torch_npu()
        layout, xa, r1, r2 = npu_rotary_args(x, cos, sin)
        out = torch_npu.npu_rotary_mul(xa, r1, r2)
        return out.transpose(1, 2) if layout == "BSND" else out  # (b, n, s, d)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (s, d) broadcasts over (b, n)
    if use_compiled(kind):
        return compiled("rope")(x, cos, sin)
    return x * cos + rotate_half(x) * sin


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation written per half in fp32, cast back to x's dtype:
    out1 = x1 * cos1 - x2 * sin1, out2 = x2 * cos2 + x1 * sin2."""
    _check_rope(x, cos, sin)
    h = x.shape[-1] // 2
    xf, cf, sf = x.float(), cos.float(), sin.float()
    x1, x2 = xf[..., :h], xf[..., h:]
    out1 = x1 * cf[..., :h] - x2 * sf[..., :h]
    out2 = x2 * cf[..., h:] + x1 * sf[..., h:]
    return torch.cat((out1, out2), dim=-1).to(x.dtype)
