"""Per-branch gradient-compression policy, read from the YAML recipe.

    grad_compression:
      default: none               # or int8, topk, or a mapping like a rule without 'pattern'
      warmup_fraction: 0.15       # of --train-iters uncompressed (onebit, topk; default 0.15)
      warmup_steps: 90            # or a number of steps (wins over the fraction)
      variance_refresh: auto      # onebit, topk: exp (0/1 Adam), every K steps, off; auto:
                                  # off (warmup.py)
      sparsity_warmup_steps: 120  # topk: compressed steps over which the fraction sent falls
                                  # from 0.25 to the ratio (default 0.2 of the run; dgc.py)
      rules:                      # fnmatch on parameter names, first match wins
        - {pattern: "*embed*", compressor: none}
        - {pattern: "*attn*",  compressor: int8, chunk_size: 256}
        - {pattern: "*mlp*",   compressor: topk, ratio: 0.01}

Embeddings and norms are small and sensitive, MLP gradients are large and tolerate sparsification:
a policy lets each branch pay only the error it can afford. The reducer forms buckets per
compressor, so one bucket never mixes two compressors.

Top-k and onebit need at least one warm-up step: Adam's second moment of their parameters is
frozen after the warm-up and refreshed on the ``variance_refresh`` schedule (variance.py,
warmup.py); the warm-up is a fraction of the run for them (warmup.py), 4 steps for int8 alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from parallel.dp.compression import Compressor, Int8Compressor
from parallel.dp.dgc import MomentumTopKCompressor
from parallel.dp.onebit import OneBitCompressor
from parallel.dp.warmup import (DEFAULT_VARIANCE_REFRESH, DEFAULT_WARMUP_STEPS, check_fraction,
                                parse_refresh, refresh_at, resolve_sparsity_warmup, resolve_warmup)

KINDS = ("none", "int8", "topk", "onebit")
FROZEN_VARIANCE = ("topk", "onebit")   # Adam's second moment frozen after the warm-up
_OPTIONS = {"none": (), "int8": ("chunk_size",), "topk": ("ratio", "momentum_masking"),
            "onebit": ("chunk_size",)}


class PolicyError(ValueError):
    """An invalid compression policy; the message names the offending key."""


@dataclass(frozen=True)
class CompressorSpec:
    """Which compressor a parameter uses; hashable so buckets can be grouped by it."""
    kind: str = "none"
    ratio: float | None = None          # topk: fraction of values sent, in (0, 1]
    chunk_size: int | None = None       # int8: values sharing one scale
    momentum_masking: bool | None = None  # topk: DGC's momentum factor masking (default off)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PolicyError(f"compressor: unknown compressor {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.ratio is not None and self.kind != "topk":
            raise PolicyError(f"ratio: only the topk compressor takes a ratio, not {self.kind!r}")
        if self.momentum_masking is not None and (self.kind != "topk"
                                                  or not isinstance(self.momentum_masking, bool)):
            raise PolicyError(f"momentum_masking: true or false, for the topk compressor only; got "
                              f"{self.momentum_masking!r} for {self.kind!r}")
        if self.chunk_size is not None and self.kind not in ("int8", "onebit"):
            raise PolicyError(f"chunk_size: only the int8 and onebit compressors take a chunk_size, "
                              f"not {self.kind!r}")
        if self.ratio is not None and (isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float))
                                       or not 0.0 < self.ratio <= 1.0):
            raise PolicyError(f"ratio: must be a number in (0, 1], got {self.ratio!r}")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool)
                                            or not isinstance(self.chunk_size, int) or self.chunk_size < 1):
            raise PolicyError(f"chunk_size: must be a positive integer, got {self.chunk_size!r}")
        if self.kind == "onebit" and self.chunk_size is not None and self.chunk_size % 8:
            raise PolicyError(f"chunk_size: onebit packs 8 signs per byte; use a multiple of 8, "
                              f"got {self.chunk_size!r}")

    @property
    def compressed(self) -> bool:
        return self.kind != "none"

    def build(self) -> Compressor | None:
        """A fresh compressor (each bucket owns one: top-k keeps per-bucket residuals)."""
        if self.kind == "int8":
            return Int8Compressor(chunk_size=self.chunk_size or 256)
        if self.kind == "topk":
            return MomentumTopKCompressor(ratio=0.01 if self.ratio is None else float(self.ratio),
                                          masking=bool(self.momentum_masking))
        if self.kind == "onebit":
            return OneBitCompressor(chunk_size=self.chunk_size or 256)
        return None

    def describe(self) -> str:
        opts = [f"{k}={getattr(self, k)}" for k in _OPTIONS[self.kind] if getattr(self, k) is not None]
        return self.kind + (f"({', '.join(opts)})" if opts else "")

    @classmethod
    def parse(cls, value, where: str) -> "CompressorSpec":
        """From 'int8' or {'compressor': 'topk', 'ratio': 0.01}; errors are prefixed with ``where``."""
        if isinstance(value, str):
            value = {"compressor": value}
        if not isinstance(value, dict):
            raise PolicyError(f"{where}: expected a compressor name or a mapping, got {value!r}")
        kind = value.get("compressor", "none")
        if not isinstance(kind, str):
            raise PolicyError(f"{where}.compressor: expected a name, got {kind!r}")
        if kind not in KINDS:
            raise PolicyError(f"{where}.compressor: unknown compressor {kind!r}; use one of {', '.join(KINDS)}")
        extra = set(value) - {"compressor", "pattern", *_OPTIONS[kind]}
        if extra:
            key = sorted(extra)[0]
            allowed = ", ".join(("compressor", *_OPTIONS[kind]))
            raise PolicyError(f"{where}.{key}: not an option of the {kind} compressor (allowed: {allowed})")
        try:
            return cls(kind, value.get("ratio"), value.get("chunk_size"),
                       value.get("momentum_masking"))
        except PolicyError as exc:
            raise PolicyError(f"{where}.{exc}") from None


@dataclass(frozen=True)
class Rule:
    pattern: str
    spec: CompressorSpec


@dataclass(frozen=True)
class CompressionPolicy:
    """``warmup_steps`` is resolved (warmup.py: a fraction of the run for compressors that freeze
    the variance); ``variance_refresh`` is "exp", K > 0 or 0 (off) once built ("auto" resolves);
    ``sparsity_warmup_steps``: top-k's density ramp after the warm-up (dgc.py), resolved too."""
    default: CompressorSpec = field(default_factory=CompressorSpec)
    warmup_steps: int = 0
    rules: tuple[Rule, ...] = ()
    variance_refresh: int | str = DEFAULT_VARIANCE_REFRESH
    sparsity_warmup_steps: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise PolicyError(f"warmup_steps: must be a non-negative integer, got {self.warmup_steps!r}")
        ramp = self.sparsity_warmup_steps
        if isinstance(ramp, bool) or not isinstance(ramp, int) or ramp < 0:
            raise PolicyError(f"sparsity_warmup_steps: must be a non-negative integer, got {ramp!r}")
        try:
            object.__setattr__(self, "variance_refresh", parse_refresh(self.variance_refresh))
        except ValueError as exc:
            raise PolicyError(str(exc)) from None
        if self.any_sparse and self.warmup_steps < 1:
            raise PolicyError("warmup_steps: top-k needs at least 1 uncompressed warm-up step, from "
                              "which Adam's second moment of its parameters is taken (onebit too); "
                              f"use warmup_steps >= 1 (default {DEFAULT_WARMUP_STEPS})")

    @classmethod
    def none(cls) -> "CompressionPolicy":
        return cls()

    @classmethod
    def uniform(cls, kind: str, ratio: float | None = None, warmup_steps: int | None = None,
                variance_refresh: int | str = DEFAULT_VARIANCE_REFRESH,
                warmup_fraction: float | None = None, train_iters: int | None = None,
                sparsity_warmup_steps: int | None = None) -> "CompressionPolicy":
        """One compressor for every parameter (the --grad-compression* flags)."""
        value = {"compressor": kind}
        if kind == "topk" and ratio is not None:
            value["ratio"] = ratio
        spec = CompressorSpec.parse(value, "grad_compression")
        cls._check_fraction(warmup_fraction)
        warmup = resolve_warmup(warmup_steps, warmup_fraction, train_iters, kind in FROZEN_VARIANCE)
        ramp = resolve_sparsity_warmup(sparsity_warmup_steps, train_iters, kind == "topk")
        return cls(spec, warmup if spec.compressed else 0, (), variance_refresh, ramp)

    @staticmethod
    def _check_fraction(fraction) -> None:
        try:
            check_fraction(fraction)
        except ValueError as exc:
            raise PolicyError(str(exc)) from None

    @classmethod
    def from_dict(cls, d: dict | None, train_iters: int | None = None) -> "CompressionPolicy":
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise PolicyError(f"grad_compression: expected a mapping, got {d!r}")
        extra = set(d) - {"default", "warmup_steps", "warmup_fraction", "variance_refresh",
                          "sparsity_warmup_steps", "rules"}
        if extra:
            raise PolicyError(f"{sorted(extra)[0]}: unknown key; a policy has default, warmup_steps, "
                              f"warmup_fraction, variance_refresh, sparsity_warmup_steps and rules")
        default = CompressorSpec.parse(d.get("default", "none"), "default")
        rules_in = d.get("rules", []) or []
        if not isinstance(rules_in, (list, tuple)):
            raise PolicyError(f"rules: expected a list of rules, got {rules_in!r}")
        rules = []
        for i, rule in enumerate(rules_in):
            where = f"rules[{i}]"
            if not isinstance(rule, dict):
                raise PolicyError(f"{where}: expected a mapping with pattern and compressor, got {rule!r}")
            pattern = rule.get("pattern")
            if not isinstance(pattern, str) or not pattern:
                raise PolicyError(f"{where}.pattern: expected a non-empty fnmatch string, got {pattern!r}")
            if "compressor" not in rule:
                raise PolicyError(f"{where}.compressor: missing; use one of {', '.join(KINDS)}")
            rules.append(Rule(pattern, CompressorSpec.parse(rule, where)))
        cls._check_fraction(d.get("warmup_fraction"))
        frozen = default.kind in FROZEN_VARIANCE or any(r.spec.kind in FROZEN_VARIANCE for r in rules)
        steps = d.get("warmup_steps")                      # (a bad value is named by __post_init__)
        warmup = steps if steps is not None else \
            resolve_warmup(None, d.get("warmup_fraction"), train_iters, frozen)
        topk = default.kind == "topk" or any(r.spec.kind == "topk" for r in rules)
        ramp = d.get("sparsity_warmup_steps")
        if ramp is None:
            ramp = resolve_sparsity_warmup(None, train_iters, topk)
        return cls(default, warmup, tuple(rules), d.get("variance_refresh", DEFAULT_VARIANCE_REFRESH),
                   ramp)

    @classmethod
    def coerce(cls, value, train_iters: int | None = None) -> "CompressionPolicy":
        """A policy from a policy, its dict form, None, or a config object carrying the flags
        grad_compression, grad_compression_ratio, grad_compression_warmup_steps / _fraction,
        grad_compression_variance_refresh, grad_compression_sparsity_warmup_steps and
        grad_compression_policy (the dict wins).
        ``train_iters`` sizes a fractional warm-up (without it the warm-up is 4 steps)."""
        if isinstance(value, cls):
            return value
        if value is None or isinstance(value, dict):
            return cls.from_dict(value, train_iters)
        if hasattr(value, "grad_compression"):
            if getattr(value, "grad_compression_policy", None):
                return cls.from_dict(value.grad_compression_policy, train_iters)
            return cls.uniform(value.grad_compression, getattr(value, "grad_compression_ratio", None),
                               getattr(value, "grad_compression_warmup_steps", None),
                               getattr(value, "grad_compression_variance_refresh",
                                       DEFAULT_VARIANCE_REFRESH),
                               getattr(value, "grad_compression_warmup_fraction", None), train_iters,
                               getattr(value, "grad_compression_sparsity_warmup_steps", None))
        raise PolicyError(f"grad_compression: expected a policy mapping, got {type(value).__name__}")

    def refresh_due(self, step: int) -> bool:
        """Whether 1-based ``step`` refreshes the frozen second moment (warmup.py's schedule)."""
        return refresh_at(step, self.warmup_steps, self.variance_refresh)

    def compressor_for(self, name: str) -> CompressorSpec:
        """The spec of the first rule whose pattern matches ``name`` (case-sensitive), else the default."""
        for rule in self.rules:
            if fnmatchcase(name, rule.pattern):
                return rule.spec
        return self.default

    def active(self, step: int) -> bool:
        """Whether compression applies at 1-based optimizer ``step`` (after the warm-up steps)."""
        return step > self.warmup_steps

    @property
    def any_compressed(self) -> bool:
        return self.default.compressed or any(r.spec.compressed for r in self.rules)

    @property
    def any_sparse(self) -> bool:
        """Whether some compressor freezes Adam's second moment (top-k, onebit)."""
        return self.default.kind in FROZEN_VARIANCE or any(r.spec.kind in FROZEN_VARIANCE
                                                           for r in self.rules)
