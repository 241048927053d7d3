"""Top-k of the momentum: Deep Gradient Compression (Lin et al. 2018, "Deep Gradient Compression:
Reducing the Communication Bandwidth for Distributed Training") in 1-bit Adam's frame.

After the uncompressed warm-up Adam's second moment v is frozen (variance.py, warmup.py), so the
update p -= lr * m / (sqrt(v) + eps) is momentum SGD with a fixed preconditioner, and what a
sparsifier should send is the momentum, not the gradient: each rank keeps its own velocity u_r
(momentum correction), accumulates it into its residual, and sends the k largest accumulated values.
Sparsifying the raw gradient and applying the momentum after the exchange (the earlier top-k) lets
the momentum of a delayed burst act on stale directions for 1 / (1 - beta1) steps more.

One exchange, on every rank r of p (the bucket holds g_r / p, multiplied by the loss scale S):

    local clipping  g_r is clipped to the norm  local_clip * sqrt(p)  (per bucket: the DP mean of
                    p independent gradients has about 1 / sqrt(p) of their norm, so this is the
                    global clipping norm carried to one rank's share; a non-finite g_r is left
                    as it is, for the overflow check after the exchange)
    momentum        u_r = beta1 * u_r + (1 - beta1) * g_r                 (unscaled, per rank)
    accumulate      x_r = residual_r + u_r * S / p
    phase 1         top-k of each destination shard of x_r, all-to-all; what is not sent stays in
                    residual_r (compression.py's two-phase exchange and error feedback)
    masking         (``masking=True``, policy option ``momentum_masking``) u_r = 0 where x_r was
                    sent (DGC's momentum factor masking: the sent mass must not keep pushing
                    through the velocity). Off by default: a coordinate sent every step then
                    moves by (1 - beta1) g, a tenth of the momentum's step, and on the
                    compression benchmark masking cost about 2 points (600 steps, dp 2, three
                    seeds: +5.25 % against +2.93 %, docs/benchmarks.md)
    phase 2         the owner sums the p pieces (up to p k values), adds its residual, keeps the
                    OWNER_FACTOR k = 2 k largest and an all-gather returns every shard (under ZeRO
                    phase 1 only: the owner keeps the exact sum of its shard, which is all its
                    optimizer shard needs). ``ratio`` is what each rank sends; the update it
                    receives holds up to twice as many values. Why 2 k: re-selecting only k at
                    the owner delays most of what the ranks sent a second time, and it was the
                    larger cost (600 steps, dp 4, seed 1: +4.25 % with k, +0.61 % with ZeRO's
                    exact owner sum, +1.08 % with 2 k and the longer ramp); 2 k keeps the
                    compressed step at 2.25 ratio of the bytes (1.5 ratio with k), so the
                    whole run stays within 0.20x of the uncompressed bytes at ratio 0.01

The result is the optimizer's first moment for this step (``exchanges_momentum``): the optimizers
step with it as 1-bit Adam's momentum (onebit.momentum_adamw_). Since the mean of the ranks' u_r is
the momentum of the mean gradient (it is linear), the delivered values add up, over the steps, to
what the uncompressed momentum would have moved the parameters, less what the masking removes.

Sparsity warm-up (DGC's): over the first ``ramp_steps`` compressed steps the fraction sent falls
geometrically from ``RAMP_START`` (0.25) to ``ratio``, so the early, fast-changing momentum is sent
more densely; every rank uses the same density at a given step, so the messages agree in size.
"""
from __future__ import annotations

import math

import torch

from parallel.dp.compression import TopKCompressor, _unrows
from parallel.dp.momentum_state import MomentumState

RAMP_START = 0.25
OWNER_FACTOR = 2       # the owner keeps 2 k of the up to p k values its summed shard holds


def ramp_density(ratio: float, compressed_step: int, ramp_steps: int) -> float:
    """The fraction sent at 1-based compressed step k: RAMP_START * (ratio / RAMP_START)^((k-1)/R)
    for k <= R, ``ratio`` after (and whenever ``ratio`` >= RAMP_START or R = 0). Example: ratio
    0.01, R = 30: k = 1 -> 0.25, k = 16 -> 0.05, k = 31 -> 0.01."""
    if ramp_steps <= 0 or ratio >= RAMP_START or compressed_step > ramp_steps:
        return ratio
    t = (max(compressed_step, 1) - 1) / ramp_steps
    return RAMP_START * (ratio / RAMP_START) ** t


class MomentumTopKCompressor(MomentumState, TopKCompressor):
    """Top-k of the accumulated local momentum, with momentum factor masking, local clipping and
    the sparsity warm-up; error feedback on both sides as in every compressor."""
    name = "topk"
    sparse = True
    owner_factor = OWNER_FACTOR

    def __init__(self, ratio: float = 0.01, beta1: float = 0.9, masking: bool = False):
        super().__init__(ratio)
        self._init_momentum(beta1)
        self.masking = masking
        self.density = ratio
        self.local_clip = 0.0

    def prepare_step(self, compressed_step: int, ramp_steps: int, local_clip: float) -> None:
        self.density = ramp_density(self.ratio, compressed_step, ramp_steps)
        self.local_clip = float(local_clip)

    def k(self, m: int) -> int:
        density = self.density * (self.owner_factor if self.owner_phase else 1)
        return min(m, max(1, math.ceil(density * m)))

    # ---- exchanges -----------------------------------------------------------------------------
    def all_reduce_(self, flat: torch.Tensor, group) -> None:
        """``flat``: this rank's gradient / p (scaled); afterwards the sparse sum of the ranks'
        accumulated momenta (scaled), identical on every rank."""
        if group.size == 1:
            return
        self.allocate(flat.numel(), group.size, False, flat.device)
        self._momentum_in(flat, group)
        TopKCompressor.all_reduce_(self, flat, group)

    def reduce_scatter_(self, flat: torch.Tensor, group, out: torch.Tensor) -> None:
        """ZeRO: this rank's shard of that sum into ``out`` (phase 1 only)."""
        if group.size == 1:
            out.copy_(flat[:out.numel()])
            return
        self.allocate(flat.numel(), group.size, True, flat.device)
        self._momentum_in(flat, group)
        out.copy_(self._phase1(flat, group).sum(0)[:out.numel()])

    def _momentum_in(self, flat: torch.Tensor, group) -> None:
        """Clip g_r, advance u_r and put u_r * S / p into ``flat``."""
        p, n = group.size, flat.numel()
        scale = float(self.loss_scale())
        old = self._momentum_now(n, group)
        if self.local_clip > 0:
            self._clip_(flat, self.local_clip * math.sqrt(p) * scale / p)
        new = self._spare(old)
        torch.mul(old, self.beta1, out=new).add_(flat, alpha=(1.0 - self.beta1) * p / scale)
        torch.mul(new, scale / p, out=flat)
        self._advance(old, new)

    @staticmethod
    def _clip_(flat: torch.Tensor, max_norm: float) -> None:
        """Scale ``flat`` to at most ``max_norm`` on the device (no host read); non-finite stays."""
        norm = torch.linalg.vector_norm(flat)
        coef = (max_norm / (norm + 1e-6)).clamp_(max=1.0)
        flat.mul_(torch.where(torch.isfinite(norm), coef, torch.ones_like(coef)))

    def _sent(self, sent: torch.Tensor, n: int) -> None:
        if self.masking:
            self.momentum.masked_fill_(_unrows(sent != 0, n), 0.0)
