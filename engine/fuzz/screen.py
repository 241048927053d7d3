"""The screening space: the fuzzer's layouts plus the features whose numerics differ from serial.

``python -m engine.fuzz --screen`` draws a ``ScreenCase``: a layout of the fuzzer's space
(space.py ``draw``, the same main stream, so ``--screen --seed S`` screens the layouts ``--seed S``
fuzzes) with the choices the equivalence property leaves out by design: the precision (fp32, bf16,
fp16), FP8 GEMMs on bf16 (the hybrid format, tensorwise or rowwise scales), fp16's overflow skip
(the loss scale starts at 2^20 with hysteresis 1, where the serial run's first step overflows: a
step that overflows is skipped on every rank and the scale halves at once), dropout 0.1, an MoE capacity factor (0.5 or 1.0, with or without
padding each expert to its capacity), the global ``aux_loss`` and DP gradient compression (int8,
topk, onebit, after one uncompressed warm-up step). None trains the serial model bit for bit, so
such a case is not compared for equality (compare.py ``judge_screen`` says what it is held to).

The screening choices are drawn by a generator seeded by the layout's spec (the main stream is not
consumed), each among the values the layout allows, so every draw is valid (tests check a few
hundred against the trainer's own validation):

- ``fp8`` only on ``precision=bf16``; ``overflow`` only on fp16;
- ``capacity``, ``pad`` and ``global_aux`` only with ``moe=1``; ``pad`` only with a capacity;
- ``compression`` only with dp x cp >= 2 (nothing is exchanged otherwise), never with ``zero=3``
  (not built), and only int8 with the optimizer's host offload (topk's and onebit's frozen-variance
  update is not built there);
- ``dropout`` everywhere; under ring attention (cp >= 2, ``cp_comm=p2p``, which applies no
  attention dropout) the case's run sets ``--attention-dropout 0`` and keeps the residual branches'.

Worked example: ``draw_screen(random.Random(1), 4)`` draws the layout ``draw(random.Random(1), 4)``
draws, ``cp=2,micro=2,cp_comm=a2a,zero=3,recompute=full,block=user,order=tp-cp-pp-dp``, then from
``random.Random("screen:" + that spec)`` ``precision=fp16`` and ``dropout=10`` (no compression:
zero=3); its ``spec()`` is the layout's followed by ``,precision=fp16,dropout=10``, which
``ScreenCase.parse`` reads back, and its run is the layout's with ``--precision fp16`` and
``--dropout 0.1``.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from engine.fuzz.space import EXPERTS, Case, draw

PRECISIONS = ("fp32", "bf16", "fp16")
FP8_RECIPES = ("none", "tensorwise", "rowwise")   # the hybrid format (e4m3 forward, e5m2 grads)
COMPRESSORS = ("none", "int8", "topk", "onebit")
CAPACITIES = (0, 50, 100)                          # percent of the factor; 0: dropless
OVERFLOW_SCALE = 2 ** 20                           # the serial run's first fp16 step overflows
SCREEN_FIELDS = ("precision", "fp8", "overflow", "dropout", "capacity", "pad", "global_aux",
                 "compression")


@dataclass(frozen=True)
class ScreenCase(Case):
    """A ``Case`` with the screening fields; ``spec`` writes them after the layout's, ``parse``
    reads them back, ``argv`` adds their flags."""
    precision: str = "fp32"
    fp8: str = "none"            # FP8 recipe of the hybrid format, on bf16
    overflow: bool = False       # fp16: start the loss scale at OVERFLOW_SCALE, hysteresis 1
    dropout: int = 0             # percent (10: --dropout 0.1)
    capacity: int = 0            # the MoE capacity factor in percent (100: 1.0); 0: dropless
    pad: bool = False            # pad each expert's input to its capacity
    global_aux: bool = False     # the global aux_loss instead of the per-sequence one
    compression: str = "none"    # DP gradient compression after one uncompressed step

    def screen_flags(self) -> list[str]:
        """The flags the screening fields add to the layout's run."""
        flags = []
        if self.fp8 != "none":
            flags += ["--fp8-format", "hybrid", "--fp8-recipe", self.fp8]
        if self.overflow:
            flags += ["--initial-loss-scale", str(OVERFLOW_SCALE), "--hysteresis", "1"]
        if self.dropout:
            flags += ["--dropout", f"{self.dropout / 100:g}"]
            if self.cp > 1 and self.cp_comm == "p2p":  # ring attention applies none
                flags += ["--attention-dropout", "0"]
        if self.capacity:
            flags += ["--moe-expert-capacity-factor", f"{self.capacity / 100:g}"]
            if self.pad:
                flags.append("--moe-pad-expert-input-to-capacity")
        if self.compression != "none":
            flags += ["--grad-compression", self.compression, "--grad-compression-warmup-steps", "1"]
        return flags

    def argv(self, steps: int) -> list[str]:
        flags = super().argv(steps)
        flags[flags.index("--precision") + 1] = self.precision
        if self.global_aux:
            flags[flags.index("seq_aux_loss")] = "aux_loss"
        return flags + self.screen_flags()

    def problem(self) -> str | None:
        """``Case.problem``, then the screening fields' own ranges and the fields that mean nothing
        without another (``overflow=1`` needs ``precision=fp16``)."""
        problem = super().problem()
        if problem:
            return problem
        for key, options in (("precision", PRECISIONS), ("fp8", FP8_RECIPES),
                             ("compression", COMPRESSORS)):
            if getattr(self, key) not in options:
                return f"{key} takes {', '.join(options)}, got {getattr(self, key)}"
        if not 0 <= self.dropout < 100:
            return f"dropout takes a percent, 0 (none) to 99, got {self.dropout}"
        if not 0 <= self.capacity <= 100 * EXPERTS:
            return (f"capacity takes the capacity factor in percent, 0 (dropless) to "
                    f"{100 * EXPERTS} (the experts' count), got {self.capacity}")
        needs = [("fp8", self.fp8 != "none", self.precision == "bf16",
                  "precision=bf16 (FP8 GEMMs run on top of bf16)"),
                 ("overflow", self.overflow, self.precision == "fp16",
                  "precision=fp16 (only fp16 scales its loss)"),
                 ("capacity", self.capacity, self.moe, "moe=1"),
                 ("pad", self.pad, self.capacity, "capacity=1 or more (dropless routing has no "
                                                  "capacity to pad to)"),
                 ("global_aux", self.global_aux, self.moe, "moe=1"),
                 ("compression", self.compression != "none", self.dp * self.cp > 1,
                  "dp x cp = 2 or more (nothing is exchanged to compress)")]
        for key, given, met, what in needs:
            if given and not met:
                value = getattr(self, key)
                return f"{key}={int(value) if isinstance(value, bool) else value} needs {what}"
        return None


def draw_screen(rng: random.Random, ranks: int) -> ScreenCase:
    """One valid screening case for ``ranks`` processes at most: ``draw``'s layout (from ``rng``)
    and the screening choices (from a generator seeded by the layout)."""
    case = draw(rng, ranks)
    own = random.Random(f"screen:{case.spec()}")
    precision = own.choice(PRECISIONS)
    choices = {"precision": precision,
               "fp8": own.choice(FP8_RECIPES) if precision == "bf16" else "none",
               "overflow": precision == "fp16" and own.random() < 0.5,
               "dropout": own.choice([0, 10])}
    if case.moe:
        choices["capacity"] = own.choice(CAPACITIES)
        choices["pad"] = bool(choices["capacity"]) and own.random() < 0.5
        choices["global_aux"] = own.random() < 0.4
    if case.dp * case.cp > 1 and case.zero != 3 and own.random() < 0.75:
        choices["compression"] = own.choice(COMPRESSORS[1:] if not case.offload else ("int8",))
    return ScreenCase(**dataclasses.asdict(case), **choices)


def screen_draws(seed: int, ranks: int, count: int) -> list[ScreenCase]:
    """``count`` screening cases of one seeded stream: the same list for the same arguments."""
    rng = random.Random(seed)
    return [draw_screen(rng, ranks) for _ in range(count)]
