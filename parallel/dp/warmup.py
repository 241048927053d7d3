"""How long the uncompressed warm-up lasts, and when the frozen second moment is refreshed.

Why the warm-up is sized by the run. 1-bit Adam (Tang et al. 2021) and 0/1 Adam (Lu et al. 2022)
freeze Adam's second moment v once it has stabilised, and from then on compress the momentum of
a momentum-SGD step preconditioned by that v. A v frozen after a handful of steps is far from the
v of the rest of the run (the gradient scale drops by an order of magnitude early in training), so
the warm-up has to be a fraction of the run, 15-25 % in the papers: ``warmup_fraction`` (default
0.15) of ``--train-iters``, or an explicit number of steps. Compressors that send every value
every step (int8) need no variance warm-up and keep a short fixed one.

When v is refreshed (``variance_refresh``), counting k = step - warmup (k = 1 is the first
compressed step):

- ``"exp"`` (0/1 Adam's schedule): at k = 1, 2, 4, 8, ...: v moves less as training goes on, so
  the refreshes thin out exponentially and cost almost nothing over a long run;
- an integer K > 0: at k = 1 and every K steps after (k = K, 2K, ...);
- ``0`` or ``"off"``: never; the warm-up's v is kept for good (1-bit Adam's rule).

``"auto"`` (the default) is ``"off"``. The refreshed v is the DP average of each rank's own
squared gradient, whose noise is dp times that of the global batch (variance.py), so it is up to
dp times too large and shortens the steps. On the compression benchmark it slowed both
compressors once each sends its momentum (600 steps, dp 2, seed 1: top-k of the momentum +6.7 %
with exp against +1.8 % with off; 1-bit Adam, 200 steps: +3.4 % against +1.6 %).
"""
from __future__ import annotations

DEFAULT_WARMUP_FRACTION = 0.15   # of --train-iters, for compressors that freeze the variance
DEFAULT_WARMUP_STEPS = 4         # without a run length, or for compressors that do not freeze it
DEFAULT_VARIANCE_REFRESH = "auto"
DEFAULT_SPARSITY_WARMUP_FRACTION = 0.2    # of --train-iters: top-k's density ramp (dgc.py)


def parse_refresh(value, where: str = "variance_refresh"):
    """``"exp"``, a non-negative int, ``"off"`` or ``"auto"`` (both -> 0), from a flag string or a
    YAML value; raises ValueError naming ``where`` otherwise."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return 0
        if text == "exp":
            return "exp"
        if text == "off":
            return 0
        if text.isdigit():
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"{where}: must be exp, off or a non-negative number of steps, got {value!r}")


def resolve_warmup(steps: int | None, fraction: float | None, train_iters: int | None,
                   freezes_variance: bool) -> int:
    """The warm-up in optimizer steps: ``steps`` when given; otherwise, for a compressor that
    freezes the variance and a known run length, ``fraction`` of it (at least 1 step); else
    DEFAULT_WARMUP_STEPS."""
    if steps is not None:
        return int(steps)
    if freezes_variance and train_iters:
        f = DEFAULT_WARMUP_FRACTION if fraction is None else float(fraction)
        return max(1, round(f * int(train_iters)))
    return DEFAULT_WARMUP_STEPS


def resolve_sparsity_warmup(steps: int | None, train_iters: int | None, topk: bool) -> int:
    """Top-k's density ramp in compressed steps: ``steps`` when given, else
    DEFAULT_SPARSITY_WARMUP_FRACTION of a known run (0 without top-k or a run length)."""
    if steps is not None:
        return int(steps)
    if topk and train_iters:
        return max(1, round(DEFAULT_SPARSITY_WARMUP_FRACTION * int(train_iters)))
    return 0


def check_fraction(fraction, where: str = "warmup_fraction") -> None:
    if fraction is None:
        return
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise ValueError(f"{where}: must be a number in [0, 1), got {fraction!r}")


def refresh_at(step: int, warmup: int, refresh) -> bool:
    """Whether 1-based ``step`` refreshes the frozen second moment (schedule in the module doc)."""
    k = step - warmup
    if k < 1 or refresh == 0:
        return False
    if refresh == "exp":
        return k & (k - 1) == 0
    return k == 1 or k % int(refresh) == 0


def refresh_steps(warmup: int, refresh, train_iters: int) -> list[int]:
    """Every refresh step of a run of ``train_iters`` steps (for reports and tests)."""
    return [s for s in range(1, train_iters + 1) if refresh_at(s, warmup, refresh)]
